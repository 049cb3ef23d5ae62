"""`plan --simulate`: every schedule's predicted step time, tokens/s and bubble for a config's
layout, from `pipeline.simulation` with costs derived from FLOPs at a given MFU, or measured by
a traced run of the same pipeline degree (`--costs-from RUN`: `pipeline.simulation.costs_from_trace`,
collectives and host work included in what it measured); `--gantt` draws each schedule's first
simulated steps.

Costs per pipeline rank (its stages as the config splits them; a schedule with v stages per
rank gives each 1/v):
- forward + backward of one microbatch: the stages' training FLOPs per GPU
  (`optim.muon_cost.stage_costs`: 6 x matmul weights x tokens plus causal attention, / TP x CP;
  MoE experts count top_k / num_experts of their weights) at `mfu` x `peak_tflops`, split 1:2;
  activation checkpointing adds what the backward recomputes (`recomputed_flops`: full, the
  whole forward; selective, every second matmul of each block); a split backward gives I and W
  half each of `split_cost` x the backward (SPLIT_COST: torch re-runs the autograd node where
  weights and inputs meet, so a compiled block, one node, runs its whole backward twice). Under expert parallelism each token
  all-to-all (`estimate.all_to_all_bytes`: dispatch and combine, 2 in the forward, 2 in the
  backward, 2 more with full recomputation) adds its bytes over the link the EP group spans,
  not overlapped.
- optimizer step: Muon's Newton-Schulz FLOPs on the busiest rank of the stage's Muon group
  (MoE: `memory.expert_newton_schulz`, each expert's matrix on its own) at the same MFU, plus
  the element-wise update (ELEMENTWISE_PASSES passes over the rank's weight shard in the
  parameter dtype, 2 more with error feedback) at HBM_BYTES_PER_S, plus Muon's gather and
  scatter of its busiest owner over the link the Muon group spans, not overlapped
  (`muon_exchange_seconds`), the same for every schedule.
- messages between stages: the stage-boundary tensor of one microbatch on one GPU (tokens x
  dim in the compute dtype), over the intra-node link when both pipeline ranks' first GPUs are
  on one node, else the inter-node link.
- FSDP all-gather + reduce-scatter and the replica all-reduce: the bytes `memory.fsdp_traffic_bytes`
  predicts per step, per gradient reduction, as ring collectives over the link their group
  spans, spread over the rank's FSDP units (blocks, the embedding, norm + output head) and
  overlapped unit by unit with the first forward after a reduction (gather) and the backward
  that completes one (reduction), as `pipeline.simulation` models them (PACI's gathers of
  predicted weights, two per forward, are spread over its reductions alike). A group spans the
  inter-node link as soon as its consecutive GPUs (TP innermost, then CP, FSDP, replicas) cross a
  node: the FSDP group's TP x CP x FSDP GPUs, the replica group's every GPU of the pipeline rank.
- TP's collectives: per block and microbatch the activation all-gathers and reduce-scatters of
  sequence parallelism as `memory.tp_traffic_bytes` counts them (forward 2 + 2, backward 2 + 2,
  recomputation repeats the forward's; without sequence parallelism the all-reduces, costed as
  their reduce-scatter and all-gather halves), each a ring collective moving (tp - 1) / tp of the
  (tokens x dim) activation over the intra-node link when the TP group fits on a node, else the
  inter-node link, added to the forward and backward, not overlapped (`tp_seconds`).

Without a pipeline (pipeline degree 1, `simulate_data_parallel`) one step is K microbatches (the
local batch, gradient accumulation over K = global batch / (local batch x data ranks)) on the one
rank, the same costs as a pipeline rank holding every stage: FSDP2 reshards after each forward, so
each microbatch gathers the weights before its forward (overlapped with it unit by unit) and again
in its backward, and reduce-scatters (and all-reduces across replicas) after it (torchtitan keeps
gradient sync on through accumulation), the backward's collectives overlapped with the backward as
above; then the optimizer step (`memory.data_parallel_traffic_bytes`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from titan_async.cluster.estimate import Cluster, Layout, all_to_all_bytes
from titan_async.cluster.memory import (
    Setup,
    StageShape,
    expert_newton_schulz,
    data_parallel_traffic_bytes,
    fsdp_traffic_bytes,
    reductions_per_step,
    tp_traffic_bytes,
)
from titan_async.config.run_config import RunConfig, load_run_config
from titan_async.core.errors import UserError
from titan_async.optim.muon_cost import StageCost, stage_costs
from titan_async.optim.routing import route_parameters
from titan_async.pipeline.config import accumulation_steps, check_delay, microbatches
from titan_async.pipeline.schedules import SCHEDULE_NAMES, STREAMING_SCHEDULES, streaming_schedule
from titan_async.pipeline.simulation import Collectives, Costs, Link, compare, costs_from_trace, one_f_one_b, simulate_synchronous
from titan_async.pipeline.split import check_microbatches, schedule_stages
from titan_async.pipeline.trace import draw_gantts

SPLIT_COST = {False: 1.03, True: 2.14}
"""(I + W) / B of torch's split backward, eager and compiled blocks: one block of the 1B config
(seq 512, bfloat16) on the CPU, `tools/gpu/bench_split_backward.py`
(docs/results/gpu/run4/cpu_split_backward_1b.txt); on a GPU (torch 2.11) the split did not run."""
HBM_BYTES_PER_S = 3.35e12
"""H100 SXM memory bandwidth, for the optimizer's element-wise passes."""
ELEMENTWISE_PASSES = 7
"""AdamW's update reads weight, gradient and 2 moments and writes weight and 2 moments."""
INTRA_NODE_LATENCY = 2e-6
INTER_NODE_LATENCY = 10e-6


