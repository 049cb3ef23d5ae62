"""`plan --simulate --balance`: the stage split that evens out the pipeline ranks' work.

Each module of the model (the embedding, every block, the norm, the output head) is costed as
the simulator costs a stage (`simulate.rank_costs`: FLOPs at the assumed MFU, MoE experts and EP
all-to-alls included), as a stage of its own: one step of it takes m x (forward + backward) +
its optimizer step, m the microbatches per step. The modules, in model order, are cut into as
many contiguous stages as the config has so that the costliest stage is as cheap as it can be
(`contiguous_partition`); with two stages per rank (interleaved, V) each stage is balanced
alike. The result is a `parallelism.module_fqns_per_model_part`, which `train` accepts as it is.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from torchtitan.distributed.pipeline_parallel import _generate_llm_fqn_per_model_part

from titan_async.cluster.estimate import Cluster, Estimate, estimate, stage_shapes
from titan_async.cluster.simulate import SimulationOptions, rank_costs
from titan_async.config.run_config import RunConfig


MIN_GAIN = 0.005
"""The least relative saving on the costliest stage for which another split is proposed."""


def contiguous_partition(costs: list[float], parts: int) -> list[int]:
    """Where to cut `costs` (in order) into `parts` non-empty runs whose largest sum is least:
    the start index of each run after the first (dynamic programming over prefix sums)."""
    n = len(costs)
    if not 1 <= parts <= n:
        raise ValueError(f"cannot cut {n} modules into {parts} stages")
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    best = [[float("inf")] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                worst = max(best[k - 1][j], prefix[i] - prefix[j])
                if worst < best[k][i]:
                    best[k][i], cut[k][i] = worst, j
    starts, i = [], n
    for k in range(parts, 1, -1):
        i = cut[k][i]
        starts.append(i)
    return starts[::-1]


def module_costs(run: RunConfig, cluster: Cluster, options: SimulationOptions, planned: Estimate) -> tuple[list[str], list[float]]:
    """The model's modules in order and the seconds one step of each takes as a stage of its own
    (`planned`: `estimate` of `run` on `cluster`)."""
    modules = _generate_llm_fqn_per_model_part(1, len(planned.model.module.layers))[0]
    each = [[name] for name in modules]
    layout = replace(planned.layout, pp=len(each), stage_modules=each, rank_stages=[(i,) for i in range(len(each))])
    shapes = stage_shapes(planned.model.module, each, run.parallelism.tensor_parallel_degree)
    costs = rank_costs(run, layout, planned.model.module, shapes, planned.setup, cluster, options)
    per_step = planned.layout.microbatches * planned.layout.accumulation_steps
    seconds = [per_step * (f + b) + o for f, b, o in zip(costs.forward, costs.backward, costs.optimizer)]
    return modules, seconds


def balanced_split(run: RunConfig, cluster: Cluster, options: SimulationOptions) -> dict[str, Any]:
    """The balanced `module_fqns_per_model_part` for the config's number of stages, with each
    stage's share of the model's cost, as configured and balanced."""
    planned = estimate(run, cluster)
    configured = planned.layout.stage_modules
    modules, seconds = module_costs(run, cluster, options, planned)
    bounds = [0, *contiguous_partition(seconds, len(configured)), len(modules)]
    balanced = [modules[a:b] for a, b in zip(bounds, bounds[1:])]
    total = sum(seconds)
    cost = dict(zip(modules, seconds))

    def shares(split: list[list[str]]) -> list[float]:
        return [sum(cost[name] for name in stage) / total for stage in split]

    if max(shares(balanced)) > max(shares(configured)) * (1 - MIN_GAIN):
        balanced = configured  # no split has a clearly cheaper costliest stage: keep the config's
    return {"module_fqns_per_model_part": balanced, "shares": shares(balanced), "configured_shares": shares(configured),
            "balanced": balanced != configured}


def with_split(run: RunConfig, modules: list[list[str]]) -> RunConfig:
    """`run` with its stages made of `modules`."""
    return replace(run, parallelism=replace(run.parallelism, module_fqns_per_model_part=modules))


def gains(configured: dict[str, Any], balanced: dict[str, Any]) -> list[dict[str, Any]]:
    """Each schedule's simulated tokens/s with the configured and the balanced split (the
    "simulation" parts of two plans)."""
    after = {s["name"]: s["tokens_per_second"] for s in balanced["schedules"]}
    return [{"name": s["name"], "configured": s["tokens_per_second"], "balanced": after[s["name"]],
             "gain": after[s["name"]] / s["tokens_per_second"], "selected": s["selected"]}
            for s in configured["schedules"] if s["name"] in after]
