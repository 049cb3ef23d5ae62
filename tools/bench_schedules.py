"""Throughput, bubble and memory of pipeline schedules on the same model, data and microbatches.

    python tools/bench_schedules.py --stages 2 --microbatches 4 --reps 5

Runs `titan-async train` once per schedule and repetition, interleaving the
schedules so machine noise hits them alike, and prints (and saves as CSV and PNG)
tokens/s from the median step time (steps after `--warmup`, the draining last step
excluded; median, min and max over repetitions), its ratio to 1F1B and to the best
synchronous schedule measured in the same invocation, and to the ideal: the
tokens/s of a pipeline that never waits, from the streaming runs' traced action
durations (the slowest rank's m x (median F + median B) + median optimizer step).
Also the bubble per rank (measured for the streaming schedules, which time every
action; for GPipe, 1F1B and Interleaved1F1B their formula's prediction in brackets;
"-" for the zero-bubble schedules, which no such formula describes), the peak
memory (RSS) per rank and its difference to 1F1B's, and the weight copies the
streaming schedules hold beyond the live weights, next to each rank's stage
weights from `titan-async plan`. With `--fsdp N` every stage is sharded over N
ranks, with `--replicas R` each stage's FSDP group is replicated R times (DDP, or
HSDP with `--fsdp`; stages x N x R processes), and `--accumulate K` makes a step
accumulate K local batches (torchtitan's gradient accumulation: a streaming window
of K x m microbatches, K flushes of m for torch's schedules). With FSDP or replicas
the table adds the collective bytes per step on each rank, all-gather +
reduce-scatter + replica all-reduce (the tensor bytes each takes, counted from the
collectives FSDP issues; median over the measured steps), the replica all-reduce
bytes alone, and the largest per-rank ratio to 1F1B's. "Rank" is a pipeline rank:
its scalars are those of its stage's first process (pipeline/stage<s>.jsonl).

The default model has balanced stages, so that idle time is the schedule's and not
the layer split's: at dim 128 with the 2048-token vocabulary the output head costs
about one layer, and counting the embedding as none
(`--first-stage-less-layers 0`), 13 layers split into 7 | 6 + head at p=2
(use `--layers 15` at p=4: 4 | 4 | 4 | 3 + head).

A model unbalanced the way a real one is: `--vocab N` gives the output head N columns (the
tokenizer's 2048 tokens stay; the rest of the head is never a target but costs as much), which
loads the last stage. `--balance` then also runs every schedule with the split `plan --simulate
--balance` chooses for it (its `module_fqns_per_model_part`, for that schedule's stage count),
as "SCHEDULE balanced", and with `--simulate` prints each variant's measured and simulated ratio
to the best synchronous schedule of the default split and the balanced split's gain over the
default one (paired within a repetition; min, median, max). `--microbatches 2,4` runs the whole
benchmark once per m in one invocation.
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

from titan_async.pipeline.simulation import costs_from_trace, simulate, traced_actions

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "train_configs" / "debug_cpu_pp2.toml"
SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "PipeDream2BW", "PACI"]
STREAMING = {"PipeDream2BW", "PACI"}
COLLECTIVES = ("fsdp_all_gather_bytes", "fsdp_reduce_scatter_bytes", "replica_all_reduce_bytes")
"""The per-step byte counts each rank logs (titan_async.parallel.fsdp_traffic)."""
ACCEPTED_RATIO = 1.1
"""The accepted bound: a streaming schedule moves at most this times 1F1B's collective bytes on every rank."""


BALANCED = " balanced"
"""Suffix of a variant that runs its schedule with `plan --balance`'s split."""


def schedule_of(variant: str) -> str:
    """The schedule a variant ("1F1B" or "1F1B balanced") runs."""
    return variant.removesuffix(BALANCED)


def streaming(variant: str) -> bool:
    return schedule_of(variant) in STREAMING


