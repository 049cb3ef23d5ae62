"""Time-to-loss study: how long each pipeline schedule and optimizer trains to reach the baseline's
final validation loss, on real pipelines (default: train_configs/debug_cpu_pp2.toml, p = 2, m = 4,
2 processes).

Arms are schedule x optimizer x seed, run one at a time and interleaved (all arms of a seed, then
the next seed). Every arm trains the same steps (so every lr schedule ends at the same step) and
gets the same wall-clock budget (--budget-s: a run still going then is stopped, and keeps what it
logged). Per seed, `titan-async compare` semantics give each arm's time to the target: the
baseline arm's (--baseline, default 1F1B with Muon) final validation loss, on training
wall-clock. Writes results.json, table.csv, README.md (table and how it was run), the curves of
seed 0 (compare's PNGs) and every run's resolved config into --out.

    .venv/bin/python tools/tta_study.py --seeds 0,1 [--budget-s 900] [--out docs/results/tta]
    .venv/bin/python tools/tta_study.py --report-only --seeds 0,1   # rebuild --out only
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from pathlib import Path

from titan_async.commands.compare import cell, compare, draw_plots
from titan_async.experiments.jobs import ROOT, Job, record_config, run_recorded

SCHEDULES = ("1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "PipeDream2BW", "PACI")
"""Every schedule that can validate (torch's ZBVZeroBubble fails in eval)."""
OPTIMIZERS = {
    "adamw": ["optimizer.name=adamw"],
    "muon": ["optimizer.name=muon"],
    "muon-ef": ["optimizer.name=muon", "optimizer.error_feedback.enabled=true"],
}


def arm_name(schedule: str, optimizer: str, seed: int) -> str:
    return f"{schedule}-{optimizer}-seed{seed}"


def jobs(args: argparse.Namespace) -> list[Job]:
    """Every arm's run, seed by seed, schedules alternating within each optimizer."""
    common = [f"training.steps={args.steps}", f"validation.freq={args.validation_freq}", "checkpoint.enable=false",
              "metrics.enable_tensorboard=false", *args.set]
    return [
        Job(arm_name(schedule, optimizer, seed), args.runs_dir / arm_name(schedule, optimizer, seed), args.config,
            [f"parallelism.pipeline_parallel_schedule={schedule}", *OPTIMIZERS[optimizer], f"debug.seed={seed}", *common],
            ["--nproc-per-node", str(args.nproc)])
        for seed in args.seeds for optimizer in args.optimizers for schedule in args.schedules
    ]


def seed_results(args: argparse.Namespace, seed: int):
    """compare() over the seed's runs that logged something, the baseline first."""
    baseline = args.runs_dir / arm_name(*args.baseline, seed)
    dirs = [args.runs_dir / arm_name(s, o, seed) for o in args.optimizers for s in args.schedules]
    return compare([d for d in dirs if (d / "metrics.jsonl").is_file()], baseline)


def table(per_seed: dict[int, dict]) -> list[dict]:
    """One row per arm (schedule, optimizer): per seed its time to target and speed-up, and the
    means over seeds of tokens/s, final validation loss and speed-up (over the seeds it reached)."""
    rows: dict[str, dict] = {}
    for seed, results in per_seed.items():
        for run in results["runs"]:
            arm = run["label"].removesuffix(f"-seed{seed}")
            row = rows.setdefault(arm, {"arm": arm, "seeds": {}})
            row["seeds"][seed] = {key: run[key] for key in ("time_to_target_s", "speedup", "tokens_per_s", "final_validation_loss")}
    for row in rows.values():
        seeds = row["seeds"].values()
        row["mean_tokens_per_s"] = statistics.fmean(s["tokens_per_s"] for s in seeds)
        finals = [s["final_validation_loss"] for s in seeds if s["final_validation_loss"] is not None]
        row["mean_final_validation_loss"] = statistics.fmean(finals) if finals else None
        speedups = [s["speedup"] for s in seeds if s["speedup"] is not None]
        row["mean_speedup"] = statistics.fmean(speedups) if speedups else None
        row["reached"] = f"{len(speedups)}/{len(row['seeds'])}"
    return list(rows.values())


def markdown(rows: list[dict], per_seed: dict[int, dict]) -> str:
    seeds = sorted(per_seed)
    head = ["arm", *(f"time to target s (seed {s})" for s in seeds), "reached", "mean speed-up", "mean tokens/s", "mean final val loss"]
    lines = ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
    for row in rows:
        times = [cell(row["seeds"].get(s, {}).get("time_to_target_s"), "{:.1f}", "not reached") for s in seeds]
        lines.append("| " + " | ".join([row["arm"], *times, row["reached"], cell(row["mean_speedup"], "{:.2f}x"),
                                        f"{row['mean_tokens_per_s']:,.0f}", cell(row["mean_final_validation_loss"], "{:.4f}")]) + " |")
    return "\n".join(lines)


def report(args: argparse.Namespace, how: list[str]) -> None:
    """results.json, table.csv, README.md, seed 0's curves and the runs' configs in --out."""
    per_seed = {}
    for seed in args.seeds:
        runs, per_seed[seed] = seed_results(args, seed)
        if seed == args.seeds[0]:
            args.out.mkdir(parents=True, exist_ok=True)
            plots = draw_plots(runs, per_seed[seed]["target"], args.out)
        for run in runs:
            (args.out / "configs").mkdir(exist_ok=True)
            record_config(run.record.directory, args.out / "configs" / f"{run.label}.toml")
    rows = table(per_seed)
    (args.out / "results.json").write_text(json.dumps({"per_seed": per_seed, "table": rows}, indent=1))
    with open(args.out / "table.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["arm", "seed", "time_to_target_s", "speedup", "tokens_per_s", "final_validation_loss"])
        for row in rows:
            for seed, values in row["seeds"].items():
                writer.writerow([row["arm"], seed, *("" if v is None else f"{v:.4f}" for v in values.values())])
    targets = ", ".join(f"seed {s}: {r['target']:.4f}" for s, r in per_seed.items())
    text = markdown(rows, per_seed)
    parts = [
        "# Time to a target validation loss", "",
        f"Target: the final validation loss of {'-'.join(args.baseline)} at the same seed ({targets}); time is training "
        "wall-clock (validation excluded), interpolated between validations; speed-up = the baseline's time / the arm's.", "",
        text, "", "## How it was run", "", *how,
        f"- curves of seed {args.seeds[0]}: " + ", ".join(path.name for _, path in plots)
        + "; per run and seed: table.csv, results.json; resolved configs: configs/",
    ]
    (args.out / "README.md").write_text("\n".join(parts) + "\n")
    print(text)


def _names(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="debug_cpu_pp2", help="the config every arm trains (default: debug_cpu_pp2, p=2 m=4)")
    p.add_argument("--nproc", type=int, default=2, help="processes per run (the pipeline degree)")
    p.add_argument("--schedules", type=_names, default=list(SCHEDULES))
    p.add_argument("--optimizers", type=_names, default=list(OPTIMIZERS), help=f"of {', '.join(OPTIMIZERS)}")
    p.add_argument("--seeds", type=lambda t: [int(x) for x in _names(t)], default=[0, 1])
    p.add_argument("--baseline", default="1F1B:muon", help="SCHEDULE:OPTIMIZER whose final validation loss is the target")
    p.add_argument("--steps", type=int, default=150, help="optimizer steps of every arm (its lr schedule's length)")
    p.add_argument("--validation-freq", type=int, default=10)
    p.add_argument("--budget-s", type=float, help="wall-clock seconds per arm, after which a run is stopped")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="a config override for every arm")
    p.add_argument("--runs-dir", type=Path, default=ROOT / "runs" / "tta")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "tta")
    p.add_argument("--report-only", action="store_true", help="rebuild --out from the runs in --runs-dir, training nothing")
    args = p.parse_args(argv)
    args.baseline = tuple(args.baseline.split(":"))
    if len(args.baseline) != 2 or args.baseline[0] not in args.schedules or args.baseline[1] not in args.optimizers:
        p.error(f"--baseline {':'.join(args.baseline)}: expected SCHEDULE:OPTIMIZER among --schedules and --optimizers")
    if unknown := set(args.optimizers) - set(OPTIMIZERS):
        p.error(f"--optimizers: unknown {', '.join(sorted(unknown))}; expected some of {', '.join(OPTIMIZERS)}")
    args.argv = sys.argv[1:] if argv is None else argv
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    record_file = args.runs_dir / "study.json"
    how = json.loads(record_file.read_text())["how"] if record_file.is_file() else []
    if not args.report_only:
        args.runs_dir.mkdir(parents=True, exist_ok=True)
        _, invocation = run_recorded("tools/tta_study.py", args.argv, jobs(args), budget_s=args.budget_s)
        how.append(invocation)
        record_file.write_text(json.dumps({"how": how}, indent=1))
    report(args, how)


if __name__ == "__main__":
    main()
