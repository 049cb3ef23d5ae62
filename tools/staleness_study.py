"""Staleness study: synchronous vs one-step-delayed training, AdamW vs Muon, with and without
error feedback (EF), on the same small llama, data and token budget.

Each arm is one `titan-async train` run (`training.gradient_delay` = 0 or 1, `optimizer.name`,
`optimizer.error_feedback.enabled`, `debug.seed`); the optimizers alternate, and every seed's
delay gap and EF recovery are trained before the other arms (`study_arms`). Learning rates are
fixed per optimizer for all its arms (chosen on the synchronous run with --tune-adamw /
--tune-muon). --seeds runs all 8 arms per seed; --noise-seeds adds repeats of
the synchronous no-EF arms only. Writes the table (CSV and README.md), the loss curves (CSV and
PNG), the resolved config of every run, the commands and the git revision into --out.

    .venv/bin/python tools/staleness_study.py [--steps N] [--seeds 0,1] [--out DIR] [--quick]
    .venv/bin/python tools/staleness_study.py --report-only --seeds 0,1   # rebuild --out only
    .venv/bin/python tools/staleness_study.py --moe        # the same arms on a mixture-of-experts model

The paper's regime, 20 tokens per parameter (REGIMES, CALIBRATION): a 279K-parameter llama, the lr
swept per optimizer on the synchronous arm, then 12 arms per seed (the 8 above plus Sync Start and
weight prediction for each optimizer); --dry-run prints the commands and the time estimate first:

    .venv/bin/python tools/staleness_study.py --regime tokens20 --sweep --seeds 0,1 --skip-done [--dry-run]
    .venv/bin/python tools/staleness_study.py --regime tokens20 --sweep --seeds 0,1 --skip-done --moe

With --moe the regime's model has 4 float32 experts (top-2) of hidden 48 in every block: 280,256
parameters, 20 tokens for each, its lrs swept on the same grids as the dense model's.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import shlex
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from titan_async.commands.compare import smooth
from titan_async.experiments.jobs import ROOT, record_config, run_jobs, run_recorded
from titan_async.experiments.staleness_runs import (
    CORRECTORS,
    OPTIMIZER_LABELS,
    OPTIMIZERS,
    Arm,
    Curves,
    Regime,
    Settings,
    best_lr,
    job,
    load_curves,
)

ANALYSIS_HEADING = "## Analysis"
PAPER = (
    "- 360M dense, 20 tokens/param: one-step delay costs AdamW +0.278 and Muon +0.012 (23x); "
    "EF recovers 50-90% of the gap",
    "- 10B MoE, 200B tokens, Muon: sync 1.906, delay 1.911 (+0.005), delay + EF 1.906 (100% recovered)",
)
"""The paper's numbers as quoted in docs/results/staleness/README.md and docs/results.md."""


def study_arms(seeds: list[int], noise_seeds: list[int] = (), correctors: bool = False) -> list[Arm]:
    """The arms of `seeds`, optimizers alternating: first, seed by seed, the six that measure the
    delay gap and EF's recovery of it (sync, delay 1, delay 1 + EF), then, seed by seed, sync + EF
    and, with `correctors`, the delayed Sync Start and weight-prediction arms (no EF), then each
    optimizer's synchronous no-EF arm for each of `noise_seeds`; no duplicates. An interrupted
    study thus has its main gaps at every seed first."""
    extra = [c for c in CORRECTORS if c] if correctors else []
    main = [(0, False), (1, False), (1, True)]
    arms = [Arm(opt, delay, ef, seed) for seed in seeds for delay, ef in main for opt in OPTIMIZERS]
    arms += [arm for seed in seeds for arm in
             [Arm(opt, 0, True, seed) for opt in OPTIMIZERS] + [Arm(opt, 1, False, seed, c) for c in extra for opt in OPTIMIZERS]]
    arms += [Arm(opt, 0, False, seed) for seed in noise_seeds for opt in OPTIMIZERS]
    return list(dict.fromkeys(arms))


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