@dataclass(frozen=True)
class SimulationOptions:
    """The hardware `plan --simulate` assumes (or the run whose trace gives the costs), and where
it draws the Gantt charts."""

    mfu: float = 0.4
    peak_tflops: float = 989.0
    intra_node_gbps: float = 450.0
    inter_node_gbps: float = 50.0
    costs_from: Path | None = None
    gantt: Path | None = None

    def __post_init__(self) -> None:
        if not 0 < self.mfu <= 1:
            raise UserError(f"--mfu {self.mfu:g}: must be in (0, 1]")
        for flag, value in (("--peak-tflops", self.peak_tflops), ("--intra-node-gbps", self.intra_node_gbps),
                            ("--inter-node-gbps", self.inter_node_gbps)):
            if not value > 0:
                raise UserError(f"{flag} {value:g}: must be positive")

    @property
    def flops_per_s(self) -> float:
        return self.mfu * self.peak_tflops * 1e12


def _links(options: SimulationOptions) -> tuple[Link, Link]:
    return Link(INTRA_NODE_LATENCY, options.intra_node_gbps * 1e9), Link(INTER_NODE_LATENCY, options.inter_node_gbps * 1e9)


def microbatch_sequences(run: RunConfig, layout: Layout) -> int:
    """Sequences of one forward-backward pass: a pipeline microbatch, or without a pipeline the local batch."""
    pipelined = layout.pp > 1 or layout.emulated
    return run.parallelism.pipeline_parallel_microbatch_size if pipelined else run.training.local_batch_size


def _stage_costs(run: RunConfig, layout: Layout, model: torch.nn.Module, setup: Setup) -> list[StageCost]:
    """`muon_cost.stage_costs` of every stage of `layout` over the Muon group: training FLOPs of one
    microbatch, Newton-Schulz FLOPs and received bytes of the busiest owner per optimizer step."""
    return stage_costs(
        route_parameters(model), layout.stage_modules, fsdp=setup.muon_group, ns_steps=setup.ns_steps,
        ns_dtype=getattr(torch, setup.ns_dtype), state_bytes=setup.param_bytes,
        tokens=microbatch_sequences(run, layout) * run.training.seq_len,
        seq_len=run.training.seq_len, dim=setup.dim,
    )