def settings(schedule: str, args) -> list[str]:
    """The `--set` assignments of one benchmark run."""
    return [
        f"parallelism.pipeline_parallel_degree={args.stages}",
        f"parallelism.data_parallel_shard_degree={args.fsdp}",
        f"parallelism.data_parallel_replicate_degree={args.replicas}",
        f"training.global_batch_size={args.microbatch_size * args.microbatches * args.fsdp * args.replicas * args.accumulate}",
        f"parallelism.pipeline_parallel_schedule={schedule}",
        f"parallelism.pipeline_parallel_microbatch_size={args.microbatch_size}",
        f"training.local_batch_size={args.microbatch_size * args.microbatches}",
        f"training.steps={args.steps}",
        f"training.seq_len={args.seq_len}",
        f"model.dim={args.dim}",
        f"model.n_layers={args.layers}",
        f"parallelism.pipeline_parallel_first_stage_less_layers={args.first_stage_less_layers}",
        f"model.vocab_size={args.vocab}",
        "checkpoint.enable=false",
        "validation.enable=false",
        "metrics.enable_tensorboard=false",
        "metrics.pipeline_trace=true",
    ]


def processes(args) -> int:
    """Ranks of one run: stages x FSDP x replicas."""
    return args.stages * args.fsdp * args.replicas


def data_parallel(args) -> bool:
    """Whether the runs issue FSDP or replica collectives."""
    return args.fsdp > 1 or args.replicas > 1


def titan_async(command: str, schedule: str, args, *extra: str, split: list[list[str]] | None = None) -> subprocess.CompletedProcess:
    """`titan-async COMMAND` on the benchmark's model and `schedule` (with `split` as its
    module_fqns_per_model_part)."""
    argv = [sys.executable, "-m", "titan_async.cli", command, "--config", str(CONFIG), *extra]
    for setting in settings(schedule, args) + ([f"parallelism.module_fqns_per_model_part={json.dumps(split)}"] if split else []):
        argv += ["--set", setting]
    result = subprocess.run(argv, cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"titan-async {command} ({schedule}) exited {result.returncode}:\n{result.stderr[-4000:]}")
    return result


def stage_weights_mib(args) -> dict[int, float]:
    """Parameter MiB of each pipeline rank's stages, from `titan-async plan`."""
    plan = json.loads(titan_async("plan", "1F1B", args, "--gpus-per-node", str(processes(args)), "--json").stdout)
    return {row["pp_rank"]: row["memory"]["weights"] / 2**20 for row in plan["ranks"]}


MULTI_STAGE = {"Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"}
"""Schedules with two stages per rank: their split has 2p stages."""


def balanced_splits(schedules: list[str], args) -> dict[str, list[list[str]]]:
    """Schedule -> the split `plan --simulate --balance` chooses for it, where it proposes one
    (asked once per stage count: the split depends on nothing else), with plan's FLOP-costed
    gain of every schedule printed."""
    splits, plans = {}, {}
    for schedule in schedules:
        multi = schedule in MULTI_STAGE
        if multi not in plans:
            plans[multi] = json.loads(titan_async("plan", schedule, args, "--gpus-per-node", str(processes(args)), "--simulate",
                                                  "--balance", "--json").stdout)["balance"]
        plan = plans[multi]
        if plan["balanced"]:
            splits[schedule] = plan["module_fqns_per_model_part"]
        gain = next(row["gain"] for row in plan["schedules"] if row["name"] == schedule)
        print(f"{schedule}: balanced split {plan['module_fqns_per_model_part'] if plan['balanced'] else 'none proposed'}"
              f" (stage shares {' '.join(f'{x:.1%}' for x in plan['configured_shares'])} -> "
              f"{' '.join(f'{x:.1%}' for x in plan['shares'])}; plan's FLOP-costed gain {gain:.3f}x)", flush=True)
    return splits


def ideal_step_time(trace: Path, microbatches: int) -> float:
    """Seconds per step of the slowest rank if it never waited: m x (median forward + median
    backward) + median optimizer step, from a traced streaming run's action durations."""
    durations: dict[int, dict[str, list[float]]] = {}
    for action in traced_actions(json.loads(trace.read_text())["traceEvents"]):
        durations.setdefault(action.rank, {}).setdefault(action.kind, []).append(action.end - action.start)
    median = statistics.median
    return max(microbatches * (median(d["F"]) + median(d["B"])) + median(d["O"]) for d in durations.values())