@dataclass(frozen=True)
class Row:
    """One arm (over seeds) of the results table, keyed by seed:
    - `finals`: final validation loss;
    - `gaps`: minus that of the synchronous no-EF run of the same optimizer and seed;
    - `gaps_same_ef`: minus that of the synchronous run with the same EF setting and seed;
    - `wall_s`: wall seconds of the run, where known.
    `ef_recovery` (delayed arms with EF or a corrector, whose plain delay arm's mean gap is
    positive) is the share of that mean gap that the EF or corrector removes, on the seeds both ran."""

    arm: Arm
    finals: dict[int, float]
    gaps: dict[int, float]
    gaps_same_ef: dict[int, float]
    ef_recovery: float | None
    wall_s: dict[int, float]

    @property
    def mean_gap(self) -> float:
        return _mean(list(self.gaps.values()))

    @property
    def mean_gap_same_ef(self) -> float:
        return _mean(list(self.gaps_same_ef.values()))

    @property
    def gap_range(self) -> tuple[float, float] | None:
        """(min, max) of the gap over seeds; None without a gap."""
        return (min(self.gaps.values()), max(self.gaps.values())) if self.gaps else None


def _gaps(curves: dict[Arm, Curves], arm: Arm, reference: Arm) -> dict[int, float]:
    """Seed -> final validation of `arm` minus `reference`'s (seed-0 keys) at that seed, for the
    seeds where both ran."""
    seeds = sorted({a.seed for a in curves})
    return {
        s: curves[arm.at(s)].final_validation - curves[reference.at(s)].final_validation
        for s in seeds
        if arm.at(s) in curves and reference.at(s) in curves
    }


def build_table(curves: dict[Arm, Curves], wall_s: dict[Arm, float] | None = None) -> list[Row]:
    """One row per arm that ran at seed 0, AdamW rows first (sync, sync+EF, delay, delay+EF, then
    the correctors).
    Raises KeyError if a seed-0 reference (synchronous no-EF) run is missing."""
    wall_s = wall_s or {}
    keys = sorted((a for a in curves if a.seed == 0), key=lambda a: (OPTIMIZERS.index(a.optimizer), a.delay, CORRECTORS.index(a.corrector), a.ef))
    rows = []
    for arm in keys:
        reference = arm.at(0, delay=0, ef=False, corrector="")
        if reference not in curves:
            raise KeyError(f"{arm.name} has no reference run {reference.name}")
        seeds = sorted(a.seed for a in curves if a.at(0) == arm)
        gaps = _gaps(curves, arm, reference)
        recovery = None
        if arm.delay and (arm.ef or arm.corrector):
            plain_gaps = _gaps(curves, arm.at(0, ef=False, corrector=""), reference)
            common = [s for s in gaps if s in plain_gaps]
            plain_mean = _mean([plain_gaps[s] for s in common])
            if plain_mean > 0:
                recovery = 1 - _mean([gaps[s] for s in common]) / plain_mean
        rows.append(Row(
            arm,
            {s: curves[arm.at(s)].final_validation for s in seeds},
            gaps,
            _gaps(curves, arm, arm.at(0, delay=0, corrector="")),
            recovery,
            {s: wall_s[arm.at(s)] for s in seeds if arm.at(s) in wall_s},
        ))
    return rows


@dataclass(frozen=True)
class Noise:
    """Seed-to-seed noise of the final validation loss.
    `gap`: largest (max - min over seeds) of a delayed or EF arm's gap, None with fewer than two
    seeds of such an arm; `sync`: largest (max - min over seeds) of a synchronous no-EF final loss,
    None without repeats. The claims compare gaps (differences between arms at the same seed), so
    `gap` is the noise that matters; `sync` stands in for it when no delayed arm was repeated."""

    gap: float | None
    sync: float | None

    @property
    def threshold(self) -> float:
        """Margin a claim must exceed to hold clearly: 2 x `gap` if known, else 2 x `sync`, else 0."""
        level = self.gap if self.gap is not None else self.sync
        return 2 * level if level is not None else 0.0


def measure_noise(rows: list[Row]) -> Noise:
    """The Noise of a table."""
    gap_spreads = [max(r.gaps.values()) - min(r.gaps.values()) for r in rows if (r.arm.delay or r.arm.ef) and len(r.gaps) > 1]
    sync_spreads = [max(r.finals.values()) - min(r.finals.values()) for r in rows if not (r.arm.delay or r.arm.ef) and len(r.finals) > 1]
    return Noise(max(gap_spreads, default=None), max(sync_spreads, default=None))


@dataclass(frozen=True)
class Claim:
    """One ordering claim of the paper: its margin per seed (positive = in the claimed direction),
    and whether it holds clearly: positive at every seed, mean above the noise threshold."""

    text: str
    margins: dict[int, float]
    threshold: float

    @property
    def mean(self) -> float:
        return _mean(list(self.margins.values()))

    @property
    def holds(self) -> bool:
        return bool(self.margins) and min(self.margins.values()) > 0 and self.mean > self.threshold


