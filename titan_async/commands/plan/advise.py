"""`plan --simulate --gpu-counts N,N,...`: which schedule to run at each cluster size for a fixed
global batch.

The config's global batch (tokens per step on the `--nodes` x `--gpus-per-node` cluster) is kept
at every GPU count: the pipeline, tensor-parallel and replica degrees stay as configured, FSDP
takes the GPUs left, and each data rank's batch shrinks as they grow (a count that does not
divide the batch into whole microbatches is left out, with the reason). Each point is simulated
as `plan --simulate` simulates the config; m / p (microbatches per flush over pipeline ranks) is
what decides the gain of the streaming schedules over the best synchronous one. The recommended
schedule is the fastest whose peak memory fits `--gpu-memory` (or whose memory plan cannot tell).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from titan_async.commands.plan.estimate import Cluster, check_world_size
from titan_async.config.run_config import RunConfig
from titan_async.core.errors import UserError
from titan_async.pipeline.config import accumulation_steps
from titan_async.pipeline.schedules import STREAMING_SCHEDULES


def at_gpu_count(run: RunConfig, sequences: int, gpus: int) -> RunConfig | str:
    """`run` on `gpus` GPUs with `sequences` per step, or why it cannot be."""
    p, t = run.parallelism, run.training
    fixed = p.pipeline_parallel_degree * p.tensor_parallel_degree * p.context_parallel_degree * p.data_parallel_replicate_degree
    if gpus % fixed:
        return f"{gpus} GPUs do not divide into the pipeline x TP x CP x replica degrees ({fixed})"
    data_ranks = gpus // fixed * p.data_parallel_replicate_degree
    local, rest = divmod(sequences, data_ranks)
    if rest or local % p.pipeline_parallel_microbatch_size or local == 0:
        return (f"{sequences} sequences per step over {data_ranks} data ranks is no whole number of microbatches of "
                f"{p.pipeline_parallel_microbatch_size}")
    return replace(run, training=replace(t, local_batch_size=local, global_batch_size=-1),
                   parallelism=replace(p, data_parallel_shard_degree=-1))


def advise(run: RunConfig, cluster: Cluster, gpu_counts: list[int], simulate: Callable[[RunConfig, Cluster], dict]) -> dict[str, Any]:
    """Every schedule's simulated tokens/s at each of `gpu_counts` for the global batch `run` has
    on `cluster`; `simulate(run, cluster)` is a plan with its "simulation"."""
    check_world_size(run, cluster)
    data_ranks = run.data_parallel_degree(cluster.world_size)
    sequences = run.training.local_batch_size * data_ranks * accumulation_steps(run.training, data_ranks)
    points, skipped = [], []
    for gpus in gpu_counts:
        if gpus % cluster.gpus_per_node and gpus > cluster.gpus_per_node:
            skipped.append({"gpus": gpus, "reason": f"not a whole number of {cluster.gpus_per_node}-GPU nodes"})
            continue
        scaled = at_gpu_count(run, sequences, gpus)
        if isinstance(scaled, str):
            skipped.append({"gpus": gpus, "reason": scaled})
            continue
        nodes, per_node = (gpus // cluster.gpus_per_node, cluster.gpus_per_node) if gpus >= cluster.gpus_per_node else (1, gpus)
        try:
            plan = simulate(scaled, replace(cluster, nodes=nodes, gpus_per_node=per_node))
        except UserError as err:
            skipped.append({"gpus": gpus, "reason": str(err)})
            continue
        simulated = plan["simulation"]["schedules"]
        schedules = {s["name"]: s["tokens_per_second"] for s in simulated}
        fitting = {s["name"]: s["tokens_per_second"] for s in simulated if not s.get("memory") or s["memory"]["fits"]}
        synchronous = {name: v for name, v in schedules.items() if name not in STREAMING_SCHEDULES}
        streaming = {name: v for name, v in schedules.items() if name in STREAMING_SCHEDULES}
        best_sync, best_stream = max(synchronous, key=synchronous.get), max(streaming, key=streaming.get)
        layout = plan["layout"]
        points.append({
            "gpus": gpus,
            "m_over_p": layout["microbatches"] * layout["accumulation_steps"] / layout["pipeline_parallel"],
            "tokens_per_second": schedules,
            "best_synchronous": best_sync,
            "best_streaming": best_stream,
            "streaming_gain": streaming[best_stream] / synchronous[best_sync],
            "recommended": max(fitting, key=fitting.get) if fitting else None,
            "config_schedule_fits": plan["fits"],
        })
    return {"sequences_per_step": sequences, "tokens_per_step": sequences * run.training.seq_len,
            "points": points, "skipped": skipped}


def draw(advice: dict[str, Any], path: Path) -> None:
    """tokens/s of every schedule against the GPU count, each point labelled with its m / p."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = advice["points"]
    figure, axes = plt.subplots(figsize=(8, 5))
    names = dict.fromkeys(name for point in points for name in point["tokens_per_second"])
    for name in names:  # a schedule torch cannot build at some count has no point there
        mine = [(point["gpus"], point["tokens_per_second"][name]) for point in points if name in point["tokens_per_second"]]
        style = "-" if name in STREAMING_SCHEDULES else "--"
        axes.plot(*zip(*mine), style, marker="o", label=name)
    for point in points:
        axes.annotate(f"m/p {point['m_over_p']:g}", (point["gpus"], max(point["tokens_per_second"].values())),
                      textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    axes.set_xscale("log", base=2)
    axes.set_xlabel("GPUs")
    axes.set_ylabel("tokens/s (simulated)")
    axes.set_title(f"{advice['tokens_per_step']:,} tokens per step at every GPU count")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
