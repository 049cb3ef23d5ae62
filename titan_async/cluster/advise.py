"""`plan --simulate --gpu-counts N,N,...`: which schedule to run at each cluster size for a fixed
global batch.

The config's global batch (tokens per step on the `--nodes` x `--gpus-per-node` cluster) is kept
at every GPU count: the pipeline, tensor-parallel and replica degrees stay as configured, FSDP
takes the GPUs left, and each data rank's batch shrinks as they grow (a count that does not
divide the batch over its data ranks is left out, with the reason). At each count every schedule
is simulated as `plan --simulate` simulates the config, at each setting of `SETTINGS` (activation
checkpointing mode x microbatch size) that divides the data rank's batch into at least p
microbatches, and keeps its fastest setting whose peak memory (`schedule_memory`) fits
`--gpu-memory` and that `train` would run with it (selective recomputation is refused with the
split-backward schedules and PACI); a schedule with none shows why. Memory headroom buys speed:
a schedule that fits without recomputation is simulated without it. m / p (microbatches per step
over pipeline ranks) is what decides the gain of the streaming schedules over the best
synchronous one. The recommended schedule is the fastest of all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from titan_async.cluster.estimate import Cluster, check_world_size
from titan_async.cluster.schedule_memory import with_schedule
from titan_async.config.run_config import RunConfig
from titan_async.core.errors import UserError
from titan_async.pipeline.config import accumulation_steps, check_activation_checkpoint
from titan_async.pipeline.schedules import STREAMING_SCHEDULES

ACTIVATION_CHECKPOINT_MODES = ("none", "selective", "full")
MICROBATCH_SIZES = (1, 2, 4)
"""Microbatch sizes tried besides the config's own."""


@dataclass(frozen=True)
class Setting:
    """What the advisor varies per schedule: activation checkpointing mode and microbatch size."""

    activation_checkpoint: str
    microbatch_size: int

    @property
    def label(self) -> str:
        return f"ac={self.activation_checkpoint} mb={self.microbatch_size}"

    def apply(self, run: RunConfig) -> RunConfig:
        """`run` with this setting, nothing else changed."""
        return replace(run, activation_checkpoint=replace(run.activation_checkpoint, mode=self.activation_checkpoint),
                       parallelism=replace(run.parallelism, pipeline_parallel_microbatch_size=self.microbatch_size))


def settings(run: RunConfig) -> list[Setting]:
    """Every activation checkpointing mode x each microbatch size (`MICROBATCH_SIZES` and the
    config's) that splits `run`'s local batch into at least p microbatches."""
    local, pp = run.training.local_batch_size, run.parallelism.pipeline_parallel_degree
    sizes = sorted({*MICROBATCH_SIZES, run.parallelism.pipeline_parallel_microbatch_size})
    return [Setting(mode, size) for size in sizes if local % size == 0 and local // size >= pp
            for mode in ACTIVATION_CHECKPOINT_MODES]


def at_gpu_count(run: RunConfig, sequences: int, gpus: int) -> RunConfig | str:
    """`run` on `gpus` GPUs with `sequences` per step, or why it cannot be."""
    p, t = run.parallelism, run.training
    fixed = p.pipeline_parallel_degree * p.tensor_parallel_degree * p.context_parallel_degree * p.data_parallel_replicate_degree
    if gpus % fixed:
        return f"{gpus} GPUs do not divide into the pipeline x TP x CP x replica degrees ({fixed})"
    data_ranks = gpus // fixed * p.data_parallel_replicate_degree
    local, rest = divmod(sequences, data_ranks)
    if rest or local == 0:
        return f"{sequences} sequences per step do not divide over {data_ranks} data ranks"
    scaled = replace(run, training=replace(t, local_batch_size=local, global_batch_size=-1),
                     parallelism=replace(p, data_parallel_shard_degree=-1))
    if not settings(scaled):
        return (f"{local} sequences per data rank make fewer microbatches than {p.pipeline_parallel_degree} stages "
                f"at every microbatch size ({', '.join(map(str, sorted({*MICROBATCH_SIZES, p.pipeline_parallel_microbatch_size})))})")
    return scaled


def _candidates(name: str, plans: dict[Setting, dict]) -> tuple[list[tuple[float, Setting, dict]], list[tuple[float, str]]]:
    """Schedule `name`'s simulated rows that `train` would run and that fit, as (tokens/s,
    setting, row), and each other setting as (its peak bytes, inf where unknown; why)."""
    fitting, why = [], []
    for setting, plan in plans.items():
        if check_activation_checkpoint(with_schedule(plan["run"], name).parallelism, setting.activation_checkpoint):
            continue
        row = next((r for r in plan["simulation"]["schedules"] if r["name"] == name), None)
        if row is None:
            why.append((math.inf, f"{setting.label}: not simulated: {plan['simulation']['skipped'].get(name, 'unknown')}"))
        elif row.get("memory") is None:
            why.append((math.inf, f"{setting.label}: memory not estimated: {row.get('memory_note', '')}"))
        elif not row["memory"]["fits"]:
            peak = row["memory"]["peak_bytes"]
            why.append((peak, f"no setting fits --gpu-memory; the smallest peak is {peak / 2**30:.1f} GiB ({setting.label})"))
        else:
            fitting.append((row["tokens_per_second"], setting, row))
    return fitting, why