def median_mib(rows: dict[int, dict], steps: range, *keys: str) -> float:
    """Median over `steps` of the sum of a rank's logged byte counts `keys`, in MiB."""
    return statistics.median(sum(rows[s].get(key, 0) for key in keys) for s in steps) / 2**20


def run(variant: str, args, run_dir: Path, split: list[list[str]] | None = None) -> dict:
    """Train once (with `split` as the stages' modules); returns tokens/s, per-rank bubble, memory
    and collective traffic over the measured steps, and the ideal tokens/s of a traced (streaming) run."""
    schedule = schedule_of(variant)
    titan_async("train", schedule, args, "--nproc-per-node", str(processes(args)), "--run-dir", str(run_dir), split=split)
    measured = range(args.warmup + 1, args.steps)  # the last step also drains
    per_rank = {}  # stage -> its first rank's rows (pipeline/stage<s>.jsonl); one rank per stage without --fsdp/--replicas
    for path in sorted((run_dir / "pipeline").glob("stage*.jsonl")):
        rows = {r["step"]: r for r in map(json.loads, path.read_text().splitlines())}
        per_rank[int(path.stem.removeprefix("stage"))] = rows
    step_time = statistics.median(per_rank[0][s]["time"] - per_rank[0][s - 1]["time"] for s in measured)
    tokens = args.microbatch_size * args.microbatches * args.seq_len * args.fsdp * args.replicas * args.accumulate
    trace = run_dir / "pipeline" / "trace.json"
    window = args.microbatches * args.accumulate  # a streaming step's microbatches
    simulated = None
    if args.simulate:  # the costs of the measured steps only: this machine's speed drifts over a run
        start, stop = per_rank[0][args.warmup]["time"] * 1e6, per_rank[0][args.steps - 1]["time"] * 1e6
        events = [e for e in json.loads(trace.read_text())["traceEvents"] if start <= e["ts"] < stop]
        costs = costs_from_trace(events, window, schedule not in STREAMING, args.accumulate)
        simulated = tokens / simulate(schedule, args.stages, args.microbatches, costs, flushes=args.accumulate).step_time
    return {
        "tokens_per_s": tokens / step_time,
        "simulated_tokens_per_s": simulated,
        "ideal_tokens_per_s": tokens / ideal_step_time(trace, window) if schedule in STREAMING else None,
        "bubble": {r: statistics.median(rows[s]["bubble"] for s in measured) for r, rows in per_rank.items()},
        "memory_gib": {r: max(rows[s]["memory_gib"] for s in measured) for r, rows in per_rank.items()},
        "copies_mib": {r: 1024 * max(rows[s].get("weight_versions_gib", 0.0) for s in measured) for r, rows in per_rank.items()},
        "collective_mib": {r: median_mib(rows, measured, *COLLECTIVES) for r, rows in per_rank.items()},
        "all_reduce_mib": {r: median_mib(rows, measured, "replica_all_reduce_bytes") for r, rows in per_rank.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--fsdp", type=int, default=1, help="FSDP2 degree inside each stage (stages x fsdp x replicas processes)")
    parser.add_argument("--replicas", type=int, default=1, help="replicas of each stage's FSDP group (DDP, HSDP with --fsdp)")
    parser.add_argument("--accumulate", type=int, default=1, help="local batches accumulated per optimizer step")
    parser.add_argument("--microbatches", default="4", help="microbatches per step; a list (2,4) runs the benchmark once per m")
    parser.add_argument("--microbatch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=13)
    parser.add_argument("--vocab", type=int, default=0, help="output head columns (model.vocab_size); 0: the tokenizer's 2048")
    parser.add_argument("--first-stage-less-layers", type=int, default=0,
                        help="layers the embedding counts for when splitting (parallelism.pipeline_parallel_first_stage_less_layers)")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--simulate", action="store_true",
                        help="also simulate each run from its own trace (titan_async.pipeline.simulation) and print "
                             "simulated against measured ratios to 1F1B")
    parser.add_argument("--balance", action="store_true",
                        help="also run every schedule with the split plan --simulate --balance chooses for it")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "results")
    args = parser.parse_args()
    for m in map(int, args.microbatches.split(",")):
        benchmark(argparse.Namespace(**{**vars(args), "microbatches": m}))


def benchmark(args) -> None:
    """Every variant `args.reps` times, interleaved, then the tables (`report`)."""
    schedules = args.schedules.split(",")
    splits = balanced_splits(schedules, args) if args.balance else {}
    variants = [v for s in schedules for v in [s, *([s + BALANCED] if s in splits else [])]]
    weights = stage_weights_mib(args)
    results: dict[str, list[dict]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as scratch:
        for rep in range(args.reps):
            for variant in variants if rep % 2 == 0 else reversed(variants):
                split = splits.get(schedule_of(variant)) if variant.endswith(BALANCED) else None
                results[variant].append(run(variant, args, Path(scratch) / f"{variant.replace(' ', '-')}-{rep}", split))
                print(f"rep {rep} {variant}: {results[variant][-1]['tokens_per_s']:,.0f} tokens/s", flush=True)
    report(results, weights, args)


def predicted_bubble(schedule: str, p: int, m: int) -> float | None:
    """The idle share a synchronous schedule's formula predicts; None where no formula describes it."""
    stages_per_rank = {"GPipe": 1, "1F1B": 1, "Interleaved1F1B": 2}.get(schedule)
    return None if stages_per_rank is None else (p - 1) / (stages_per_rank * m + p - 1)


def report(results: dict[str, list[dict]], weights: dict[int, float], args) -> None:
    p, m = args.stages, args.microbatches
    speeds = {s: [r["tokens_per_s"] for r in runs] for s, runs in results.items()}
    median = {s: statistics.median(v) for s, v in speeds.items()}
    synchronous = [s for s in results if not streaming(s)]
    best_sync = max(synchronous, key=median.get) if synchronous else None
    ideals = [r["ideal_tokens_per_s"] for runs in results.values() for r in runs if r["ideal_tokens_per_s"]]
    ideal = statistics.median(ideals) if ideals else None

    def ratio(value: float, reference: float | None) -> str:
        return f"{value / reference:.3f}" if reference else "-"

    def per_rank_median(key: str) -> dict[str, dict[int, float]]:
        return {s: {k: statistics.median(r[key][k] for r in runs) for k in runs[0][key]} for s, runs in results.items()}

    rows = []
    traffic, all_reduce = per_rank_median("collective_mib"), per_rank_median("all_reduce_mib")
    worst: dict[str, float] = {}
    peak = {s: {k: max(r["memory_gib"][k] for r in runs) for k in runs[0]["memory_gib"]} for s, runs in results.items()}
    for schedule, runs in results.items():
        ranks = sorted(runs[0]["memory_gib"])
        bubbles = [f"{statistics.median(r['bubble'][k] for r in runs):.1%}" for k in ranks]
        formula = predicted_bubble(schedule_of(schedule), p, m) if not streaming(schedule) else None
        memory = [f"{peak[schedule][k]:.3f}" for k in ranks]
        extra = [f"{peak[schedule][k] - peak['1F1B'][k]:+.3f}" for k in ranks] if "1F1B" in peak else ["-"]
        copies = [f"{max(r['copies_mib'][k] for r in runs):.2f}" for k in ranks] if streaming(schedule) else ["-"]
        speed = median[schedule]
        rows.append([schedule, f"{speed:,.0f}", f"{min(speeds[schedule]):,.0f}", f"{max(speeds[schedule]):,.0f}",
                     ratio(speed, median.get("1F1B")), ratio(speed, median.get(best_sync)), ratio(speed, ideal),
                     " ".join(bubbles), "-" if formula is None else f"{formula:.0%}", " ".join(memory), " ".join(extra), " ".join(copies)])
        if data_parallel(args):
            mine, base = traffic[schedule], traffic.get("1F1B")
            if base:
                worst[schedule] = max(mine[k] / base[k] for k in ranks)
            rows[-1] += [" ".join(f"{mine[k]:.4g}" for k in ranks), " ".join(f"{all_reduce[schedule][k]:.4g}" for k in ranks),
                         f"{worst[schedule]:.3f}" if base else "-"]
    header = ["schedule", "tokens/s", "min", "max", "vs 1F1B", "vs best sync", "of ideal", "bubble per rank",
              "formula bubble", "peak GiB per rank", "vs 1F1B GiB per rank", "weight copies MiB per rank"]
    if data_parallel(args):
        header += ["collective MiB/step per rank", "replica all-reduce MiB/step per rank", "collective vs 1F1B (worst rank)"]
    widths = [max(len(str(row[i])) for row in rows + [header]) for i in range(len(header))]
    print(f"\np={p} m={m}{layout_suffix(args, ' ', '=')}, median (min, max) of {args.reps} interleaved runs; "
          f"best synchronous: {best_sync or '-'}")
    if ideal:
        print(f"ideal (no waiting, from the traced F, B and optimizer durations): {ideal:,.0f} tokens/s")
    print(("stage weights MiB per rank: " if processes(args) == p else "stage shard MiB per pipeline rank: ") + " ".join(f"{weights[k]:.2f}" for k in sorted(weights)))
    for row in [header] + rows:
        print("  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)))
    if data_parallel(args):
        print_acceptance(worst)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"bench_schedules_p{p}_m{m}{layout_suffix(args, '_', '')}"
    with open(stem.with_suffix(".csv"), "w", newline="") as f:
        csv.writer(f).writerows([header] + rows)
    plot(rows, ideal, p, m, stem.with_suffix(".png"))
    print(f"saved {stem}.csv and {stem}.png")
    if args.simulate:
        report_simulation(results, args.reps, stem.with_name(stem.name + "_simulated.csv"))
    if args.simulate and args.balance:
        report_balance(results, stem.with_name(stem.name + "_gain.csv"))


SIMULATION_TOLERANCE = 0.05
"""The accepted calibration error: simulated ratio to 1F1B within 5% of the measured one."""


def report_simulation(results: dict[str, list[dict]], reps: int, path: Path) -> None:
    """Per schedule, the medians over repetitions of the measured and the simulated ratio of its
    tokens/s to 1F1B's in the same repetition (each run simulated from its own trace), the median
    over repetitions of their relative difference (paired: each repetition's simulated ratio
    against its measured one) against `SIMULATION_TOLERANCE`, and both tokens/s."""
    if "1F1B" not in results:
        print("--simulate: no ratios without 1F1B among --schedules")
        return
    header = ["schedule", "measured vs 1F1B", "simulated vs 1F1B", "difference", "measured tokens/s", "simulated tokens/s"]
    rows, worst = [], 0.0
    for schedule, runs in results.items():
        pairs = [(r["tokens_per_s"] / b["tokens_per_s"], r["simulated_tokens_per_s"] / b["simulated_tokens_per_s"])
                 for r, b in zip(runs, results["1F1B"])]
        measured = statistics.median(m for m, _ in pairs)
        simulated = statistics.median(s for _, s in pairs)
        difference = statistics.median(s / m - 1 for m, s in pairs)
        worst = max(worst, abs(difference))
        rows.append([schedule, f"{measured:.3f}", f"{simulated:.3f}", f"{difference:+.1%}",
                     f"{statistics.median(r['tokens_per_s'] for r in runs):,.0f}",
                     f"{statistics.median(r['simulated_tokens_per_s'] for r in runs):,.0f}"])
    widths = [max(len(row[i]) for row in rows + [header]) for i in range(len(header))]
    print(f"\nsimulated from each run's own trace (medians over {reps} repetitions of ratios within a repetition):")
    for row in [header] + rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)))
    verdict = "within" if worst <= SIMULATION_TOLERANCE else "ABOVE"
    print(f"largest difference: {worst:.1%} ({verdict} the accepted {SIMULATION_TOLERANCE:.0%})")
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([header] + rows)
    print(f"saved {path}")


