"""Throughput, bubble and memory of pipeline schedules on the same model, data and microbatches.

    python tools/bench_schedules.py --stages 2 --microbatches 4 --reps 3

Runs `titan-async train` once per schedule and repetition, interleaving the
schedules so machine noise hits them alike, and prints (and saves as CSV and PNG)
tokens/s from the median step time (steps after `--warmup`, the draining last step
excluded; median over repetitions), its ratio to 1F1B measured in the same
invocation, the measured bubble per rank (streaming schedules time every action;
the synchronous ones show the (p-1)/(m+p-1) prediction in brackets), the peak
memory (RSS) per rank and its difference to 1F1B's, and the weight copies the
streaming schedules hold beyond the live weights, next to each rank's stage
weights from `titan-async plan`.

The default model has balanced stages, so that idle time is the schedule's and not
the layer split's: at dim 128 with the 2048-token vocabulary the output head costs
about one layer, and counting the embedding as none
(`--first-stage-less-layers 0`), 13 layers split into 7 | 6 + head at p=2
(use `--layers 15` at p=4: 4 | 4 | 4 | 3 + head).
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "train_configs" / "debug_cpu_pp2.toml"
SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "PipeDream2BW", "PACI"]
STREAMING = {"PipeDream2BW", "PACI"}


def settings(schedule: str, args) -> list[str]:
    """The `--set` assignments of one benchmark run."""
    return [
        f"parallelism.pipeline_parallel_degree={args.stages}",
        f"parallelism.pipeline_parallel_schedule={schedule}",
        f"parallelism.pipeline_parallel_microbatch_size={args.microbatch_size}",
        f"training.local_batch_size={args.microbatch_size * args.microbatches}",
        f"training.steps={args.steps}",
        f"training.seq_len={args.seq_len}",
        f"model.dim={args.dim}",
        f"model.n_layers={args.layers}",
        f"parallelism.pipeline_parallel_first_stage_less_layers={args.first_stage_less_layers}",
        "checkpoint.enable=false",
        "validation.enable=false",
        "metrics.enable_tensorboard=false",
    ]


def titan_async(command: str, schedule: str, args, *extra: str) -> subprocess.CompletedProcess:
    """`titan-async COMMAND` on the benchmark's model and `schedule`."""
    argv = [sys.executable, "-m", "titan_async.cli", command, "--config", str(CONFIG), *extra]
    for setting in settings(schedule, args):
        argv += ["--set", setting]
    return subprocess.run(argv, check=True, cwd=REPO, capture_output=True, text=True)


def stage_weights_mib(args) -> dict[int, float]:
    """Parameter MiB of each pipeline rank's stages, from `titan-async plan`."""
    plan = json.loads(titan_async("plan", "1F1B", args, "--gpus-per-node", str(args.stages), "--json").stdout)
    return {row["pp_rank"]: row["memory"]["weights"] / 2**20 for row in plan["ranks"]}


def run(schedule: str, args, run_dir: Path) -> dict:
    """Train once; returns tokens/s and per-rank bubble and memory over the measured steps."""
    titan_async("train", schedule, args, "--nproc-per-node", str(args.stages), "--run-dir", str(run_dir))
    measured = range(args.warmup + 1, args.steps)  # the last step also drains
    per_rank = {}
    for path in sorted((run_dir / "pipeline").glob("rank*.jsonl")):
        rows = {r["step"]: r for r in map(json.loads, path.read_text().splitlines())}
        per_rank[int(path.stem[4:])] = rows
    step_time = statistics.median(per_rank[0][s]["time"] - per_rank[0][s - 1]["time"] for s in measured)
    return {
        "tokens_per_s": args.microbatch_size * args.microbatches * args.seq_len / step_time,
        "bubble": {r: statistics.median(rows[s]["bubble"] for s in measured) if schedule in STREAMING else None for r, rows in per_rank.items()},
        "memory_gib": {r: max(rows[s]["memory_gib"] for s in measured) for r, rows in per_rank.items()},
        "copies_mib": {r: 1024 * max(rows[s].get("weight_versions_gib", 0.0) for s in measured) for r, rows in per_rank.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--microbatch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=13)
    parser.add_argument("--first-stage-less-layers", type=int, default=0,
                        help="layers the embedding counts for when splitting (parallelism.pipeline_parallel_first_stage_less_layers)")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "results")
    args = parser.parse_args()
    schedules = args.schedules.split(",")
    weights = stage_weights_mib(args)
    results: dict[str, list[dict]] = {s: [] for s in schedules}
    with tempfile.TemporaryDirectory() as scratch:
        for rep in range(args.reps):
            for schedule in schedules if rep % 2 == 0 else reversed(schedules):
                results[schedule].append(run(schedule, args, Path(scratch) / f"{schedule}-{rep}"))
                print(f"rep {rep} {schedule}: {results[schedule][-1]['tokens_per_s']:,.0f} tokens/s", flush=True)
    report(results, weights, args)