def check_ordering(rows: list[Row], threshold: float) -> list[Claim]:
    """The paper's ordering, on the seeds where the arms involved all ran: AdamW's delay gap
    exceeds Muon's, and EF shrinks each optimizer's delay gap (the rows without a corrector)."""
    gaps = {(r.arm.optimizer, r.arm.delay, r.arm.ef): r.gaps for r in rows if not r.arm.corrector}

    def difference(a: dict[int, float], b: dict[int, float]) -> dict[int, float]:
        return {s: a[s] - b[s] for s in a if s in b}

    claims = [Claim("AdamW delay gap > Muon delay gap", difference(gaps[("adamw", 1, False)], gaps[("muon", 1, False)]), threshold)]
    for opt in OPTIMIZERS:
        claims.append(Claim(f"EF reduces {OPTIMIZER_LABELS[opt]}'s delay gap", difference(gaps[(opt, 1, False)], gaps[(opt, 1, True)]), threshold))
    return claims


def write_table_csv(rows: list[Row], path: Path) -> None:
    """One CSV line per run: arm, optimizer, delay, ef, seed, final_validation_loss, gap_to_sync,
    gap_to_sync_same_ef, wall_s (empty if unknown)."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["arm", "optimizer", "delay", "ef", "seed", "final_validation_loss", "gap_to_sync", "gap_to_sync_same_ef", "wall_s"])
        for r in rows:
            for seed, final in r.finals.items():
                writer.writerow([
                    r.arm.at(seed).name, r.arm.optimizer, r.arm.delay, int(r.arm.ef), seed, f"{final:.5f}",
                    _signed(r.gaps.get(seed)), _signed(r.gaps_same_ef.get(seed)),
                    "" if seed not in r.wall_s else f"{r.wall_s[seed]:.1f}",
                ])


def _signed(value: float | None, digits: int = 5) -> str:
    return "" if value is None or math.isnan(value) else f"{value:+.{digits}f}"


def write_curves_csv(curves: dict[Arm, Curves], path: Path) -> None:
    """Long-format curves: arm, kind (train|validation), step, loss."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["arm", "kind", "step", "loss"])
        for arm, c in curves.items():
            for kind, points in (("train", c.train), ("validation", c.validation)):
                writer.writerows([arm.name, kind, step, f"{loss:.5f}"] for step, loss in points)


def format_table(rows: list[Row]) -> str:
    """The table as GitHub markdown: final loss and gap per seed, mean gap with its range over
    seeds beside it, the gap against the same-EF sync run, and the share of the delay gap that EF
    or a corrector recovers."""
    seeds = sorted({s for r in rows for s in r.finals})
    head = ["arm"] + [f"final val loss (seed {s})" for s in seeds] + [f"gap to sync (seed {s})" for s in seeds]
    head += ["mean gap to sync", "gap range over seeds", "mean gap to sync, same EF", "recovers of delay gap"]
    lines = ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
    for r in rows:
        cells = [r.arm.label]
        cells += [f"{r.finals[s]:.4f}" if s in r.finals else "" for s in seeds]
        cells += [_signed(r.gaps.get(s), 4) for s in seeds]
        cells += [_signed(r.mean_gap, 4), format_range(r.gap_range), _signed(r.mean_gap_same_ef, 4)]
        cells.append("" if r.ef_recovery is None else f"{100 * r.ef_recovery:.0f}%")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_range(bounds: tuple[float, float] | None) -> str:
    """`min..max` of a gap over seeds (signed, 4 decimals); empty if unknown."""
    return "" if bounds is None else f"{_signed(bounds[0], 4)}..{_signed(bounds[1], 4)}"


def format_tuning(path: Path) -> str:
    """tuning.csv (written by `tune`) as a markdown table, without the command column."""
    with open(path, newline="") as f:
        records = list(csv.DictReader(f))
    lines = ["| optimizer | lr | Muon's AdamW lr | final val loss |", "|---|---:|---:|---:|"]
    lines += [f"| {r['optimizer']} | {r['lr']} | {r['muon_adamw_lr']} | {float(r['final_validation_loss']):.4f} |" for r in records]
    return "\n".join(lines)