def layout_suffix(args, separator: str, equals: str) -> str:
    """The options that differ from one process per stage and the default model, e.g.
    " fsdp=2 replicas=2" or "_fsdp2_replicas2"; "_vocab8192_balance" with --vocab and --balance."""
    options = {"fsdp": args.fsdp, "replicas": args.replicas, "accumulate": args.accumulate, "vocab": args.vocab}
    text = "".join(f"{separator}{name}{equals}{value}" for name, value in options.items() if value > 1)
    return text + (f"{separator}balance" if args.balance else "")


def spread(values: list[float]) -> str:
    """min / median / max of ratios."""
    return f"{min(values):.3f} / {statistics.median(values):.3f} / {max(values):.3f}"


def report_balance(results: dict[str, list[dict]], path: Path) -> None:
    """Each variant's ratio to the best synchronous schedule of the default split (by median
    tokens/s), measured and simulated from each run's own trace, and each balanced variant's
    gain over its schedule's default split; every ratio paired within a repetition, min /
    median / max over repetitions."""
    default = [v for v in results if not streaming(v) and not v.endswith(BALANCED)]
    reference = max(default, key=lambda v: statistics.median(r["tokens_per_s"] for r in results[v]))

    def ratios(variant: str, base: str, key: str) -> list[float]:
        return [r[key] / b[key] for r, b in zip(results[variant], results[base])]

    header = ["variant", f"measured vs {reference} (min / median / max)", "simulated", "measured gain of balanced",
              "simulated gain"]
    rows = []
    for variant in results:
        gain = variant.endswith(BALANCED)
        rows.append([variant, spread(ratios(variant, reference, "tokens_per_s")),
                     spread(ratios(variant, reference, "simulated_tokens_per_s")),
                     spread(ratios(variant, schedule_of(variant), "tokens_per_s")) if gain else "",
                     spread(ratios(variant, schedule_of(variant), "simulated_tokens_per_s")) if gain else ""])
    widths = [max(len(row[i]) for row in rows + [header]) for i in range(len(header))]
    print("\nbalanced split: ratios within each repetition (min / median / max); simulated: each run's own trace")
    for row in [header] + rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([header] + rows)
    print(f"saved {path}")