def fastest_fitting(name: str, plans: dict[Setting, dict]) -> dict[str, Any] | str:
    """Schedule `name`'s fastest fitting setting among `plans` (setting -> plan with its "run"):
    tokens/s, setting, m / p and peak bytes; or, when none fits, why in one line (the setting
    with the smallest peak, or why the first could not be simulated or estimated)."""
    fitting, why = _candidates(name, plans)
    if not fitting:
        return min(why, key=lambda found: found[0])[1] if why else "every setting refused with this schedule"
    tokens, setting, row = max(fitting, key=lambda found: found[0])
    return {"tokens_per_second": tokens, "setting": setting.label, "activation_checkpoint": setting.activation_checkpoint,
            "microbatch_size": setting.microbatch_size, "m_over_p": _m_over_p(plans[setting]),
            "peak_bytes": row["memory"]["peak_bytes"]}


def _m_over_p(plan: dict) -> float:
    layout = plan["layout"]
    return layout["microbatches"] * layout["accumulation_steps"] / layout["pipeline_parallel"]


def advise_point(run: RunConfig, cluster: Cluster, simulate: Callable[[RunConfig, Cluster], dict]) -> dict[str, Any] | str:
    """Every schedule at its fastest fitting setting (`fastest_fitting`) for `run` on `cluster`,
    the best synchronous and streaming ones, the gain of the one over the other and the
    recommended (fastest) schedule; or why no setting could be simulated."""
    plans, errors = {}, []
    for setting in settings(run):
        try:
            plans[setting] = {**simulate(setting.apply(run), cluster), "run": setting.apply(run)}
        except UserError as err:
            errors.append(f"{setting.label}: {err}")
    if not plans:
        return errors[0]
    names = dict.fromkeys(name for plan in plans.values()
                          for name in [*(r["name"] for r in plan["simulation"]["schedules"]), *plan["simulation"]["skipped"]])
    chosen = {name: fastest_fitting(name, plans) for name in names}
    fits = {name: c for name, c in chosen.items() if isinstance(c, dict)}
    tokens = {name: c["tokens_per_second"] for name, c in fits.items()}
    synchronous = {name: v for name, v in tokens.items() if name not in STREAMING_SCHEDULES}
    streaming = {name: v for name, v in tokens.items() if name in STREAMING_SCHEDULES}
    best_sync = max(synchronous, key=synchronous.get) if synchronous else None
    best_stream = max(streaming, key=streaming.get) if streaming else None
    own = Setting(run.activation_checkpoint.mode, run.parallelism.pipeline_parallel_microbatch_size)
    recommended = max(tokens, key=tokens.get) if tokens else None
    return {
        "tokens_per_second": tokens,
        "settings": fits,
        "unfit": {name: c for name, c in chosen.items() if isinstance(c, str)},
        "m_over_p": fits[recommended]["m_over_p"] if recommended else None,
        "best_synchronous": best_sync,
        "best_streaming": best_stream,
        "streaming_gain": streaming[best_stream] / synchronous[best_sync] if best_sync and best_stream else None,
        "recommended": recommended,
        "config_schedule_fits": plans[own]["fits"] if own in plans else None,
    }


def advise(run: RunConfig, cluster: Cluster, gpu_counts: list[int], simulate: Callable[[RunConfig, Cluster], dict]) -> dict[str, Any]:
    """Every schedule's simulated tokens/s at its fastest fitting setting (`advise_point`) at each
    of `gpu_counts` for the global batch `run` has on `cluster`; `simulate(run, cluster)` is a plan
    with its "layout", "fits" and "simulation" (each schedule's memory included)."""
    check_world_size(run, cluster)
    data_ranks = run.data_parallel_degree(cluster.world_size)
    sequences = run.training.local_batch_size * data_ranks * accumulation_steps(run.training, data_ranks)
    points, skipped = [], []
    for gpus in gpu_counts:
        if gpus % cluster.gpus_per_node and gpus > cluster.gpus_per_node:
            skipped.append({"gpus": gpus, "reason": f"not a whole number of {cluster.gpus_per_node}-GPU nodes"})
            continue
        scaled = at_gpu_count(run, sequences, gpus)
        nodes, per_node = (gpus // cluster.gpus_per_node, cluster.gpus_per_node) if gpus >= cluster.gpus_per_node else (1, gpus)
        point = scaled if isinstance(scaled, str) else advise_point(scaled, replace(cluster, nodes=nodes, gpus_per_node=per_node), simulate)
        if isinstance(point, str):
            skipped.append({"gpus": gpus, "reason": point})
            continue
        points.append({"gpus": gpus, **point})
    return {"sequences_per_step": sequences, "tokens_per_step": sequences * run.training.seq_len,
            "gpu_memory_bytes": cluster.gpu_memory, "points": points, "skipped": skipped}


def draw(advice: dict[str, Any], path: Path) -> None:
    """tokens/s of every schedule (at its fastest fitting setting) against the GPU count, each
    count labelled with the m / p of its recommended schedule's setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = advice["points"]
    figure, axes = plt.subplots(figsize=(8, 5))
    names = dict.fromkeys(name for point in points for name in point["tokens_per_second"])
    for name in names:  # a schedule that fits no setting at some count has no point there
        mine = [(point["gpus"], point["tokens_per_second"][name]) for point in points if name in point["tokens_per_second"]]
        style = "-" if name in STREAMING_SCHEDULES else "--"
        axes.plot(*zip(*mine), style, marker="o", label=name)
    for point in points:  # the m / p of the recommended schedule's setting
        if not point["recommended"]:
            continue
        axes.annotate(f"m/p {point['m_over_p']:g}", (point["gpus"], point["tokens_per_second"][point["recommended"]]),
                      textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    axes.set_xscale("log", base=2)
    axes.set_xlabel("GPUs")
    axes.set_ylabel("tokens/s (simulated, each schedule's fastest setting that fits)")
    axes.set_title(f"{advice['tokens_per_step']:,} tokens per step at every GPU count")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