def plot_curves(curves: dict[Arm, Curves], path: Path) -> None:
    """PNG: validation (top) and smoothed training loss (bottom), one column per optimizer, one
    colour per arm; seed 0 solid, other seeds thinner and dotted. Each row shares a y range that
    covers the curves past the first 20% of training, where they separate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {(0, False, ""): "C0", (0, True, ""): "C2", (1, False, ""): "C3", (1, True, ""): "C1",
              (1, False, "sync_start"): "C4", (1, False, "predict"): "C5"}
    fig, axes = plt.subplots(2, len(OPTIMIZERS), figsize=(12, 8), sharex=True, sharey="row", squeeze=False)
    for row, kind in enumerate(("validation", "train")):
        ys = []
        for col, opt in enumerate(OPTIMIZERS):
            ax = axes[row][col]
            for arm, c in sorted(curves.items(), key=lambda item: (item[0].seed, item[0].delay, item[0].ef, CORRECTORS.index(item[0].corrector))):
                points = c.validation if kind == "validation" else c.train
                if arm.optimizer != opt or not points:
                    continue
                steps = [s for s, _ in points]
                losses = [v for _, v in points] if kind == "validation" else smooth([v for _, v in points])
                style = dict(lw=1.8, ls="-", label=arm.label) if arm.seed == 0 else dict(lw=0.9, ls=":", label=f"{arm.label} (seed {arm.seed})")
                ax.plot(steps, losses, color=colors[(arm.delay, arm.ef, arm.corrector)], marker="o" if kind == "validation" else None, ms=3, **style)
                ys += [v for s, v in zip(steps, losses) if s >= 0.2 * steps[-1]]
            ax.set_title(f"{OPTIMIZER_LABELS[opt]}: {'validation' if kind == 'validation' else 'training (EMA 0.9)'} loss")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
            if row == 1:
                ax.set_xlabel("step")
        if ys:
            pad = 0.05 * (max(ys) - min(ys) or 1)
            axes[row][0].set_ylim(min(ys) - pad, max(ys) + pad)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


CALIBRATION = """Calibration (30-step runs, `debug_cpu`, seq 256 x batch 16, one run at a time on the 2 cores
while other work held the 1-minute load average at 3-7):
- dim 64, 4 layers, vocab 2048: 475,712 parameters; 700-1,900 tokens/s under load, 5,000-16,500
  tokens/s in the steps where the cores were free;
- dim 64, 2 layers, vocab 2048, seq 128 x batch 32: 2,000-2,400 tokens/s under load, 6,100 free;
- dim 64, 4 layers, vocab 512 (`tokens20`): 279,104 parameters; about 1,350 tokens/s under load;
  on free cores (60-step runs, Muon + EF, delay 1) 26,100 tokens/s alone and 18,200 each with two
  at once (`--parallel 2`, one thread each): 1.4 times the throughput of one run at a time.
- the MoE blocks of `tokens20 --moe` (20-40-step runs beside two dense study runs, so relative
  to those): 8 bfloat16 experts of hidden 48, 2,800 tokens/s; the same in float32, 5,600 (the dense
  runs beside them: 12,800); 8 float32 experts of hidden 24, 2,600, and 4 of hidden 48, 6,300 (the
  two run together): the CPU's cost grows with the number of experts, not their size.