def muon_link(setup: Setup, cluster: Cluster, options: SimulationOptions) -> Link:
    """The link Muon's exchange crosses: intra-node when its group (FSDP x CP x TP ranks of one
    pipeline rank, consecutive ranks) fits on a node, else inter-node."""
    intra, inter = _links(options)
    return intra if setup.muon_group <= cluster.gpus_per_node else inter


def muon_exchange_seconds(run: RunConfig, layout: Layout, stages: list[StageCost], setup: Setup, cluster: Cluster,
                          options: SimulationOptions) -> tuple[float, ...]:
    """Per pipeline rank, the seconds of Muon's gather and scatter in each optimizer step: what
    the busiest owner of each of its stages' Muon groups receives (`StageCost.received_bytes`:
    the other shards of the matrices it owns, then its own rows of the others' results) over
    `muon_link`'s bandwidth, summed over the rank's stages, not overlapped with anything (the
    Newton-Schulz iteration needs the gathered matrix and the update the scattered rows); the
    latency is left out. 0 for every rank under AdamW or with whole matrices (a group of 1)."""
    if run.optimizer.name != "muon":
        return (0.0,) * layout.pp
    bandwidth = muon_link(setup, cluster, options).bandwidth
    return tuple(sum(stages[i].received_bytes for i in indices) / bandwidth for indices in layout.rank_stages)


def recomputed_flops(training_flops: float, layers: int, setup: Setup, tokens: int) -> float:
    """FLOPs the backward of one microbatch repeats of its forward, before the TP x CP split, for
    stages of `training_flops` (forward + backward) holding `layers` blocks: full recomputation
    the whole forward (a third); torchtitan's selective policy every second matmul of each block
    (it saves the others and attention; counted per block: wqkv, wo, w1, w3, w2, so wo and w3 are
    recomputed, 2 x tokens x (dim^2 + dim x ffn_dim); an MoE block's experts are not counted);
    none nothing."""
    if setup.activation_checkpoint == "full":
        return training_flops / 3
    if setup.activation_checkpoint == "selective":
        return 2 * tokens * layers * (setup.dim ** 2 + setup.dim * setup.ffn_dim)
    return 0.0


def tp_link(setup: Setup, cluster: Cluster, options: SimulationOptions) -> Link:
    """The link TP's collectives cross: intra-node when the TP group (consecutive ranks) fits on a node."""
    intra, inter = _links(options)
    return intra if setup.tp <= cluster.gpus_per_node else inter


