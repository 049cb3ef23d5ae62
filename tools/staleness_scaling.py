"""Staleness scaling study: what sets the cost of the one-step delay at 20 tokens per parameter.

Cells (CELLS) vary the number of optimizer steps at a fixed token budget (the batch: 1,024,
4,096 and 16,384 tokens per step on the 279K-parameter llama of `staleness_study.py --regime
tokens20`) and the model size (a 541K-parameter llama). In each cell, for AdamW and Muon:
1. a small lr sweep of the synchronous run (3 lrs a factor 2 apart around the cell's guess,
   grown until the best is bracketed);
2. at the best lr, the delayed arms: delay 1, delay 1 + EF, delay 1 + weight prediction;
3. synchronous runs at BUDGETS of the tokens (each its own full lr schedule), which give the
   synchronous final loss as a function of the token budget: token efficiency is read from it.
SEEDS_OF_CELL adds seeds of the synchronous and delayed arms, after every cell's seed-0 runs;
LONGER_DELAYS' arms (d = 2, 4) come first.

Every finished run is appended at once to RECORD (docs/results/staleness_scaling/runs.jsonl:
its cell, name, settings, wall seconds and validation curve), and a run found there is never
trained again: the study stops anywhere (a session's end) and continues, with the same command,
on a fresh checkout. The `tokens20` cell's runs come from docs/results/staleness_tokens20.

    .venv/bin/python tools/staleness_scaling.py [--cells b64,b16,b4,540k] [--parallel 2] [--dry-run]
    .venv/bin/python tools/staleness_scaling.py --report-only    # tables, fit and README only
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from titan_async.cluster import staleness
from titan_async.cluster.staleness import LAW_FILE, Law
from titan_async.experiments.jobs import ROOT, git_state, record_config, run_job
from titan_async.experiments.staleness_runs import RESCHEDULE_SHARE, Arm, Regime, Settings, best_lr, job, load_curves

OUT = ROOT / "docs" / "results" / "staleness_scaling"
RECORD = OUT / "runs.jsonl"
RUNS = ROOT / "runs" / "staleness_scaling"
TOKENS20 = ROOT / "docs" / "results" / "staleness_tokens20"
BUDGETS = (0.5, 0.7)
"""Shares of the cell's token budget at which the synchronous arm also runs (BUDGETS and 1.0
give the synchronous loss against tokens)."""
VALIDATION_SEQUENCES = 512
"""Held-out sequences of every evaluation in every cell (validation batches x batch), so that
every cell validates on the same tokens."""
DELAYED = (Arm("adamw", 1, False), Arm("muon", 1, False), Arm("adamw", 1, True), Arm("muon", 1, True),
           Arm("adamw", 1, False, corrector="predict"), Arm("muon", 1, False, corrector="predict"))
LONGER_DELAYS = ("b16", (2, 4), (0, 1))
"""(cell, delays, seeds) of the longer-delay arms: PipeDream2BW with fewer microbatches than stages
delays by d = ceil((p - 1) / m) steps (`training.gradient_delay = d`), plain, with error feedback
and with weight prediction (both extrapolating by d), and with the lr rescheduled by d (over
the first quarter of the steps), before the runs still pending (the advisor's columns with
fewer microbatches than stages wait on them)."""
LONGER_DELAY_CORRECTORS = ("none", "ef", "predict", "reschedule")
"""The correctors of the longer-delay table; the law's delay term covers the first three (the
rescheduling is the plain delay at d = 1)."""


@dataclass(frozen=True)
class Cell:
    """One model and batch size at 20 tokens per parameter, with the centres of its lr sweeps
    (Muon's AdamW groups run at `adamw_lr` throughout the cell)."""

    name: str
    regime: Regime
    adamw_lr: float
    muon_lr: float

    def settings(self, adamw_lr: float, muon_lr: float, budget: float = 1.0) -> Settings:
        """The cell's run settings at these lrs and `budget` x its tokens (steps a multiple of the
        10 evaluations, warm-up 5% of them)."""
        steps = self.regime.steps if budget == 1.0 else 10 * round(budget * self.regime.steps / 10)
        base = self.regime.settings(adamw_lr, muon_lr, self.adamw_lr)
        return replace(base, steps=steps, validation_freq=steps // 10, warmup_steps=max(1, round(0.05 * steps)),
                       validation_steps=VALIDATION_SEQUENCES // self.regime.batch)


def _regime(dim: int, batch: int) -> Regime:
    """The tokens20 llama (4 layers, 4 heads, vocab 512, seq 256) at `dim` and `batch` sequences."""
    return Regime(dim, 4, 4, 512, 64, 256, batch, 20.0, 18_000.0)


CELLS = {
    "b64": Cell("b64", _regime(64, 64), 1.2e-2, 2e-2),
    "b16": Cell("b16", _regime(64, 16), 6e-3, 1e-2),
    "b4": Cell("b4", _regime(64, 4), 3e-3, 1e-2),
    "540k": Cell("540k", _regime(96, 32), 6e-3, 1e-2),
}
"""b64, b16, b4: the 279,104-parameter llama at 16,384, 4,096 and 1,024 tokens per step (350,
1,370 and 5,460 steps); 540k: dim 96, 541,536 parameters at 8,192 tokens per step (1,330 steps,
about b16's). b16 is `staleness_study.py --regime tokens20`, whose sweep and arms are imported.
A run costs about parameters x tokens: a 1M-parameter cell (12 times b16's cost per run, about 80
minutes two at a time) did not fit the study's budget of about 10 hours."""
SEEDS_OF_CELL = {"b64": (0,), "b16": (0, 1), "b4": (0, 1), "540k": (0,)}
"""Seeds of the synchronous and delayed arms (seed 0 first): the extra ones train after every
cell's seed-0 runs. b64's gaps (0.10-0.43) are several times b16's seed-to-seed spread (at most
0.034), so one seed settles them."""


@dataclass(frozen=True)
class Run:
    """One training run of a cell: an arm at an lr and a share of the cell's tokens."""

    cell: Cell
    arm: Arm
    lr: float
    budget: float = 1.0
    sweep: bool = False

    @property
    def name(self) -> str:
        if self.sweep:
            return f"tune-{self.arm.optimizer}-lr{self.lr:g}"
        return self.arm.name + (f"-budget{self.budget:g}" if self.budget != 1.0 else "")

    @property
    def key(self) -> str:
        return f"{self.cell.name}/{self.name}"

    def settings(self, best: dict[str, float]) -> Settings:
        lrs = {**best, self.arm.optimizer: self.lr}
        return self.cell.settings(lrs.get("adamw", self.cell.adamw_lr), lrs.get("muon", self.cell.muon_lr), self.budget)


def load_record(path: Path = RECORD) -> dict[str, dict]:
    """Finished runs by key (`cell/name`); a torn last line (a stop while writing) is ignored."""
    found = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue
            found[f"{entry['cell']}/{entry['run']}"] = entry
    return found


_record_lock = threading.Lock()


def append_record(entry: dict, path: Path = RECORD) -> None:
    """Append one finished run (one line, flushed and synced)."""
    with _record_lock:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps(entry) + "\n")
            f.flush()
            os.fsync(f.fileno())


def entry_of(run: Run, settings: Settings, validation: list[tuple[int, float]], wall_s: float | None, source: str) -> dict:
    return {
        "cell": run.cell.name, "run": run.name, "optimizer": run.arm.optimizer, "delay": run.arm.delay, "ef": run.arm.ef,
        "corrector": run.arm.corrector, "seed": run.arm.seed, "lr": run.lr, "budget": run.budget, "sweep": run.sweep,
        "steps": settings.steps, "tokens": settings.steps * settings.seq_len * settings.batch,
        "parameters": run.cell.regime.parameters, "batch_tokens": settings.seq_len * settings.batch,
        "wall_s": wall_s, "source": source, "validation": validation,
    }


def import_tokens20(record: dict[str, dict]) -> None:
    """Record the b16 cell's sweep (final losses only) and arms (validation curves) from the
    committed tokens20 study, once."""
    cell = CELLS["b16"]
    if any(key.startswith("b16/") for key in record):
        return
    with open(TOKENS20 / "tuning.csv", newline="") as f:
        tuning = list(csv.DictReader(f))
    best = {}
    for row in tuning:
        run = Run(cell, Arm(row["optimizer"], 0, False), float(row["lr"]), sweep=True)
        settings = run.settings({})
        best.setdefault(row["optimizer"], []).append((float(row["final_validation_loss"]), float(row["lr"])))
        append_record(entry_of(run, settings, [(settings.steps, float(row["final_validation_loss"]))], None, "staleness_tokens20/tuning.csv"))
    lrs = {opt: min(pairs)[1] for opt, pairs in best.items()}
    curves: dict[str, list[tuple[int, float]]] = {}
    with open(TOKENS20 / "curves.csv", newline="") as f:
        for row in csv.DictReader(f):
            if row["kind"] == "validation":
                curves.setdefault(row["arm"], []).append((int(row["step"]), float(row["loss"])))
    for seed in (0, 1):
        for arm in [Arm(o, 0, False, seed) for o in ("adamw", "muon")] + [a.at(seed) for a in DELAYED]:
            if arm.name in curves:
                run = Run(cell, arm, lrs[arm.optimizer])
                append_record(entry_of(run, run.settings(lrs), sorted(curves[arm.name]), None, "staleness_tokens20/curves.csv"))


def sweep_runs(cell: Cell, record: dict[str, dict]) -> tuple[list[Run], dict[str, float] | None]:
    """The sweep runs still to train and, once every optimizer's best lr is bracketed (or its
    grid has grown twice), the best lrs."""
    todo, best = [], {}
    for optimizer, centre in (("adamw", cell.adamw_lr), ("muon", cell.muon_lr)):
        grid = [centre / 2, centre, centre * 2]
        while True:
            runs = [Run(cell, Arm(optimizer, 0, False), lr, sweep=True) for lr in grid]
            missing = [r for r in runs if r.key not in record]
            if missing:
                todo += missing
                break
            losses = {r.lr: record[r.key]["validation"][-1][1] for r in runs}
            lr = best_lr(losses)
            if len(grid) < 5 and lr == grid[-1]:
                grid.append(2 * lr)
            elif len(grid) < 5 and lr == grid[0]:
                grid.insert(0, lr / 2)
            else:
                best[optimizer] = lr
                break
    return todo, (best if len(best) == 2 else None)


def cell_runs(cell: Cell, best: dict[str, float], extra_seeds: bool) -> list[Run]:
    """The cell's runs at its best lrs, in order of use: the plain delayed arms at seed 0, the
    budget runs (with them, the plain delay's token efficiency), then the corrected arms (EF,
    prediction); with `extra_seeds`, the synchronous and delayed arms at the cell's other seeds
    instead."""
    if extra_seeds:
        return [Run(cell, Arm(o, d, False, seed), best[o]) for seed in SEEDS_OF_CELL[cell.name][1:]
                for d in (0, 1) for o in ("adamw", "muon")]
    budgets = [Run(cell, Arm(o, 0, False), best[o], budget) for budget in BUDGETS for o in ("adamw", "muon")]
    return [Run(cell, arm, best[arm.optimizer]) for arm in DELAYED[:2]] + budgets + [
        Run(cell, arm, best[arm.optimizer]) for arm in DELAYED[2:]]


def longer_delay_runs(cell: Cell, best: dict[str, float]) -> list[Run]:
    """`LONGER_DELAYS`' runs of `cell` (none for the other cells), seed by seed."""
    name, delays, seeds = LONGER_DELAYS
    if cell.name != name:
        return []
    return [Run(cell, Arm(o, d, ef, seed, corrector), best[o])
            for seed in seeds for d in delays for ef, corrector in ((False, ""), (True, ""), (False, "predict"), (False, "reschedule"))
            for o in ("adamw", "muon")]


def pending(cells: list[Cell], record: dict[str, dict]) -> Iterator[Run]:
    """The runs to train: the longer delays (once their cell's sweep has chosen its lrs); cell by
    cell, a cell's sweep, then its seed-0 arms once the sweep has chosen its lrs (meanwhile the
    next cell's); then every cell's extra seeds."""
    for stage in ("longer delays", "seed 0", "extra seeds"):
        for cell in cells:
            todo, best = sweep_runs(cell, record)
            if best is None:
                yield from todo if stage == "seed 0" else ()
                continue
            runs = longer_delay_runs(cell, best) if stage == "longer delays" else cell_runs(cell, best, stage == "extra seeds")
            yield from (r for r in runs if r.key not in record)


def train(run: Run, best: dict[str, float], parallel: int) -> dict:
    """Train `run` in RUNS and return its record entry."""
    settings = run.settings(best)
    run_dir = RUNS / run.cell.name / run.name
    training = job(run.arm, settings, run_dir, checkpoint_every=max(settings.steps // 20, 1))
    resumed = " (resumed from a checkpoint: wall_s counts the resumed part only)" if training.resumes() else ""
    wall = run_job(training, parallel)
    validation = load_curves(run_dir / "metrics.jsonl").validation
    if not validation or validation[-1][0] != settings.steps:
        raise RuntimeError(f"{run.key} did not validate at its last step {settings.steps} (log: {run_dir}.log)")
    return entry_of(run, settings, validation, wall, f"trained at {git_state()}, load average {os.getloadavg()[0]:.1f}{resumed}")


def best_of(cell: Cell, record: dict[str, dict]) -> dict[str, float]:
    return sweep_runs(cell, record)[1] or {}


def run_study(cells: list[Cell], parallel: int) -> None:
    """Train pending runs, `parallel` at a time, until none is left; each finished run is
    recorded at once, and the queue is worked out again from the record (a finished sweep
    decides the next runs)."""
    running: dict[Future, Run] = {}
    with ThreadPoolExecutor(max_workers=parallel) as pool:
        while True:
            record = load_record()
            busy = {r.key for r in running.values()}
            for run in pending(cells, record):
                if len(running) >= parallel:
                    break
                if run.key in busy:
                    continue
                busy.add(run.key)
                running[pool.submit(train, run, best_of(run.cell, record), parallel)] = run
                print(f"{time.strftime('%H:%M:%S')} start {run.key}", flush=True)
            if not running:
                return
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                run = running.pop(future)
                entry = future.result()
                append_record(entry)
                print(f"{time.strftime('%H:%M:%S')} done {run.key}: {entry['wall_s']:.0f} s, "
                      f"final validation loss {entry['validation'][-1][1]:.4f}", flush=True)


def dry_run(cells: list[Cell]) -> str:
    lines = []
    for cell in cells:
        r = cell.regime
        settings = cell.settings(cell.adamw_lr, cell.muon_lr)
        lines.append(f"{cell.name}: {r.parameters:,} parameters, {settings.steps} steps x {r.seq_len * r.batch:,} tokens "
                     f"= {settings.steps * r.seq_len * r.batch:,} tokens; sweep centres AdamW {cell.adamw_lr:g}, Muon {cell.muon_lr:g}")
    record = load_record()
    lines.append(f"recorded runs: {len(record)}; next: " + ", ".join(r.key for r in pending(cells, record)))
    return "\n".join(lines)


# --- analysis: token efficiency, the law, its checks ---

PAPER_POINTS = (
    # (label, optimizer, corrector, parameters, tokens, (steps low, steps high), gap at equal tokens)
    ("360M dense, Muon", "muon", "none", 360e6, 7.2e9, (20_000, 40_000), 0.012),
    ("360M dense, Muon + EF", "muon", "ef", 360e6, 7.2e9, (20_000, 40_000), 0.005),
    ("360M dense, AdamW", "adamw", "none", 360e6, 7.2e9, (20_000, 40_000), 0.278),
    ("360M dense, AdamW + EF", "adamw", "ef", 360e6, 7.2e9, (20_000, 40_000), 0.028),
    ("10B MoE, Muon", "muon", "none", 10e9, 200e9, (25_000, 100_000), 0.005),
)
"""arXiv 2606.30634's points (docs/results.md): 20 tokens per parameter at 180K-360K tokens per
step for the 360M; the 10B MoE's batch is not reported, so 2M-8M tokens per step (25K-100K
steps) are assumed. Their gaps become token efficiencies on Chinchilla's slope at their tokens
(`staleness.gap`), as the law's predictions become gaps."""


@dataclass(frozen=True)
class Point:
    """One cell's measured delay cost for an optimizer and corrector: the gap per seed (final
    validation loss of the delayed run minus the synchronous run's at the same seed), the slope
    of the synchronous final loss in log tokens (`slope`, from the budget runs), and ln(1 / eta)
    = gap / slope per seed."""

    cell: Cell
    optimizer: str
    corrector: str
    gaps: dict[int, float]
    slope: float
    steps: int

    @property
    def log_inefficiencies(self) -> dict[int, float]:
        return {seed: gap / self.slope for seed, gap in self.gaps.items()}

    @property
    def mean(self) -> float:
        values = list(self.log_inefficiencies.values())
        return sum(values) / len(values)

    @property
    def efficiency(self) -> float:
        return math.exp(-self.mean)


def corrector_arm(optimizer: str, corrector: str, seed: int = 0, delay: int = 1) -> Arm:
    """The delayed arm of a corrector named as the tables name it (none, ef, predict, reschedule)."""
    return Arm(optimizer, delay, corrector == "ef", seed, corrector if corrector in ("predict", "reschedule") else "")


def final(record: dict[str, dict], cell: Cell, name: str) -> float | None:
    entry = record.get(f"{cell.name}/{name}")
    return entry["validation"][-1][1] if entry else None


def sync_final(record: dict[str, dict], cell: Cell, optimizer: str, seed: int, best: dict[str, float]) -> float | None:
    """The synchronous run's final loss at `seed` (seed 0: the sweep's run at the best lr)."""
    found = final(record, cell, Arm(optimizer, 0, False, seed).name)
    if found is None and seed == 0:
        found = final(record, cell, Run(cell, Arm(optimizer, 0, False), best[optimizer], sweep=True).name)
    return found


def budget_slope(record: dict[str, dict], cell: Cell, optimizer: str, best: dict[str, float]) -> tuple[float, list[tuple[int, float]]] | None:
    """-dL / d ln D of the synchronous final loss, least squares over the budget runs and the full
    run (seed 0), with those (tokens, loss) points; None until they all ran."""
    points = []
    for budget in (*BUDGETS, 1.0):
        run = Run(cell, Arm(optimizer, 0, False), best[optimizer], budget)
        loss = sync_final(record, cell, optimizer, 0, best) if budget == 1.0 else final(record, cell, run.name)
        if loss is None:
            return None
        settings = run.settings(best)
        points.append((settings.steps * settings.seq_len * settings.batch, loss))
    xs = [math.log(t) for t, _ in points]
    ys = [loss for _, loss in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = -sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return slope, points


def measure(record: dict[str, dict], cells: list[Cell]) -> list[Point]:
    """Every (cell, optimizer, corrector) whose delayed run, synchronous run (same seed) and
    budget runs have finished."""
    found = []
    for cell in cells:
        best = best_of(cell, record)
        if not best:
            continue
        for optimizer in ("adamw", "muon"):
            fitted = budget_slope(record, cell, optimizer, best)
            if fitted is None:
                continue
            for corrector in ("none", "ef", "predict"):
                gaps = {}
                for seed in SEEDS_OF_CELL[cell.name]:
                    delayed = final(record, cell, corrector_arm(optimizer, corrector, seed).name)
                    synchronous = sync_final(record, cell, optimizer, seed, best)
                    if delayed is not None and synchronous is not None:
                        gaps[seed] = delayed - synchronous
                if gaps:
                    found.append(Point(cell, optimizer, corrector, gaps, fitted[0], cell.settings(1, 1).steps))
    return found


@dataclass(frozen=True)
class Fit:
    """The law fitted to `points` (those with ln(1 / eta) > 0), with `excluded` (why each other
    point was left out), R^2 in log space and each point's residual factor."""

    law: Law
    used: list[Point]
    excluded: list[tuple[Point, str]]
    r_squared: float
    residuals: list[float]


def fit_law(points: list[Point], source: str) -> Fit:
    """Least squares of ln(ln(1 / eta)) = ln c[optimizer+corrector] - a[optimizer] ln(steps / 1000)
    - b ln(parameters / 1e6) over the points with a positive mean ln(1 / eta); an exponent whose
    regressor takes one value among them is not identified and is fixed at 0 (a[optimizer]: among
    that optimizer's points; the law's shared steps exponent is their mean). An optimizer and
    corrector none of whose points shows a cost gets c = 0 (efficiency 1)."""
    used = [p for p in points if p.mean > 0]
    excluded = [(p, f"ln(1/eta) = {p.mean:+.4f}: no measurable cost") for p in points if p.mean <= 0]
    groups = sorted({f"{p.optimizer}+{p.corrector}" for p in used})
    optimizers = sorted({p.optimizer for p in used})
    columns = [[1.0 if f"{p.optimizer}+{p.corrector}" == g else 0.0 for g in groups] for p in used]
    regressors = {f"steps {o}": [-math.log(p.steps / 1000) if p.optimizer == o else 0.0 for p in used] for o in optimizers}
    regressors["parameters"] = [-math.log(p.cell.regime.parameters / 1e6) for p in used]
    identified = [name for name, values in regressors.items()
                  if len({round(v, 9) for v, p in zip(values, used) if not name.startswith("steps ") or name == f"steps {p.optimizer}"}) > 1]
    design = np.array([row + [regressors[name][i] for name in identified] for i, row in enumerate(columns)])
    target = np.array([math.log(p.mean) for p in used])
    solution, *_ = np.linalg.lstsq(design, target, rcond=None)
    exponents = {name: 0.0 for name in regressors} | dict(zip(identified, solution[len(groups):]))
    steps_exponents = {o: float(exponents[f"steps {o}"]) for o in optimizers}
    residuals = list(target - design @ solution)
    total = float(((target - target.mean()) ** 2).sum())
    costless = {f"{p.optimizer}+{p.corrector}" for p, _ in excluded} - set(groups)
    law = Law({**{g: math.exp(c) for g, c in zip(groups, solution)}, **dict.fromkeys(costless, 0.0)},
              sum(steps_exponents.values()) / len(steps_exponents), float(exponents["parameters"]),
              math.exp(max(abs(r) for r in residuals)),
              (min(p.steps for p in used), max(p.steps for p in used)),
              (min(p.cell.regime.parameters for p in used), max(p.cell.regime.parameters for p in used)), source,
              {g: seed_spread_factor([p for p in used if f"{p.optimizer}+{p.corrector}" == g]) for g in groups},
              steps_exponents=steps_exponents)
    return Fit(law, used, excluded, 1 - float(sum(r * r for r in residuals)) / total if total else math.nan, residuals)


def seed_spread_factor(points: list[Point]) -> float:
    """The largest factor between a point's mean ln(1 / eta) and one of its seeds' (the square
    root of their ratio where they differ in sign or one is 0: half the spread in log space is not
    defined there, so the whole point's mean-to-largest ratio stands in); 1 with one seed each."""
    factor = 1.0
    for p in points:
        values = list(p.log_inefficiencies.values())
        if len(values) < 2:
            continue
        if min(values) > 0:
            factor = max(factor, math.sqrt(max(values) / min(values)))
        else:
            factor = max(factor, max(values) / p.mean)
    return factor


def out_of_sample_factors(law: Law) -> dict[str, float]:
    """Per coefficient, the largest factor by which the law underestimates a paper point of the
    same optimizer and corrector (their ln(1 / eta) over the law's at the geometric middle of the
    point's steps; at least 1); weight prediction, which the paper did not train, takes error
    feedback's (both recover alike in the studies)."""
    factors: dict[str, float] = {}
    for _, optimizer, corrector, parameters, tokens, (low, high), paper_gap in PAPER_POINTS:
        key = f"{optimizer}+{corrector}"
        if law.coefficients.get(key):
            paper = paper_gap / staleness.chinchilla_slope(tokens)
            ours = law.log_inefficiency(optimizer, corrector, int(math.sqrt(low * high)), int(parameters))
            factors[key] = max(factors.get(key, 1.0), paper / ours)
    for optimizer in ("adamw", "muon"):
        if f"{optimizer}+ef" in factors:
            factors.setdefault(f"{optimizer}+predict", factors[f"{optimizer}+ef"])
    return factors


def write_law(law: Law, path: Path = LAW_FILE) -> None:
    data = {"coefficients": law.coefficients, "steps_exponent": law.steps_exponent,
            "parameters_exponent": law.parameters_exponent, "residual_factor": law.residual_factor,
            "range_factors": law.range_factors, "out_of_sample_factors": law.out_of_sample_factors,
            "steps_exponents": law.steps_exponents, "delay_exponents": law.delay_exponents, "delays": list(law.delays),
            "steps": list(law.steps), "parameters": list(law.parameters), "source": law.source}
    path.write_text(json.dumps(data, indent=1) + "\n")


def out_of_sample(law: Law) -> list[dict]:
    """The law against the paper's points (PAPER_POINTS): its predicted efficiency at both ends of
    the steps range and the paper's, each also as a gap on Chinchilla's slope."""
    rows = []
    for label, optimizer, corrector, parameters, tokens, (low, high), paper_gap in PAPER_POINTS:
        key = f"{optimizer}+{corrector}"
        if key not in law.coefficients:
            continue
        predicted = [staleness.estimate(optimizer, corrector, steps, int(parameters), law).efficiency for steps in (low, high)]
        paper = math.exp(-paper_gap / staleness.chinchilla_slope(tokens))
        rows.append({"label": label, "steps": (low, high), "predicted": predicted,
                     "predicted_gap": [staleness.gap(e, tokens) for e in predicted], "paper": paper, "paper_gap": paper_gap})
    return rows


def _cells_table(record: dict[str, dict]) -> str:
    lines = ["| cell | parameters | tokens per step | steps | tokens | tokens per parameter | AdamW lr | Muon lr | runs finished |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for cell in CELLS.values():
        s, best = cell.settings(1, 1), best_of(cell, record)
        tokens = s.steps * s.seq_len * s.batch
        lrs = [f"{best[o]:g}" if o in best else "(sweeping)" for o in ("adamw", "muon")]
        done = sum(key.startswith(f"{cell.name}/") for key in record)
        lines.append(f"| {cell.name} | {cell.regime.parameters:,} | {s.seq_len * s.batch:,} | {s.steps:,} | {tokens:,} | "
                     f"{tokens / cell.regime.parameters:.1f} | {lrs[0]} | {lrs[1]} | {done} |")
    return "\n".join(lines)


def _points_table(points: list[Point]) -> str:
    lines = ["| cell | steps | optimizer | corrector | gap per seed | slope -dL/d ln D | ln(1/eta) | token efficiency eta | tokens to the sync loss |",
             "|---|---:|---|---|---|---:|---:|---:|---:|"]
    for p in points:
        gaps = ", ".join(f"{g:+.4f}" for g in p.gaps.values())
        lines.append(f"| {p.cell.name} | {p.steps:,} | {p.optimizer} | {p.corrector} | {gaps} | {p.slope:.3f} | "
                     f"{p.mean:+.4f} | {p.efficiency:.3f} | {1 / p.efficiency:.3f}x |")
    return "\n".join(lines)


def longer_delay_gaps(record: dict[str, dict]) -> dict[tuple[str, str, int], tuple[list[float], float | None]]:
    """(optimizer, corrector, d) -> (the gap per seed, the cell's synchronous slope or None) for
    d = 1 and `LONGER_DELAYS`' delays in the longer-delay cell; empty before any longer-delay run
    finished."""
    name, delays, seeds = LONGER_DELAYS
    cell = CELLS[name]
    best = best_of(cell, record)
    if not best or not any(f"{name}/{r.name}" in record for r in longer_delay_runs(cell, best)):
        return {}
    found = {}
    for optimizer in ("adamw", "muon"):
        fitted = budget_slope(record, cell, optimizer, best)
        for corrector in LONGER_DELAY_CORRECTORS:
            for delay in (1, *delays):
                gaps = []
                for seed in seeds:
                    delayed = final(record, cell, corrector_arm(optimizer, corrector, seed, delay).name)
                    synchronous = sync_final(record, cell, optimizer, seed, best)
                    if delayed is not None and synchronous is not None:
                        gaps.append(delayed - synchronous)
                if gaps:
                    found[(optimizer, corrector, delay)] = (gaps, None if fitted is None else fitted[0])
    return found


def delay_exponents(record: dict[str, dict]) -> tuple[dict[str, float], tuple[int, int]]:
    """The law's delay term: per optimizer+corrector, the mean over the longer delays d of
    ln(y_d / y_1) / ln d, y the seeds' mean ln(1/eta) (`longer_delay_gaps`; a delay whose y or
    y_1 is not positive is left out); and the delays that went into them, (1, largest)."""
    gaps = longer_delay_gaps(record)
    mean = {key: sum(values) / len(values) / slope for key, (values, slope) in gaps.items() if slope}
    exponents, largest = {}, 1
    for optimizer in ("adamw", "muon"):
        for corrector in ("none", "ef", "predict"):
            one = mean.get((optimizer, corrector, 1), 0.0)
            found = [(math.log(mean[(optimizer, corrector, d)] / one) / math.log(d), d) for d in LONGER_DELAYS[1]
                     if one > 0 and mean.get((optimizer, corrector, d), 0.0) > 0]
            if found:
                exponents[f"{optimizer}+{corrector}"] = sum(g for g, _ in found) / len(found)
                largest = max(largest, *(d for _, d in found))
    return exponents, (1, largest)


def _longer_delays_section(record: dict[str, dict]) -> str | None:
    """Gap and token efficiency per delay d (1 and `LONGER_DELAYS`') in the longer-delay cell,
    per optimizer and corrector, seeds averaged, with the share of the plain delay's gap each
    corrector recovers at that delay, and the law's delay exponents; None before any
    longer-delay run finished."""
    gaps = longer_delay_gaps(record)
    if not gaps:
        return None
    lines = ["| optimizer | corrector | d | gap per seed | ln(1/eta) | token efficiency eta | tokens to the sync loss | "
             "recovered |", "|---|---|---:|---|---:|---:|---:|---:|"]
    mean = {key: sum(values) / len(values) for key, (values, _) in gaps.items()}
    for (optimizer, corrector, delay), (values, slope) in gaps.items():
        gap = mean[(optimizer, corrector, delay)]
        efficiency = "" if slope is None else f"{math.exp(-gap / slope):.3f}"
        tokens = "" if slope is None else f"{math.exp(gap / slope):.3f}x"
        plain = mean.get((optimizer, "none", delay))
        recovered = f"{1 - gap / plain:.0%}" if corrector != "none" and plain and plain > 0 else ""
        lines.append(f"| {optimizer} | {corrector} | {delay} | {', '.join(f'{g:+.4f}' for g in values)} | "
                     f"{'' if slope is None else f'{gap / slope:+.4f}'} | {efficiency} | {tokens} | {recovered} |")
    exponents, _ = delay_exponents(record)
    if exponents:
        lines += ["", "The law's delay term, ln(1/eta) at d = d ** exponent x at d = 1 (mean over the delays of "
                  "ln(y_d / y_1) / ln d): " + ", ".join(f"{key} {value:.2f}" for key, value in exponents.items()) + "."]
    return "\n".join(lines)


def _fit_section(fit: Fit) -> str:
    law = fit.law
    lines = ["    ln(1/eta) = c[optimizer+corrector] x (steps/1000)^-a[optimizer] x (parameters/1e6)^-b", "",
             "- a (steps exponent): " + ", ".join(f"{o} {a:.3f}" for o, a in sorted(law.steps_exponents.items()))
             + f"; b (parameters exponent) = {law.parameters_exponent:.3f}"
             + (" (b not identified: one model size among the fitted points; fixed at 0)" if law.parameters[0] == law.parameters[1] else "")
             + (" (a not identified: one step count among the fitted points; fixed at 0)" if law.steps[0] == law.steps[1] else ""),
             "- c: " + ", ".join(f"{k} {v:.4f}" for k, v in sorted(law.coefficients.items())),
             f"- fitted on {len(fit.used)} points (steps {law.steps[0]:,}..{law.steps[1]:,}, parameters "
             f"{law.parameters[0]:,}..{law.parameters[1]:,}); R^2 in log space {fit.r_squared:.3f}; largest residual factor "
             f"{law.residual_factor:.2f}",
             "- range (what `plan --staleness` gives): ln(1/eta) times or divided by the larger of the residual factor and "
             "the seeds' spread factor (the square root of the ratio of a point's largest to smallest seed): "
             + ", ".join(f"{k} {law.range_factor(*k.split('+')):.2f}" for k in sorted(law.coefficients)),
             "- where a prediction extrapolates (steps or parameters outside those above), its pessimistic end reaches the "
             "paper's points: ln(1/eta) times " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(law.out_of_sample_factors.items()))
             + " (the out-of-sample table below: the paper's ln(1/eta) over the law's)"]
    lines += [f"- left out: {p.cell.name} {p.optimizer}+{p.corrector}: {why}" for p, why in fit.excluded]
    return "\n".join(lines)


def _out_of_sample_section(law: Law) -> str:
    lines = ["| paper point | steps assumed | eta predicted (at those steps) | eta from the paper's gap | gap predicted (Chinchilla slope) | paper's gap |",
             "|---|---|---|---:|---|---:|"]
    for row in out_of_sample(law):
        lines.append(f"| {row['label']} | {row['steps'][0]:,}..{row['steps'][1]:,} | "
                     f"{row['predicted'][0]:.3f}..{row['predicted'][1]:.3f} | {row['paper']:.3f} | "
                     f"{row['predicted_gap'][0]:+.4f}..{row['predicted_gap'][1]:+.4f} | {row['paper_gap']:+.3f} |")
    return "\n".join(lines)


def plot(record: dict[str, dict], points: list[Point], fit: Fit | None, path: Path) -> None:
    """Left: validation curves of each cell's synchronous and delayed runs (seed 0) against tokens;
    right: ln(1 / eta) against steps, per optimizer and corrector, with the law's lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (curves, law_axes) = plt.subplots(1, 2, figsize=(13, 5))
    for i, cell in enumerate(CELLS.values()):
        best = best_of(cell, record)
        for optimizer, style in (("adamw", "--"), ("muon", "-")):
            if optimizer not in best:
                continue
            for name, width in ((Run(cell, Arm(optimizer, 0, False), best[optimizer], sweep=True).name, 1.6), (Arm(optimizer, 1, False).name, 0.8)):
                entry = record.get(f"{cell.name}/{name}")
                if entry and len(entry["validation"]) > 1:
                    scale = entry["tokens"] / entry["steps"]
                    curves.plot([s * scale for s, _ in entry["validation"][1:]], [v for _, v in entry["validation"][1:]], style,
                                color=f"C{i}", lw=width, label=f"{cell.name} {optimizer} {'sync' if width > 1 else 'delay 1'}")
    curves.set_xscale("log")
    curves.set_xlabel("tokens")
    curves.set_ylabel("validation loss")
    curves.legend(fontsize=6, ncol=2)
    markers = {"none": "o", "ef": "s", "predict": "^"}
    for p in points:
        law_axes.scatter(p.steps, max(p.mean, 1e-4), marker=markers[p.corrector], color="C0" if p.optimizer == "adamw" else "C3",
                         facecolors="none" if p.cell.regime.parameters > 300_000 else None)
    if fit is not None:
        steps = np.geomspace(200, 100_000, 50)
        for key in fit.law.coefficients:
            optimizer, corrector = key.split("+")
            law_axes.plot(steps, [fit.law.log_inefficiency(optimizer, corrector, int(s), 279_104) for s in steps],
                          ls=":" if corrector != "none" else "-", color="C0" if optimizer == "adamw" else "C3", lw=0.8, label=key)
    law_axes.set_xscale("log")
    law_axes.set_yscale("log")
    law_axes.set_xlabel("optimizer steps (at 20 tokens per parameter)")
    law_axes.set_ylabel("ln(1 / token efficiency)")
    law_axes.set_title("markers: o none, s EF, ^ prediction; hollow: 541K; lines: the law at 279K", fontsize=8)
    law_axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_longer_delays(record: dict[str, dict], path: Path) -> None:
    """Validation curves of the longer-delay cell at seed 0, one panel per optimizer: the
    synchronous run, and each delay d plain (solid) and with error feedback (dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    name, delays, _ = LONGER_DELAYS
    cell = CELLS[name]
    best = best_of(cell, record)
    figure, panels = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for axes, optimizer in zip(panels, ("adamw", "muon")):
        sync = Arm(optimizer, 0, False).name  # the seed-0 synchronous run: its own arm, or the sweep's at the best lr
        if f"{name}/{sync}" not in record and optimizer in best:
            sync = Run(cell, Arm(optimizer, 0, False), best[optimizer], sweep=True).name
        runs = [(sync, "sync", "k", "-")]
        runs += [(Arm(optimizer, d, ef).name, f"d = {d}{' + EF' if ef else ''}", f"C{i}", "--" if ef else "-")
                 for i, d in enumerate((1, *delays)) for ef in (False, True)]
        for run, label, color, style in runs:
            entry = record.get(f"{name}/{run}")
            if entry and len(entry["validation"]) > 1:
                axes.plot(*zip(*entry["validation"][1:]), style, color=color, lw=1, label=label)
        axes.set_title(f"{name}, {optimizer}", fontsize=9)
        axes.set_xlabel("step")
        axes.legend(fontsize=7)
    panels[0].set_ylabel("validation loss")
    panels[0].set_ylim(top=4.0)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


ANALYSIS_HEADING = "## Analysis"


def write_report(record: dict[str, dict], out: Path = OUT) -> Fit | None:
    """README.md, points.csv, curves.png and configs/CELL/RUN.toml (each run's resolved config,
    while its run directory is here) in `out` from the record; the law (LAW_FILE) once the
    points span two step counts. Returns the fit, if any. The hand-written part of an
    existing README from ANALYSIS_HEADING on is kept."""
    points = measure(record, list(CELLS.values()))
    fit = fit_law(points, "docs/results/staleness_scaling") if any(p.mean > 0 for p in points) else None
    if fit is not None:
        exponents, delays = delay_exponents(record)
        fit = replace(fit, law=replace(fit.law, out_of_sample_factors=out_of_sample_factors(fit.law),
                                       delay_exponents=exponents, delays=delays))
        if fit.law.steps[0] < fit.law.steps[1]:
            write_law(fit.law)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "points.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["cell", "parameters", "steps", "optimizer", "corrector", "seed", "gap", "slope", "log_inefficiency"])
        for p in points:
            for seed, gap in p.gaps.items():
                writer.writerow([p.cell.name, p.cell.regime.parameters, p.steps, p.optimizer, p.corrector, seed,
                                 f"{gap:.5f}", f"{p.slope:.5f}", f"{gap / p.slope:.5f}"])
    plot(record, points, fit, out / "curves.png")
    for key in record:
        source, destination = RUNS / key / "config.toml", out / "configs" / f"{key}.toml"
        if source.is_file() and not destination.is_file():
            destination.parent.mkdir(parents=True, exist_ok=True)
            record_config(source.parent, destination)
    old = (out / "README.md").read_text() if (out / "README.md").is_file() else ""
    analysis = old[old.index(ANALYSIS_HEADING):] if ANALYSIS_HEADING in old else ""
    parts = ["# Staleness scaling: what sets the one-step delay's cost", "",
             "Written by `tools/staleness_scaling.py` from `runs.jsonl` (every finished run's settings and validation "
             "curve). Token efficiency eta: the synchronous run reaches the delayed run's final loss with eta x its tokens, "
             "read from the synchronous final losses at 50%, 70% and 100% of the tokens (each run its own full lr schedule): "
             "ln(1/eta) = gap / slope, the slope -dL/d ln D fitted over those three runs. The delayed run needs about "
             "1/eta times the tokens to reach the synchronous run's final loss.", "",
             "## Cells", "", _cells_table(record), "",
             "## Measured", "", _points_table(points) if points else "(no cell has its budget runs yet)", ""]
    if fit is not None:
        parts += ["## The law", "", _fit_section(fit), "", "## Out of sample: the paper's points", "",
                  "The paper reports gaps; each becomes a token efficiency on Chinchilla's slope at its tokens "
                  "(`titan_async.cluster.staleness.chinchilla_slope`), and the law's predictions become gaps the same way.", "",
                  _out_of_sample_section(fit.law), ""]
    longer = _longer_delays_section(record)
    if longer:
        plot_longer_delays(record, out / "longer_delays.png")
        parts += ["## Longer delays", "",
                  f"PipeDream2BW with fewer microbatches than stages delays each gradient by d = ceil((p - 1) / m) steps. "
                  f"The {LONGER_DELAYS[0]} cell trained `training.gradient_delay = d` (the same rule on one process), plain, "
                  "with error feedback (correction c d (u_t - u_{t-1}), c = 1), with weight prediction (horizon h d, h = 1) "
                  "and with the lr rescheduled (`lr_scheduler.delay_rescheduling_steps`: divided by d ** (1 - min(k / K, 1)) "
                  f"at step k, K = {RESCHEDULE_SHARE:.0%} of the steps), at the cell's lrs; ln(1/eta) on the cell's synchronous slope. "
                  "marin's published Muon figures for comparison: delay 2 +0.14, +0.066 with prediction. Recovered: the share "
                  "of the plain delay's ln(1/eta) the corrector removes at the same d.", "", longer, "",
                  "![validation curves at each delay, seed 0](longer_delays.png)", ""]
    parts += ["## How it was run", "", "    .venv/bin/python tools/staleness_scaling.py --parallel 2", "",
              "- each run: `titan-async train --config debug_cpu` with the cell's settings (`Cell.settings` and "
              "`staleness_study.Settings.overrides`); its resolved config is configs/CELL/RUN.toml (the b16 cell's "
              "imported runs: docs/results/staleness_tokens20/configs); the git revision and machine load of each are in `runs.jsonl`",
              "- runs two at a time on 2 cores shared with other work (`nice -n 19`)", ""]
    (out / "README.md").write_text("\n".join(parts) + ("\n" + analysis if analysis else ""))
    return fit


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cells", default=",".join(CELLS), help=f"cells in order of priority (of {', '.join(CELLS)})")
    p.add_argument("--parallel", type=int, default=2, help="runs at a time (each gets cores // parallel threads)")
    p.add_argument("--dry-run", action="store_true", help="print the cells and the next runs; train nothing")
    p.add_argument("--report-only", action="store_true", help="rebuild the results from the record, training nothing")
    args = p.parse_args(argv)
    unknown = [c for c in args.cells.split(",") if c not in CELLS]
    if unknown:
        p.error(f"--cells: unknown cell {unknown[0]!r}; expected some of {', '.join(CELLS)}")
    args.cells = [CELLS[c] for c in args.cells.split(",")]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import_tokens20(load_record())
    if args.dry_run:
        print(dry_run(args.cells))
        return
    if not args.report_only:
        run_study(args.cells, args.parallel)
    write_report(load_record())


if __name__ == "__main__":
    sys.exit(main())