The full MoE study then ran its 1,370-step runs two at a time in 341-420 s each on otherwise idle
cores: about 14,000 tokens/s per run. The estimate uses 18,000 tokens/s per run, two at a time, and
14,000 for the MoE blocks; under load expect several times longer."""

REGIMES = {"tokens20": Regime(64, 4, 4, 512, 64, 256, 16, 20.0, 18_000.0)}
"""--regime: `tokens20` trains 20 tokens per parameter (the paper's budget) on a 279K-parameter llama."""
SWEEP = {"adamw": (1.5e-3, 3e-3, 6e-3, 1.2e-2), "muon": (5e-3, 1e-2, 2e-2, 4e-2)}
"""--sweep: factor-2 lr grids, synchronous no-EF runs at the full budget; the best lr is used for
every arm of that optimizer (Muon's AdamW groups take AdamW's best). A grid whose best lr is at
an end grows by a factor 2 beyond it (`grown`), at most EXTENSIONS times, so that the best is
bracketed."""
EXTENSIONS = 2


def finished(run_dir: Path, steps: int) -> bool:
    """Whether `run_dir` holds a run that validated at step `steps`."""
    metrics = run_dir / "metrics.jsonl"
    return metrics.is_file() and any(step == steps for step, _ in load_curves(metrics).validation)


def write_readme(path: Path, rows: list[Row], claims: list[Claim], sections: dict[str, str], model: str = "") -> None:
    """README.md: the table, the ordering verdicts and `sections` (heading -> markdown body),
    followed by the hand-written part from ANALYSIS_HEADING on of an existing README.md."""
    old = path.read_text() if path.is_file() else ""
    analysis = old[old.index(ANALYSIS_HEADING):] if ANALYSIS_HEADING in old else ""
    parts = [f"# Staleness study{model}: one-step delay, AdamW vs Muon, with and without error feedback", "", format_table(rows), ""]
    parts += ["## Ordering (paper: AdamW gap >> Muon gap; EF shrinks both)", ""]
    for c in claims:
        per_seed = ", ".join(f"seed {s} {m:+.4f}" for s, m in c.margins.items())
        verdict = "holds" if c.holds else "does not hold clearly"
        parts.append(f"- {c.text}: margin {per_seed}; mean {c.mean:+.4f} vs threshold {c.threshold:.4f} -> {verdict}")
    for heading, body in sections.items():
        parts += ["", f"## {heading}", "", body]
    path.write_text("\n".join(parts) + "\n" + ("\n" + analysis if analysis else ""))


def noise_section(noise: Noise) -> str:
    """The README's account of the noise and the threshold derived from it."""
    lines = [
        "- seed-to-seed spread (max - min) of a delayed or EF arm's gap to sync at the same seed: "
        + ("not measured (one seed)" if noise.gap is None else f"largest {noise.gap:.4f}"),
        "- seed-to-seed spread of a synchronous no-EF final validation loss: "
        + ("not measured" if noise.sync is None else f"largest {noise.sync:.4f}"),
        f"- a claim holds clearly when its margin is positive at every seed and its mean exceeds {noise.threshold:.4f} "
        "(2 x the gap spread; 2 x the synchronous spread where no gap spread was measured)",
        "- every arm validates on the same held-out batches and runs are deterministic at a fixed seed "
        "(a repeated configuration reproduces its losses exactly), so the seed is the noise source that matters",
    ]
    return "\n".join(lines)


def collect(arms: list[Arm], runs_dir: Path, steps: int | None = None) -> dict[Arm, Curves]:
    """Curves of the arms whose run in `runs_dir` left a metrics.jsonl; with `steps`, only of the
    runs that finished (validated at step `steps`): a run still training has no final loss yet."""
    found = {}
    for arm in arms:
        metrics = runs_dir / arm.name / "metrics.jsonl"
        if metrics.is_file() and (steps is None or finished(runs_dir / arm.name, steps)):
            found[arm] = load_curves(metrics)
    return found


def report(arms: list[Arm], runs_dir: Path, out: Path, wall_s: dict[Arm, float], how: list[str], model: str = "", paper: bool = False,
           steps: int | None = None) -> None:
    """Build the table, checks, CSVs, PNG, configs and README.md in `out` from the runs in
    `runs_dir` (with `steps`, the finished ones); `how` lists the invocations (markdown lines)
    that trained them; `paper` adds the paper's numbers (PAPER) as a section."""
    curves = collect(arms, runs_dir, steps)
    rows = build_table(curves, wall_s)
    noise = measure_noise(rows)
    claims = check_ordering(rows, noise.threshold)
    out.mkdir(parents=True, exist_ok=True)
    (out / "configs").mkdir(exist_ok=True)
    for arm in curves:
        record_config(runs_dir / arm.name, out / "configs" / f"{arm.name}.toml")
    write_table_csv(rows, out / "table.csv")
    write_curves_csv(curves, out / "curves.csv")
    plot_curves(curves, out / "curves.png")
    sections = {"Noise": noise_section(noise)}
    if paper:
        sections["The paper's numbers, for comparison"] = "\n".join(PAPER)
    if how:
        sections["How it was run"] = "\n".join(how + ["- resolved config of every run: configs/<arm>.toml; curves: curves.csv, curves.png; per-run table: table.csv"])
    if (out / "tuning.csv").is_file():
        sections["Learning-rate tuning (synchronous no-EF runs only; tuning.csv has the commands)"] = format_tuning(out / "tuning.csv")
    write_readme(out / "README.md", rows, claims, sections, model)
    print(format_table(rows))
    for c in claims:
        print(f"{c.text}: mean margin {c.mean:+.4f} ({'holds' if c.holds else 'does not hold clearly'}, threshold {c.threshold:.4f})")


def regime_of(args: argparse.Namespace) -> Regime | None:
    """--regime's preset, with the MoE blocks under --moe."""
    return replace(REGIMES[args.regime], moe=args.moe) if args.regime else None


def settings_from(args: argparse.Namespace) -> Settings:
    """Study settings from the command line; --quick replaces the model and budget by tiny ones,
    --regime by the preset's."""
    if args.regime:
        return regime_of(args).settings(args.adamw_lr, args.muon_lr, args.muon_adamw_lr)
    if args.quick:
        return Settings(6, args.adamw_lr, args.muon_lr, args.muon_adamw_lr, 64, 2, 4, 64, 2, 3, 2, 1, args.moe)
    return Settings(
        args.steps, args.adamw_lr, args.muon_lr, args.muon_adamw_lr, args.dim, args.n_layers, args.n_heads,
        args.seq_len, args.batch, args.validation_freq, args.validation_steps, max(1, args.steps // 10), args.moe,
    )


def copied_from_the_sweep(arm: Arm, settings: Settings, runs_dir: Path) -> bool:
    """Whether `arm` is the sweep's finished run at the chosen lr (seed 0, synchronous, no EF, no
    corrector: the same command), now copied into its run directory instead of trained again."""
    lr = settings.adamw_lr if arm.optimizer == "adamw" else settings.muon_lr
    tuned = runs_dir / "tune" / f"{arm.optimizer}-lr{lr:g}"
    if arm != Arm(arm.optimizer, 0, False) or not finished(tuned, settings.steps):
        return False
    shutil.rmtree(runs_dir / arm.name, ignore_errors=True)
    shutil.copytree(tuned, runs_dir / arm.name)
    return True


def run_study(args: argparse.Namespace, settings: Settings, arms: list[Arm]) -> tuple[dict[str, float], list[str]]:
    """Train the arms (those already finished in --runs-dir are kept under --skip-done); return
    wall seconds per trained run name and markdown lines describing this invocation."""
    todo = [a for a in arms if not (args.skip_done and finished(args.runs_dir / a.name, settings.steps))]
    if args.sweep:
        todo = [a for a in todo if not copied_from_the_sweep(a, settings, args.runs_dir)]
    walls, invocation = run_recorded("tools/staleness_study.py", args.argv, [job(a, settings, args.runs_dir / a.name) for a in todo], args.parallel)
    every_run = shlex.join(job(Arm("adamw", 0, False), settings, Path("RUN")).command()[1:])
    how = [
        invocation,
        f"  - each run: `python {every_run}`, with the arm's `optimizer.lr`, `optimizer.name`, "
        "`training.gradient_delay`, `optimizer.error_feedback.enabled` and `debug.seed` (Muon arms also "
        f"`optimizer.muon.adamw_lr`), and LOCAL_WORLD_SIZE={args.parallel} in its environment "
        "(intra-op threads = cores // LOCAL_WORLD_SIZE)",
    ]
    return {a.name: w for a, w in zip(todo, walls)}, how


def tune(args: argparse.Namespace, settings: Settings) -> None:
    """Synchronous no-EF runs of each optimizer at each lr of --tune-adamw / --tune-muon; appends
    (optimizer, lr, muon_adamw_lr, final validation loss, command) to `out`/tuning.csv."""
    jobs = [(Arm("adamw", 0, False), replace(settings, adamw_lr=lr), args.runs_dir / "tune" / f"adamw-lr{lr:g}") for lr in args.tune_adamw]
    jobs += [(Arm("muon", 0, False), replace(settings, muon_lr=lr), args.runs_dir / "tune" / f"muon-lr{lr:g}") for lr in args.tune_muon]
    run_jobs([job(*j) for j in jobs], args.parallel)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "tuning.csv"
    new = not path.is_file()
    command = shlex.join([".venv/bin/python", "tools/staleness_study.py", *args.argv])
    with open(path, "a", newline="") as f:
        writer = csv.writer(f)
        if new:
            writer.writerow(["optimizer", "lr", "muon_adamw_lr", "final_validation_loss", "command"])
        for arm, job_settings, run_dir in jobs:
            loss = load_curves(run_dir / "metrics.jsonl").final_validation
            lr = job_settings.adamw_lr if arm.optimizer == "adamw" else job_settings.muon_lr
            muon_adamw_lr = "" if arm.optimizer == "adamw" else f"{job_settings.muon_adamw_lr:g}"
            writer.writerow([arm.optimizer, f"{lr:g}", muon_adamw_lr, f"{loss:.5f}", command])
            print(f"{arm.optimizer} lr {lr:g}: final validation loss {loss:.4f}")


def sweep_jobs(settings: Settings, runs_dir: Path, optimizer: str, grid: tuple[float, ...] | None = None) -> list[tuple[Arm, Settings, Path]]:
    """The synchronous no-EF runs of `optimizer` at each lr of `grid` (default: its SWEEP grid)."""
    field_name = "adamw_lr" if optimizer == "adamw" else "muon_lr"
    return [(Arm(optimizer, 0, False), replace(settings, **{field_name: lr}), runs_dir / "tune" / f"{optimizer}-lr{lr:g}")
            for lr in grid or SWEEP[optimizer]]


def grown(grid: tuple[float, ...], losses: dict[float, float], base: tuple[float, ...]) -> tuple[float, ...] | None:
    """`grid` with one more lr, a factor 2 beyond its end, when the best lr is that end and the
    grid has grown fewer than EXTENSIONS times beyond `base`; else None (the best is bracketed)."""
    if len(grid) >= len(base) + EXTENSIONS:
        return None
    best = best_lr(losses)
    if best == max(grid):
        return (*grid, 2 * best)
    if best == min(grid):
        return (best / 2, *grid)
    return None


def sweep(args: argparse.Namespace, settings: Settings) -> Settings:
    """--sweep: AdamW's grid, then Muon's with its AdamW groups at AdamW's best lr, each grown
    until its best lr is bracketed (`grown`; runs already finished in --runs-dir/tune are kept);
    writes `out`/tuning.csv and returns `settings` with the best lrs."""
    rows = []
    for optimizer in OPTIMIZERS:
        grid: tuple[float, ...] | None = SWEEP[optimizer]
        while grid:
            jobs = sweep_jobs(settings, args.runs_dir, optimizer, grid)
            run_jobs([job(*j) for j in jobs if not finished(j[2], settings.steps)], args.parallel)
            losses = {}
            for _, job_settings, run_dir in jobs:
                lr = job_settings.adamw_lr if optimizer == "adamw" else job_settings.muon_lr
                losses[lr] = load_curves(run_dir / "metrics.jsonl").final_validation
            grid = grown(grid, losses, SWEEP[optimizer])
        rows += [[optimizer, f"{lr:g}", "" if optimizer == "adamw" else f"{settings.muon_adamw_lr:g}", f"{loss:.5f}"]
                 for lr, loss in losses.items()]
        lr = best_lr(losses)
        settings = replace(settings, adamw_lr=lr, muon_adamw_lr=lr) if optimizer == "adamw" else replace(settings, muon_lr=lr)
        print(f"{optimizer}: best lr {lr:g}")
    args.out.mkdir(parents=True, exist_ok=True)
    command = shlex.join([".venv/bin/python", "tools/staleness_study.py", *args.argv])
    with open(args.out / "tuning.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["optimizer", "lr", "muon_adamw_lr", "final_validation_loss", "command"])
        writer.writerows(row + [command] for row in rows)
    return settings


def dry_run(args: argparse.Namespace, settings: Settings, arms: list[Arm], regime: Regime | None) -> str:
    """What a run of this invocation would do, without training: the model, tokens per arm, every
    command and (with a regime) the estimated wall time per arm and in total."""
    lines = []
    trained = [a for a in arms if not (args.sweep and a == Arm(a.optimizer, 0, False))]  # else copied from the sweep
    runs = [job(a, settings, args.runs_dir / a.name) for a in trained]
    if args.sweep:
        runs = [job(*j) for opt in OPTIMIZERS for j in sweep_jobs(settings, args.runs_dir, opt)] + runs
    tokens = settings.steps * settings.seq_len * settings.batch
    if regime is not None:
        lines.append(f"model: dim {regime.dim}, {regime.n_layers} layers, {regime.n_heads} heads, vocab {regime.vocab_size}, "
                     + (f"{regime.moe_experts} float32 experts of hidden size {regime.moe_hidden_dim}, top-2" if regime.moe else f"FFN multiple_of {regime.multiple_of}")
                     + f": {regime.parameters:,} parameters (total, every expert, embedding and head included)")
    lines.append(f"per arm: {settings.steps} steps x {settings.seq_len} x {settings.batch} = {tokens:,} tokens")
    if regime is not None:
        lines.append(f"  = {tokens / regime.parameters:.2f} tokens per parameter")
        tps = regime.moe_tps if regime.moe else regime.tps
        minutes = tokens / tps / 60
        lines.append(f"estimate at {tps:,.0f} tokens/s per run, two at a time on free cores: {minutes:.1f} min per arm, "
                     f"{len(runs)} runs ({len(runs) - len(trained)} sweep + {len(trained)} arms; "
                     f"{len(arms) - len(trained)} arms are sweep runs): {len(runs) * minutes / 2 / 60:.1f} h in all")
    lines += ["commands:"] + [f"  {shlex.join(j.command())}" for j in runs]
    return "\n".join(lines)


def _numbers(kind: type) -> Callable[[str], list]:
    """argparse type: comma-separated values of `kind`."""

    def parse(text: str) -> list:
        return [kind(x) for x in text.split(",") if x]

    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="optimizer steps per run (warm-up: 10%% of them)")
    p.add_argument("--adamw-lr", type=float, default=6e-3, help="AdamW peak lr (all AdamW arms)")
    p.add_argument("--muon-lr", type=float, default=1e-2, help="Muon peak lr (all Muon arms)")
    p.add_argument("--muon-adamw-lr", type=float, default=6e-3, help="lr of Muon's AdamW groups (embeddings, head, norms)")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--validation-freq", type=int, default=40)
    p.add_argument("--validation-steps", type=int, default=32, help="validation batches per evaluation")
    p.add_argument("--seeds", type=_numbers(int), default=[0], metavar="S,S,..", help="seeds at which all 8 arms run")
    p.add_argument("--noise-seeds", type=_numbers(int), default=[], metavar="S,S,..", help="seeds at which the synchronous no-EF arms also run")
    p.add_argument("--parallel", type=int, default=2, help="runs at a time (each gets cores // parallel threads)")
    p.add_argument("--skip-done", action="store_true", help="keep runs in --runs-dir that already finished")
    p.add_argument("--quick", action="store_true", help="tiny model and 6 steps (smoke test)")
    p.add_argument("--moe", action="store_true", help="a mixture-of-experts model (MOE) instead of the dense llama")
    p.add_argument("--runs-dir", type=Path, help="where the runs go (default: runs/staleness[-quick])")
    p.add_argument("--out", type=Path, help="results folder (default: docs/results/staleness, or runs/staleness-quick/results)")
    p.add_argument("--report-only", action="store_true", help="rebuild --out from the runs in --runs-dir, training nothing")
    p.add_argument("--tune-adamw", type=_numbers(float), default=[], metavar="LR,LR,..", help="tune: synchronous AdamW runs at these lrs")
    p.add_argument("--tune-muon", type=_numbers(float), default=[], metavar="LR,LR,..", help="tune: synchronous Muon runs at these lrs")
    p.add_argument("--regime", choices=sorted(REGIMES), help="a preset model and token budget (REGIMES); adds the Sync Start and weight-prediction arms")
    p.add_argument("--sweep", action="store_true", help="with --regime: first the SWEEP lr grids on the synchronous arm, then the arms at the best lrs")
    p.add_argument("--dry-run", action="store_true", help="print the model, tokens, commands and time estimate; train nothing")
    args = p.parse_args(argv)
    if args.sweep and not args.regime:
        p.error("--sweep needs --regime")
    suffix = (f"-{args.regime}" if args.regime else "") + ("-moe" if args.moe else "") + ("-quick" if args.quick else "")
    args.runs_dir = args.runs_dir or ROOT / "runs" / f"staleness{suffix}"
    args.out = args.out or (args.runs_dir / "results" if args.quick else ROOT / "docs" / "results" / f"staleness{suffix.replace('-', '_')}")
    args.argv = sys.argv[1:] if argv is None else argv
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    settings = settings_from(args)
    if args.tune_adamw or args.tune_muon:
        tune(args, settings)
        return
    arms = study_arms(args.seeds, args.noise_seeds, correctors=bool(args.regime))
    if args.dry_run:
        print(dry_run(args, settings, arms, regime_of(args)))
        return
    if args.sweep and not args.report_only:
        settings = sweep(args, settings)
    record_file = args.runs_dir / "study.json"
    record = json.loads(record_file.read_text()) if record_file.is_file() else {"wall_s": {}, "how": []}
    if not args.report_only:
        args.runs_dir.mkdir(parents=True, exist_ok=True)
        walls, how = run_study(args, settings, arms)
        record = {"wall_s": {**record["wall_s"], **walls}, "how": record["how"] + how}
        record_file.write_text(json.dumps(record, indent=1))
    wall_s = {a: record["wall_s"][a.name] for a in arms if a.name in record["wall_s"]}
    model = (" (mixture of experts, qwen3 blocks)" if args.moe else "") + (f", {args.regime}" if args.regime else "")
    report(arms, args.runs_dir, args.out, wall_s, record["how"], model, paper=bool(args.regime), steps=settings.steps)


if __name__ == "__main__":
    main()