def tp_seconds(stages: list[StageShape], setup: Setup, cluster: Cluster, options: SimulationOptions) -> tuple[float, float]:
    """Seconds of TP's collectives in one microbatch's forward and backward on a rank holding
    `stages` (module docstring): `tp_traffic_bytes` of one microbatch, the forward's half of
    those without recomputation and the backward the rest, each ring collective moving
    (tp - 1) / tp of its tensor over `tp_link`; 0 without TP."""
    if setup.tp < 2:
        return 0.0, 0.0
    ring = replace(setup, sequence_parallel=True, tokens=setup.tokens * setup.gathered // setup.tp)
    total = sum(tp_traffic_bytes(stages, ring, 1).values())
    forward = sum(tp_traffic_bytes(stages, replace(ring, activation_checkpoint="none"), 1).values()) / 2
    seconds = (setup.tp - 1) / setup.tp / tp_link(setup, cluster, options).bandwidth
    return forward * seconds, (total - forward) * seconds


def rank_costs(run: RunConfig, layout: Layout, model: torch.nn.Module, shapes: list[StageShape], setup: Setup,
               cluster: Cluster, options: SimulationOptions) -> Costs:
    """The simulation's costs of every pipeline rank of `layout` (module docstring)."""
    p = run.parallelism
    split = setup.tp * p.context_parallel_degree
    tokens = microbatch_sequences(run, layout) * run.training.seq_len
    stages = _stage_costs(run, layout, model, setup)
    exchange_seconds = muon_exchange_seconds(run, layout, stages, setup, cluster, options)
    muon = run.optimizer.name == "muon"
    passes = ELEMENTWISE_PASSES + 2 * setup.error_feedback
    intra, inter = _links(options)
    ep_link = intra if setup.ep <= cluster.gpus_per_node else inter
    recomputed = setup.activation_checkpoint == "full"
    forward, backward, optimizer = [], [], []
    for rank, indices in enumerate(layout.rank_stages):
        mine = [shapes[i] for i in indices]
        flops = sum(stages[i].training_flops for i in indices)
        if setup.num_experts:
            flops += 6 * tokens * sum(s.expert_params for s in mine) * setup.top_k / setup.num_experts
        recompute = recomputed_flops(flops, sum(s.layers for s in mine), setup, tokens) / (split * options.flops_per_s)
        flops /= split * options.flops_per_s
        exchange = all_to_all_bytes(mine, setup, microbatches=1) / ep_link.bandwidth / (4 + 2 * recomputed)
        tp_forward, tp_backward = tp_seconds(mine, setup, cluster, options)
        forward.append(flops / 3 + 2 * exchange + tp_forward)
        backward.append(2 * flops / 3 + recompute + (2 + 2 * recomputed) * exchange + tp_backward)
        if not muon:
            newton_schulz = 0
        elif setup.num_experts:
            newton_schulz = expert_newton_schulz(mine, setup)["busiest_owner_flops"]
        else:
            newton_schulz = sum(stages[i].newton_schulz_flops for i in indices)
        local = sum(s.params for s in mine) / (setup.weight_shards * setup.tp)
        optimizer.append(newton_schulz / options.flops_per_s + passes * local * setup.param_bytes / HBM_BYTES_PER_S
                         + exchange_seconds[rank])
    gpus = layout.gpus_per_pp_rank(cluster.world_size)
    return Costs(
        tuple(forward), tuple(backward), tuple(optimizer),
        split_cost=SPLIT_COST[run.compile.enable and "model" in run.compile.components],
        message_bytes=setup.tokens * setup.dim * setup.compute_bytes,
        intra_node=intra, inter_node=inter,
        node_of_rank=tuple(rank * gpus // cluster.gpus_per_node for rank in range(layout.pp)),
    )


def traced_costs(directory: Path, layout: Layout) -> Costs:
    """The costs a run directory's pipeline trace measured (its `config.toml` and `launch.json`
    say how many microbatches a step had); UserError in one line without a trace or when its
    pipeline degree is not the plan's."""
    trace = directory / "pipeline" / "trace.json"
    if not trace.is_file():
        raise UserError(f"--costs-from {directory}: no pipeline/trace.json there (train with --set metrics.pipeline_trace=true)")
    traced = load_run_config(directory / "config.toml")
    p = traced.parallelism
    if p.pipeline_parallel_degree != layout.pp:
        raise UserError(f"--costs-from {directory}: the run has parallelism.pipeline_parallel_degree = "
                        f"{p.pipeline_parallel_degree}, the plan {layout.pp}; simulate a trace of the same degree")
    world = json.loads((directory / "launch.json").read_text())["world_size"]
    flushes = accumulation_steps(traced.training, traced.data_parallel_degree(world))
    events = json.loads(trace.read_text())["traceEvents"]
    return costs_from_trace(events, microbatches(traced.training, p) * flushes,
                            not streaming_schedule(p.pipeline_parallel_schedule), flushes)


def fsdp_units(shape: StageShape) -> int:
    """FSDP units of a stage: its blocks, the embedding, norm + output head."""
    return shape.layers + ("tok_embeddings" in shape.modules) + shape.last


def rank_collectives(name: str, layout: Layout, shapes: list[StageShape], setup: Setup, cluster: Cluster,
                     options: SimulationOptions, accumulation: int | None) -> tuple[Collectives, ...]:
    """Each pipeline rank's FSDP and replica collectives per gradient reduction under schedule
    `name`: ring collectives of `fsdp_traffic_bytes`' bytes over the link their group spans."""
    intra, inter = _links(options)
    gpus = layout.gpus_per_pp_rank(cluster.world_size)
    fsdp_link = intra if setup.weight_shards * setup.tp <= cluster.gpus_per_node else inter
    replica_link = intra if gpus <= cluster.gpus_per_node else inter
    f, r = setup.fsdp_degree, setup.replicas
    reductions = reductions_per_step(name, layout.microbatches, layout.accumulation_steps, accumulation)
    ranks = []
    for indices in layout.rank_stages:
        moved = fsdp_traffic_bytes(name, [shapes[i] for i in indices], setup, layout.microbatches,
                                   layout.accumulation_steps, accumulation)
        ranks.append(Collectives(
            gather=moved["all_gather"] * (f - 1) / f / fsdp_link.bandwidth / reductions,
            reduce=(moved["reduce_scatter"] * (f - 1) / f / fsdp_link.bandwidth
                    + moved["all_reduce"] * 2 * (r - 1) / r / replica_link.bandwidth) / reductions,
            units=sum(fsdp_units(shapes[i]) for i in indices),
        ))
    return tuple(ranks)


def data_parallel_name(setup: Setup) -> str:
    """The row name of a layout without a pipeline: FSDP, HSDP (FSDP groups replicated), DDP
    (replicas of whole weights), TP alone or one GPU."""
    sharded = setup.fsdp and setup.fsdp_degree > 1
    if setup.replicas > 1:
        return "HSDP" if sharded else "DDP"
    return "FSDP" if sharded else "TP" if setup.tp > 1 else "one GPU"


def data_parallel_collectives(layout: Layout, shapes: list[StageShape], setup: Setup, cluster: Cluster,
                              options: SimulationOptions) -> Collectives:
    """A rank's collectives per microbatch without a pipeline (`data_parallel_traffic_bytes` of
    one microbatch) as ring collectives over the link each group spans, as `rank_collectives`
    costs them: the forward's gather before it; the backward's gather, reduce-scatter and
    replica all-reduce after it, on one stream."""
    intra, inter = _links(options)
    fsdp_link = intra if setup.weight_shards * setup.tp <= cluster.gpus_per_node else inter
    replica_link = intra if cluster.world_size <= cluster.gpus_per_node else inter
    f, r = setup.fsdp_degree, setup.replicas
    moved = data_parallel_traffic_bytes(shapes, setup, 1)
    gather = moved["all_gather"] / 2 * (f - 1) / f / fsdp_link.bandwidth
    return Collectives(
        gather=gather,
        reduce=gather + moved["reduce_scatter"] * (f - 1) / f / fsdp_link.bandwidth
        + moved["all_reduce"] * 2 * (r - 1) / r / replica_link.bandwidth,
        units=sum(fsdp_units(shape) for shape in shapes),
    )


def simulate_data_parallel(run: RunConfig, layout: Layout, model: torch.nn.Module, shapes: list[StageShape], setup: Setup,
                           cluster: Cluster, options: SimulationOptions, tokens_per_step: int,
                           memory: dict[str, dict[str, Any] | str] | None = None) -> dict[str, Any]:
    """The "simulation" part of a plan without a pipeline (module docstring): one row, named by
    `data_parallel_name`, the K microbatches of a step as K flushes of one forward and backward
    on one rank (`pipeline.simulation.simulate_synchronous`), each gathering before its forward
    and reducing after its backward (`data_parallel_collectives`)."""
    name = data_parallel_name(setup)
    collectives = data_parallel_collectives(layout, shapes, setup, cluster, options)
    costs = replace(rank_costs(run, layout, model, shapes, setup, cluster, options), collectives=(collectives,))
    result = simulate_synchronous(name, one_f_one_b(1, 1), costs, flushes=layout.accumulation_steps)
    exchange = muon_exchange_seconds(run, layout, _stage_costs(run, layout, model, setup), setup, cluster, options)
    seconds = {name: (collectives.gather + collectives.reduce) * layout.accumulation_steps}
    assumptions = flop_assumptions(options, costs, seconds, exchange, muon_link(setup, cluster, options))
    assumptions[-2:] = [
        f"{name} without a pipeline: {layout.accumulation_steps} microbatch(es) of {microbatch_sequences(run, layout)} "
        f"sequence(s) per step; FSDP reshards after each forward: a gather before each forward, another in each backward "
        f"with the reduce-scatter and replica all-reduce, {_ms(tuple(seconds.values()))} ms per step, each overlapped unit "
        "by unit with that forward or backward; only what that compute cannot hide delays the step",
    ]
    if memory is not None:
        assumptions.append(memory_assumption(cluster))
    row = {"name": name, "step_seconds": result.step_time, "tokens_per_second": tokens_per_step / result.step_time,
           "bubble": list(result.bubble), "vs_1f1b": 1.0, "vs_best_synchronous": 1.0, "collective_seconds": seconds[name],
           "streaming": False, "selected": True, **_memory_of(memory, name)}
    return {"schedules": [row], "skipped": {}, "costs": asdict(costs), "assumptions": assumptions}


def simulate_plan(run: RunConfig, layout: Layout, model: torch.nn.Module, shapes: list[StageShape], setup: Setup,
                  cluster: Cluster, options: SimulationOptions, tokens_per_step: int,
                  memory: dict[str, dict[str, Any] | str] | None = None) -> dict[str, Any]:
    """The "simulation" part of a plan: every schedule's step time, tokens/s, per-rank bubble and
    ratios, the schedules torch could not build, and the assumptions in words. With `memory`
    (`schedule_memory.schedule_memory`), each schedule's row carries its busiest rank's memory
    under "memory" (None, and why under "memory_note", where it could not be estimated)."""
    if layout.pp < 2 and layout.emulated:
        raise UserError(f"{run.source}: --simulate needs parallelism.pipeline_parallel_degree >= 2 or no emulated stages")
    if layout.pp < 2:
        if options.costs_from:
            raise UserError(f"--costs-from {options.costs_from}: traced costs are those of pipeline ranks; "
                            "without a pipeline (parallelism.pipeline_parallel_degree = 1) simulate from FLOPs")
        if setup.num_experts:
            raise UserError(f"{run.source}: --simulate without a pipeline (parallelism.pipeline_parallel_degree = 1) "
                            "covers dense models so far")
        return simulate_data_parallel(run, layout, model, shapes, setup, cluster, options, tokens_per_step, memory)
    accumulation = run.parallelism.paci.accumulation
    if options.costs_from:
        costs = traced_costs(options.costs_from, layout)
        collectives = dict.fromkeys(SCHEDULE_NAMES, None)
    else:
        costs = rank_costs(run, layout, model, shapes, setup, cluster, options)
        collectives = {name: rank_collectives(name, layout, shapes, setup, cluster, options, accumulation) for name in SCHEDULE_NAMES}
    refused = refused_by_train(run, layout)
    rows, skipped = compare(layout.pp, layout.microbatches, costs, flushes=layout.accumulation_steps, accumulation=accumulation,
                            schedules=tuple(name for name in SCHEDULE_NAMES if name not in refused),
                            costs_of=lambda name: replace(costs, collectives=collectives[name]))
    skipped |= refused
    seconds = {name: collective_seconds(ranks, reductions_per_step(name, layout.microbatches, layout.accumulation_steps, accumulation))
               for name, ranks in collectives.items()}
    if options.gantt:
        draw_gantts([(f"{row.result.name}: {row.result.step_time * 1e3:,.1f} ms per step (simulated)",
                      first_steps(row.result.events, row.result.step_time, 3)) for row in rows], options.gantt)
    schedules = [{
        "name": row.result.name,
        "step_seconds": row.result.step_time,
        "tokens_per_second": tokens_per_step / row.result.step_time,
        "bubble": list(row.result.bubble),
        "vs_1f1b": row.vs_1f1b,
        "vs_best_synchronous": row.vs_best_synchronous,
        "collective_seconds": seconds[row.result.name],
        "streaming": row.result.name in STREAMING_SCHEDULES,
        "selected": row.result.name.lower() == layout.schedule.lower(),
        **_memory_of(memory, row.result.name),
    } for row in rows]
    if options.costs_from:
        assumptions = traced_assumptions(options.costs_from, costs)
    else:
        exchange = muon_exchange_seconds(run, layout, _stage_costs(run, layout, model, setup), setup, cluster, options)
        assumptions = flop_assumptions(options, costs, seconds, exchange, muon_link(setup, cluster, options))
    if memory is not None:
        assumptions.append(memory_assumption(cluster))
    if setup.num_experts and not options.costs_from:
        assumptions.append(f"mixture of experts: the experts count {setup.top_k} / {setup.num_experts} of their weights; "
                           "under expert parallelism every token all-to-all waits for its bytes over the EP group's link")
    return {"schedules": schedules, "skipped": skipped, "costs": asdict(costs), "assumptions": assumptions}


def refused_by_train(run: RunConfig, layout: Layout) -> dict[str, str]:
    """Name -> why `train` refuses that schedule at the layout's microbatches per flush: a
    synchronous one by torch's conditions (`split.check_microbatches`: fewer than stages for 1F1B
    and DualPipeV; two stages per rank for the multi-stage schedules, as simulated), PipeDream2BW
    where its delay of several steps does not run with the rest of the config (`check_delay`)."""
    two_bw = replace(run.parallelism, pipeline_parallel_schedule="PipeDream2BW")
    problem = check_delay(run.training, two_bw, layout.fsdp * layout.replicas, layout.microbatches,
                          run.model.family == "qwen3_moe")
    refused = {"PipeDream2BW": f"train refuses it: {problem}"} if problem else {}
    for name in SCHEDULE_NAMES:
        if name not in STREAMING_SCHEDULES:
            try:
                check_microbatches(name, layout.microbatches, schedule_stages(name, layout.pp), layout.pp)
            except ValueError as err:
                refused[name] = f"train refuses it: {err}"
    return refused


def _memory_of(memory: dict[str, dict[str, Any] | str] | None, name: str) -> dict[str, Any]:
    """A simulated schedule's "memory" (and "memory_note" where it has none); nothing without `memory`."""
    if memory is None:
        return {}
    found = memory.get(name, "not estimated")
    return {"memory": found} if isinstance(found, dict) else {"memory": None, "memory_note": found}


def memory_assumption(cluster: Cluster) -> str:
    return (f"memory: each schedule's peak per GPU on its busiest pipeline rank, as plan estimates the config's own "
            f"(the config with only its schedule changed, split into stages as torchtitan splits it for that schedule; "
            f"2BW's other weight versions where it keeps them; chunks in flight from torch's action lists), "
            f"against --gpu-memory {cluster.gpu_memory / 2**30:g} GiB")


def collective_seconds(ranks: tuple[Collectives, ...] | None, reductions: float) -> float:
    """The busiest rank's collective seconds per optimizer step, exposed or hidden (0 for a trace's costs)."""
    return max(((c.gather + c.reduce) * reductions for c in ranks), default=0.0) if ranks else 0.0


def first_steps(events: tuple[dict, ...], step_time: float, steps: int) -> list[dict]:
    """The events that start within the first `steps` step times of the first one."""
    origin = min(e["ts"] for e in events)
    return [e for e in events if e["ts"] < origin + steps * step_time * 1e6]


def traced_assumptions(directory: Path, costs: Costs) -> list[str]:
    return [
        f"costs measured by {directory}/pipeline/trace.json: per microbatch and pipeline rank, forward "
        f"{_ms(costs.forward)} ms, backward {_ms(costs.backward)} ms (medians); optimizer step {_ms(costs.optimizer)} ms; "
        f"host work {_ms(costs.host)} ms per step; a message takes {costs.intra_node.latency * 1e3:.2f} ms",
        "collectives, kernels and host work as that run had them (its layout, microbatch size and machine); a schedule "
        "with another number of stages than the traced run splits each rank's costs evenly over its stages",
        "synchronous schedules: every rank waits for the slowest, then steps; streaming: each stage steps on its own; "
        "steady state (later steps measured)",
    ]


def flop_assumptions(options: SimulationOptions, costs: Costs, collectives: dict[str, float],
                     exchange: tuple[float, ...] = (0.0,), exchange_link: Link | None = None) -> list[str]:
    link = (f"links: intra-node {options.intra_node_gbps:g} GB/s + {INTRA_NODE_LATENCY * 1e6:g} us, inter-node "
            f"{options.inter_node_gbps:g} GB/s + {INTER_NODE_LATENCY * 1e6:g} us; a message is "
            f"{costs.message_bytes / 1e6:.1f} MB (one microbatch's stage-boundary tensor)")
    return [
        f"compute at MFU {options.mfu:g} of {options.peak_tflops:g} TFLOP/s per GPU: 6 x matmul weights x tokens + "
        f"causal attention, forward:backward 1:2 (a split backward: I and W half each of {costs.split_cost:g} x the "
        f"backward, as torch's split measured on {'compiled' if costs.split_cost > 1.5 else 'eager'} blocks), "
        "full recomputation adds a forward, selective every second matmul of each block (wo, w3); TP's activation "
        "collectives (sequence parallelism's all-gathers and reduce-scatters) as ring collectives over the link the TP "
        "group spans, not overlapped",
        f"per microbatch and pipeline rank, forward {_ms(costs.forward)} ms, backward {_ms(costs.backward)} ms; "
        f"optimizer step {_ms(costs.optimizer)} ms (Newton-Schulz FLOPs of the busiest Muon owner at the same MFU + "
        f"element-wise passes at {HBM_BYTES_PER_S / 1e12:g} TB/s"
        + (f" + Muon's gather and scatter, {_ms(exchange)} ms: the busiest owner's received bytes at "
           f"{exchange_link.bandwidth / 1e9:g} GB/s, the link its Muon group spans, not overlapped, alike for every schedule)"
           if exchange_link and max(exchange) > 0 else ")"),
        link,
        f"FSDP and replica collectives: plan's bytes per step as ring collectives, {_ms(tuple(collectives.values()))} ms "
        "per step on the busiest rank, on a stream of their own one FSDP unit at a time: the gather overlaps the first "
        "forward after each gradient reduction, the reduction the backward that completes it; only what that compute "
        "cannot hide delays the rank",
        "synchronous schedules: every rank waits for the slowest, then steps; streaming: each stage steps on its own "
        "(2BW every window, PACI every `accumulation` backwards); interleaved and V-shaped schedules: 2 stages per rank, "
        "half the rank's costs each; steady state (later steps measured); links without contention",
    ]


def _ms(values: tuple[float, ...]) -> str:
    low, high = min(values) * 1e3, max(values) * 1e3
    return f"{low:.1f}" if abs(high - low) < 0.05 else f"{low:.1f}-{high:.1f}"