def print_acceptance(worst: dict[str, float]) -> None:
    """Each streaming schedule's largest per-rank ratio of collective bytes to 1F1B's, against `ACCEPTED_RATIO`."""
    streamed = {s: ratio for s, ratio in worst.items() if streaming(s)}
    print("collective = FSDP all-gather + reduce-scatter + replica all-reduce bytes per step (the tensors they take)")
    if streamed:
        verdict = "within" if max(streamed.values()) <= ACCEPTED_RATIO else "ABOVE"
        print("largest per-rank collective bytes vs 1F1B: " + ", ".join(f"{s} {r:.3f}x" for s, r in streamed.items())
              + f" ({verdict} the accepted {ACCEPTED_RATIO}x)")


def plot(rows: list[list[str]], ideal: float | None, p: int, m: int, path: Path) -> None:
    """Bar chart of median tokens/s per schedule with its min-max range, labelled with the
    ratio to the best synchronous schedule, and the ideal as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def number(cell: str) -> float:
        return float(cell.replace(",", ""))

    fig, ax = plt.subplots(figsize=(9, 3.8))
    speeds = [number(row[1]) for row in rows]
    spread = [[s - number(row[2]) for s, row in zip(speeds, rows)], [number(row[3]) - s for s, row in zip(speeds, rows)]]
    ax.bar([row[0] for row in rows], speeds, yerr=spread, capsize=3,
           color=["tab:gray" if not streaming(row[0]) else "tab:blue" for row in rows])
    for i, row in enumerate(rows):
        ax.text(i, number(row[3]), row[5], ha="center", va="bottom")
    if ideal:
        ax.axhline(ideal, color="tab:green", linestyle="--", label=f"ideal {ideal:,.0f}")
        ax.legend(loc="lower right")
    ax.margins(y=0.12)
    ax.tick_params(axis="x", labelsize=7)
    ax.set_ylabel("tokens/s")
    ax.set_title(f"pipeline schedules, p={p}, m={m} (labels: ratio to the best synchronous schedule)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
