"""The peak memory per GPU of every schedule `plan --simulate` compares, for the config's model on
its cluster: the config with only `parallelism.pipeline_parallel_schedule` changed, split into
stages as torchtitan would split it for that schedule (2 stages per rank for the interleaved and
V-shaped ones), estimated as `plan` estimates the config's own (`estimate.estimate_model`):
weights, gradients, optimizer and error-feedback state, 2BW's other weight versions where the
schedule keeps them (d at a delay of d steps), FSDP's buffers, the transport's, the activations of the chunks in flight
(`pipeline.in_flight` for torch's schedules) and the optimizer step's scratch."""

from __future__ import annotations

import dataclasses
from typing import Any

from titan_async.cluster.estimate import Cluster, Estimate, estimate_model
from titan_async.config.run_config import RunConfig
from titan_async.core.errors import UserError


def with_schedule(run: RunConfig, name: str) -> RunConfig:
    """`run` with `parallelism.pipeline_parallel_schedule` = `name`, nothing else changed."""
    return dataclasses.replace(run, parallelism=dataclasses.replace(run.parallelism, pipeline_parallel_schedule=name))


def busiest(planned: Estimate, gpu_memory: int) -> dict[str, Any]:
    """The pipeline rank of `planned` with the highest peak: "peak_bytes", "pp_rank", its
    "held_microbatches" and "memory" (every component, `memory.COMPONENTS`, and "total"),
    "rank_peaks" (every rank's peak) and "fits" (the peak within `gpu_memory`)."""
    row = max(planned.rows, key=lambda r: r["memory"]["total"])
    return {
        "peak_bytes": row["memory"]["total"],
        "pp_rank": row["pp_rank"],
        "held_microbatches": row["held_microbatches"],
        "memory": row["memory"],
        "rank_peaks": [r["memory"]["total"] for r in planned.rows],
        "fits": row["memory"]["total"] <= gpu_memory,
    }


def schedule_memory(run: RunConfig, cluster: Cluster, planned: Estimate, names: list[str],
                    gpu: bool = True) -> dict[str, dict[str, Any] | str]:
    """Name -> `busiest` of the config's estimate under each schedule of `names` (`planned`,
    the config's own estimate, for its own schedule), or why it cannot be estimated (torchtitan
    cannot split the model so, or torch's schedule refuses the microbatches), in one line."""
    out: dict[str, dict[str, Any] | str] = {}
    for name in names:
        if name.lower() == planned.layout.schedule.lower():
            out[name] = busiest(planned, cluster.gpu_memory)
            continue
        try:
            out[name] = busiest(estimate_model(with_schedule(run, name), cluster, planned.vocab, planned.model, gpu),
                                cluster.gpu_memory)
        except (UserError, ValueError, AssertionError) as err:  # torch refuses some (p, m) in its own words
            out[name] = str(err).splitlines()[0]
    return out