def report(results: dict[str, list[dict]], weights: dict[int, float], args) -> None:
    p, m = args.stages, args.microbatches
    predicted = {"Interleaved1F1B": (p - 1) / (2 * m + p - 1)}  # two stages per rank
    baseline = statistics.median(r["tokens_per_s"] for r in results["1F1B"]) if "1F1B" in results else None
    rows = []
    peak = {s: {k: max(r["memory_gib"][k] for r in runs) for k in runs[0]["memory_gib"]} for s, runs in results.items()}
    for schedule, runs in results.items():
        speed = statistics.median(r["tokens_per_s"] for r in runs)
        ranks = sorted(runs[0]["memory_gib"])
        bubbles = [
            f"{statistics.median(r['bubble'][k] for r in runs):.1%}"
            if schedule in STREAMING
            else f"[{predicted.get(schedule, (p - 1) / (m + p - 1)):.0%}]"
            for k in ranks
        ]
        memory = [f"{peak[schedule][k]:.3f}" for k in ranks]
        extra = [f"{peak[schedule][k] - peak['1F1B'][k]:+.3f}" for k in ranks] if "1F1B" in peak else ["-"]
        copies = [f"{max(r['copies_mib'][k] for r in runs):.2f}" for k in ranks] if schedule in STREAMING else ["-"]
        rows.append([schedule, f"{speed:,.0f}", f"{speed / baseline:.3f}" if baseline else "-", " ".join(bubbles),
                     " ".join(memory), " ".join(extra), " ".join(copies)])
    header = ["schedule", "tokens/s", "vs 1F1B", "bubble per rank", "peak GiB per rank", "vs 1F1B GiB per rank", "weight copies MiB per rank"]
    widths = [max(len(str(row[i])) for row in rows + [header]) for i in range(len(header))]
    print(f"\np={p} m={m}, median of {args.reps} interleaved runs; ceiling of streaming vs 1F1B: {(m + p - 1) / m:.3f}")
    print("stage weights MiB per rank: " + " ".join(f"{weights[k]:.2f}" for k in sorted(weights)))
    for row in [header] + rows:
        print("  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"bench_schedules_p{p}_m{m}"
    with open(stem.with_suffix(".csv"), "w", newline="") as f:
        csv.writer(f).writerows([header] + rows)
    plot(rows, p, m, stem.with_suffix(".png"))
    print(f"saved {stem}.csv and {stem}.png")


def plot(rows: list[list[str]], p: int, m: int, path: Path) -> None:
    """Bar chart of tokens/s per schedule, labelled with the ratio to 1F1B."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.8))
    speeds = [float(row[1].replace(",", "")) for row in rows]
    ax.bar([row[0] for row in rows], speeds, color=["tab:gray" if row[0] not in STREAMING else "tab:blue" for row in rows])
    for i, row in enumerate(rows):
        ax.text(i, speeds[i], row[2], ha="center", va="bottom")
    ax.margins(y=0.12)
    ax.tick_params(axis="x", labelsize=8)
    ax.set_ylabel("tokens/s")
    ax.set_title(f"pipeline schedules, p={p}, m={m} (labels: ratio to 1F1B)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
