"""The plan's estimate: the layout `train` would build on a cluster (degrees, stages, which
pipeline rank holds which), each stage's parameters as the optimizer routes them, and each
pipeline rank's memory per GPU and FSDP traffic per step (arithmetic in `memory`)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.models.common import compute_ffn_hidden_dim

from titan_async.cluster.memory import (
    COMPARED_SCHEDULES,
    MuonMatrix,
    Setup,
    StageShape,
    active_params,
    expert_newton_schulz,
    fsdp_traffic_bytes,
    held_microbatches,
    microbatch_activation_bytes,
    rank_memory,
    stage_input_bytes,
    tp_traffic_bytes,
    window_microbatches,
    windows_per_step,
)
from titan_async.cluster.cluster import Cluster
from titan_async.config.assemble import plain_parameters, resolve_vocab_size
from titan_async.config.run_config import RunConfig
from titan_async.core.errors import UserError
from titan_async.model.meta import MetaModel, build_meta_model
from titan_async.optim.newton_schulz import resolve_dtype
from titan_async.optim.routing import route_parameters
from titan_async.pipeline.load_balance import BIAS
from titan_async.pipeline.config import accumulation_steps, pipeline_delay
from titan_async.pipeline.in_flight import rank_chunks
from titan_async.pipeline.schedules import streaming_schedule
from titan_async.pipeline.split import split_stages


@dataclass(frozen=True)
class Layout:
    """How `run` splits over the cluster: degrees, stages and which pipeline rank holds which."""

    pp: int
    fsdp: int
    """data_parallel_shard_degree, resolved."""
    replicas: int
    """data_parallel_replicate_degree: copies of each FSDP group."""
    schedule: str
    microbatches: int
    """m: microbatches per local batch."""
    accumulation_steps: int
    """K: local batches per optimizer step (torchtitan's gradient accumulation)."""
    stage_modules: list[list[str]]
    rank_stages: list[tuple[int, ...]]
    """Pipeline rank -> indices of the stages it holds."""
    emulated: bool
    fsdp_applied: bool
    """Whether FSDP2 wraps the stages (`plain_parameters` says when it does not)."""
    delay: int
    """d: the steps by which 2BW's gradients (or `training.gradient_delay`'s) are delayed, kept as
    d + 1 weight versions; 0 without versions (`pipeline.config.pipeline_delay`)."""
    streaming: bool

    def gpus_per_pp_rank(self, world_size: int) -> int:
        return world_size // self.pp

    def pipeline_stages(self) -> int:
        return len(self.stage_modules) if self.pp > 1 or self.emulated else 1

    @property
    def window(self) -> int:
        """Microbatches of one flush or window of this config's schedule (`memory.window_microbatches`)."""
        return window_microbatches(self.schedule, self.microbatches, self.accumulation_steps)

    @property
    def windows_per_step(self) -> int:
        """Flushes or windows of this config's schedule per optimizer step (`memory.windows_per_step`)."""
        return windows_per_step(self.schedule, self.accumulation_steps)


def check_world_size(run: RunConfig, cluster: Cluster) -> None:
    """UserError unless the parallel degrees fit `cluster`'s GPU count."""
    mismatch = run.degree_mismatch(cluster.world_size)
    if mismatch:
        named, product = mismatch
        rule = "a multiple of" if run.parallelism.data_parallel_shard_degree == -1 else "equal to"
        raise UserError(
            f"--nodes {cluster.nodes} x --gpus-per-node {cluster.gpus_per_node} = {cluster.world_size} GPUs, but "
            f"{run.source}: {named} = {product} needs a GPU count {rule} {product}"
        )


def make_layout(run: RunConfig, cluster: Cluster, model_config) -> Layout:
    """Stages and their pipeline ranks, as torchtitan's pipeline builder (or the emulation) splits them."""
    p, t = run.parallelism, run.training
    pp = p.pipeline_parallel_degree
    shard = p.data_parallel_shard_degree
    if shard == -1:
        shard = cluster.world_size // (pp * p.tensor_parallel_degree * p.context_parallel_degree * p.data_parallel_replicate_degree)
    if (pp > 1 or p.emulated_stages) and t.local_batch_size % p.pipeline_parallel_microbatch_size:
        raise UserError(
            f"{run.source}: training.local_batch_size ({t.local_batch_size}) is not divisible into microbatches "
            f"of parallelism.pipeline_parallel_microbatch_size ({p.pipeline_parallel_microbatch_size})"
        )
    try:
        modules, ranks = split_stages(p, model_config, run.microbatches())
    except ValueError as err:
        raise UserError(f"{run.source}: {err}") from None
    streaming = streaming_schedule(p.pipeline_parallel_schedule)
    return Layout(
        pp=pp,
        fsdp=shard,
        replicas=p.data_parallel_replicate_degree,
        schedule=p.pipeline_parallel_schedule,
        microbatches=run.microbatches(),
        accumulation_steps=accumulation_steps(t, run.data_parallel_degree(cluster.world_size)),
        stage_modules=modules,
        rank_stages=ranks,
        emulated=bool(p.emulated_stages) and pp == 1,
        fsdp_applied=not plain_parameters(run, cluster.world_size),
        delay=pipeline_delay(t, p, run.data_parallel_degree(cluster.world_size), run.microbatches()),
        streaming=streaming is not None,
    )


def _owner(name: str) -> str:
    """The top-level module a parameter belongs to, as the stage FQN lists name it."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" else parts[0]


def stage_shapes(model: torch.nn.Module, modules: list[list[str]], tp: int = 1) -> list[StageShape]:
    """Parameter counts of each stage, routed to Muon or AdamW as the optimizer would; under
    TP (`tp`) every matrix is split and the norm weights (1-D) are whole on each TP rank, as
    torchtitan's llama3 plan places them. MoE experts (3-D) and expert biases are counted apart."""
    counts: Counter[str] = Counter()
    replicated: Counter[str] = Counter()
    matrices: Counter[str] = Counter()
    experts: Counter[str] = Counter()
    biases = Counter({_owner(name): tensor.numel() for name, tensor in model.named_buffers() if name.endswith(BIAS)})
    muon: dict[str, list[MuonMatrix]] = {}
    for route in route_parameters(model):
        owner = _owner(route.name)
        counts[owner] += route.param.numel()
        if route.param.ndim < 2:
            replicated[owner] += route.param.numel()
        if route.param.ndim == 3:
            experts[owner] += route.param.numel()
        if route.optimizer == "muon":
            matrices[owner] += route.param.numel()
            shape = tuple(route.param.shape)
            muon.setdefault(owner, []).append(MuonMatrix(shape, tuple(route.blocks.shapes(shape))))
    shapes = []
    for index, names in enumerate(modules):
        on_rank = {n: (counts[n] - replicated[n]) / tp + replicated[n] for n in names}
        units = [on_rank[n] for n in names if n not in ("norm", "lm_head")]
        units.append(sum(on_rank[n] for n in names if n in ("norm", "lm_head")))
        shapes.append(
            StageShape(
                index=index,
                modules=tuple(names),
                params=sum(counts[n] for n in names),
                matrix_params=sum(matrices[n] for n in names),
                layers=sum(n.startswith("layers.") for n in names),
                largest_unit=max(units),
                last="lm_head" in names,
                muon_matrices=tuple(m for n in names for m in muon.get(n, [])),
                replicated=sum(replicated[n] for n in names),
                expert_params=sum(experts[n] for n in names),
                expert_biases=sum(biases[n] for n in names),
            )
        )
    return shapes


def make_setup(run: RunConfig, layout: Layout, vocab: int, gpu: bool = True) -> Setup:
    """The per-rank memory parameters of `run` (dtypes, sharding, tokens per microbatch) on GPUs,
    or with `gpu` False on CPU processes."""
    s, p, t = run.model.resolved(vocab), run.parallelism, run.training
    muon = run.optimizer.muon
    dim, heads = int(s["dim"]), int(s["n_heads"])
    tp = p.tensor_parallel_degree
    sequence_parallel = p.enable_sequence_parallel and tp > 1
    split = p.context_parallel_degree * (tp if sequence_parallel else 1)
    sequences = p.pipeline_parallel_microbatch_size if layout.pp > 1 or layout.emulated else t.local_batch_size
    compute = t.mixed_precision_param if layout.fsdp_applied else t.dtype
    moe = run.model.family == "qwen3_moe"
    return Setup(
        dim=dim,
        kv_dim=int(s["n_kv_heads"]) * (dim // heads),
        ffn_dim=0 if moe else compute_ffn_hidden_dim(dim, multiple_of=int(s["multiple_of"]),
                                                     ffn_dim_multiplier=s["ffn_dim_multiplier"] or None),
        vocab_size=vocab,
        tokens=sequences * t.seq_len // split,
        param_bytes=TORCH_DTYPE_MAP[t.dtype].itemsize,
        compute_bytes=TORCH_DTYPE_MAP[compute].itemsize,
        reduce_bytes=TORCH_DTYPE_MAP[t.mixed_precision_reduce].itemsize,
        weight_shards=layout.fsdp * p.context_parallel_degree if layout.fsdp_applied else 1,
        fsdp=layout.fsdp_applied,
        fsdp_degree=layout.fsdp,
        unsharded_for_step=layout.pp > 1,
        version_copies=2 if t.weight_prediction else layout.delay,
        copies_on_last_stage=not (t.weight_prediction and not layout.delay),
        gathered_versions=layout.delay if layout.fsdp_applied and layout.pp > 1 else 0,
        optimizer=run.optimizer.name,
        error_feedback=run.optimizer.error_feedback.enabled,
        activation_checkpoint=run.activation_checkpoint.mode,
        nesterov=muon.nesterov,
        ns_steps=muon.ns_steps,
        ns_dtype=str(resolve_dtype(muon.ns_dtype, torch.device("cuda" if gpu else "cpu"))).removeprefix("torch."),
        muon_group=layout.fsdp * p.context_parallel_degree * tp if layout.fsdp_applied else tp,
        tp=tp,
        sequence_parallel=sequence_parallel,
        gpu=gpu,
        replicas=layout.replicas,
        weight_prediction=t.weight_prediction > 0,
        **({key: int(s[key]) for key in ("num_experts", "top_k", "moe_hidden_dim")} if moe else {}),
        **({"ep": p.expert_parallel_degree} if moe else {}),
        **({"expert_bytes": TORCH_DTYPE_MAP[compute].itemsize} if moe and run.model.expert_precision == "full" else {}),
    )


def _held(layout: Layout, rank: int, shapes: list[StageShape], setup: Setup) -> list[float]:
    """Microbatches held in flight on each stage of pipeline rank `rank`: under torch's
    schedules each stage's chunks at the point of the rank's action list where the bytes they
    keep (`microbatch_activation_bytes` + `stage_input_bytes`) peak (`pipeline.in_flight`);
    under the streaming ones `held_microbatches` (one stage per rank)."""
    stages = layout.rank_stages[rank]
    if layout.emulated:
        return [min(layout.window, len(stages) - s) for s in stages]
    if layout.pp == 1:
        return [1.0]
    if layout.streaming:
        total = held_microbatches(layout.schedule, rank, layout.pp, layout.window, len(stages))
        return [total / len(stages)] * len(stages)
    weights = {i: microbatch_activation_bytes(shapes[i], setup) + stage_input_bytes(shapes[i], 1, setup) for i in stages}
    chunks = rank_chunks(layout.schedule, rank, layout.pp, layout.window, len(stages), weights)
    return [float(chunks[i]) for i in stages]


def estimate_ranks(layout: Layout, shapes: list[StageShape], setup: Setup, cluster: Cluster) -> list[dict[str, Any]]:
    """One row per pipeline rank: its GPUs, stages, held microbatches and memory per GPU."""
    per_rank = layout.gpus_per_pp_rank(cluster.world_size)
    rows = []
    for rank, indices in enumerate(layout.rank_stages):
        stages = [shapes[i] for i in indices]
        held = _held(layout, rank, shapes, setup)
        memory = rank_memory(stages, held, setup, layout.schedule, rank, layout.pp, layout.emulated)
        memory = {key: round(value) for key, value in memory.items()}
        rows.append({
            "pp_rank": rank,
            "gpus": [rank * per_rank, (rank + 1) * per_rank - 1],
            "stages": [{"index": s.index, "modules": list(s.modules), "parameters": s.params} for s in stages],
            "parameters": sum(s.params for s in stages),
            "held_microbatches": sum(held),
            "memory": memory,
            "fits": memory["total"] <= cluster.gpu_memory,
        })
    return rows


@dataclass(frozen=True)
class Estimate:
    """`run`'s meta model, layout, memory parameters, stage shapes and per-pipeline-rank rows
    (`estimate_ranks`) on a cluster: what `plan` reports and `fits` checks a launch against."""

    vocab: int
    model: MetaModel
    layout: Layout
    setup: Setup
    shapes: list[StageShape]
    rows: list[dict[str, Any]]

    @property
    def peak_bytes(self) -> int:
        return max(row["memory"]["total"] for row in self.rows)


def estimate(run: RunConfig, cluster: Cluster, gpu: bool = True) -> Estimate:
    """The estimate of `run` on `cluster` (on GPUs, or with `gpu` False on CPU processes),
    from the config and a meta-device model only: nothing is allocated."""
    vocab = resolve_vocab_size(run)
    model = build_meta_model(run, vocab, fsdp=not plain_parameters(run, cluster.world_size))
    return estimate_model(run, cluster, vocab, model, gpu)


def estimate_model(run: RunConfig, cluster: Cluster, vocab: int, model: MetaModel, gpu: bool = True) -> Estimate:
    """`estimate` of `run` with its meta model already built (`model`, for vocabulary `vocab`):
    the layout, stages and memory as `run`'s parallelism section splits them."""
    layout = make_layout(run, cluster, model.spec.model)
    setup = make_setup(run, layout, vocab, gpu)
    shapes = stage_shapes(model.module, layout.stage_modules, run.parallelism.tensor_parallel_degree)
    return Estimate(vocab, model, layout, setup, shapes, estimate_ranks(layout, shapes, setup, cluster))


def communication(layout: Layout, shapes: list[StageShape], setup: Setup, accumulation: int | None) -> list[dict[str, Any]]:
    """FSDP, replica and TP bytes per steady-state step of every pipeline rank, for each schedule
    `plan` compares (`fsdp_traffic_bytes`, with this config's accumulation steps and PACI
    `accumulation`, and `tp_traffic_bytes`, the same for every schedule; each rank keeps this
    config's stages): "ranks" the FSDP and replica bytes, "tensor_parallel" the TP bytes, "busiest"
    both of the rank moving the most (TP keys prefixed `tp_`). Empty without a pipeline or
    without data-parallel or TP collectives."""
    data_parallel = setup.fsdp and (setup.fsdp_degree > 1 or setup.replicas > 1)
    if layout.pp < 2 or not (data_parallel or setup.tp > 1):
        return []
    tensor_parallel = [tp_traffic_bytes([shapes[i] for i in indices], setup, layout.window * layout.windows_per_step)
                       for indices in layout.rank_stages]
    rows = []
    for name in COMPARED_SCHEDULES:
        ranks = [fsdp_traffic_bytes(name, [shapes[i] for i in indices], setup, layout.microbatches,
                                    layout.accumulation_steps, accumulation)
                 for indices in layout.rank_stages]
        moved = [{**fsdp, **{f"tp_{key}": value for key, value in tp.items()}} for fsdp, tp in zip(ranks, tensor_parallel)]
        rows.append({"name": name, "ranks": ranks, "tensor_parallel": tensor_parallel,
                     "busiest": max(moved, key=lambda r: sum(r.values())), "selected": name.lower() == layout.schedule.lower()})
    return rows


ALL_TO_ALL_NOTE = (
    "all-to-all: 0 bytes per step: with parallelism.expert_parallel_degree = 1 each rank gathers its FSDP shards "
    "of every expert and routes its own tokens locally"
)


def all_to_all_bytes(stages: list[StageShape], setup: Setup, microbatches: int) -> int:
    """Bytes one rank sends (and, in expectation, receives) by expert parallelism's token
    all-to-alls per optimizer step: per MoE block and microbatch, the dispatch and the combine
    in the forward and both again (reversed) in the backward, and once more in a full
    recomputation; each carries the top_k routed copies of the rank's tokens (dim values in
    the compute dtype), of which (ep - 1) / ep go to other ranks under balanced routing (what
    load balancing aims at). The per-expert token counts exchanged before each dispatch
    (num_experts integers) are left out."""
    if setup.ep <= 1:
        return 0
    passes = 4 + (2 if setup.activation_checkpoint == "full" else 0)
    blocks = sum(s.layers for s in stages)
    routed = setup.tokens * setup.top_k * setup.dim * setup.compute_bytes
    return round(blocks * microbatches * passes * routed * (setup.ep - 1) / setup.ep)


def _all_to_all_note(setup: Setup, busiest: int) -> str:
    if setup.ep <= 1:
        return ALL_TO_ALL_NOTE
    return (
        f"all-to-all: {busiest / 1e9:.3f} GB per step sent by the busiest rank (as much received), "
        f"parallelism.expert_parallel_degree = {setup.ep}: per MoE block and microbatch, the token dispatch and "
        "combine in the forward and again in the backward (and in a full recomputation), each the top_k routed "
        f"copies of the rank's tokens, (ep - 1) / ep of them to other ranks under balanced routing; "
        "FSDP gathers and reduces only a rank's own experts, over its expert group"
    )


def mixture_of_experts(layout: Layout, shapes: list[StageShape], setup: Setup) -> dict[str, Any] | None:
    """The MoE part of a plan (None for a dense model): per pipeline rank its parameters, active
    parameters (`active_params`), expert parameters and, under Muon, its Newton-Schulz work on
    expert matrices (`expert_newton_schulz`) and the bytes it sends by all-to-all per step
    (`all_to_all_bytes`, 0 without expert parallelism); the busiest rank's all-to-all bytes.
    Expert weight bytes per GPU are the memory breakdown's "expert_weights"."""
    if not setup.num_experts:
        return None
    ranks = []
    for rank, indices in enumerate(layout.rank_stages):
        stages = [shapes[i] for i in indices]
        ranks.append({
            "pp_rank": rank,
            "parameters": sum(s.params for s in stages),
            "active_parameters": round(sum(active_params(s, setup) for s in stages)),
            "expert_parameters": sum(s.expert_params for s in stages),
            "all_to_all_bytes": all_to_all_bytes(stages, setup, layout.window * layout.windows_per_step),
            **({"newton_schulz": expert_newton_schulz(stages, setup)} if setup.optimizer == "muon" else {}),
        })
    busiest = max(r["all_to_all_bytes"] for r in ranks)
    return {
        "num_experts": setup.num_experts,
        "top_k": setup.top_k,
        "moe_hidden_dim": setup.moe_hidden_dim,
        "expert_parallel": setup.ep,
        "all_to_all_bytes": busiest,
        "note": _all_to_all_note(setup, busiest),
        "ranks": ranks,
    }
