"""`titan-async plan`: will a config's parallel layout fit its GPUs, and how big is its bubble?

Needs no GPU, data or tokenizer. The model is built on the meta device with the config's
vocabulary size and split into pipeline stages as torchtitan's pipeline builder splits it;
each pipeline rank's memory is estimated (`titan_async.plan_memory`). A dry run then sets
up the real world size with torch's fake process group (what torchtitan's
`comm.mode = "fake_backend"` uses), one inspected rank at a time, and builds that rank's
stage, FSDP2 wrapping, optimizer state and weight versions on the meta device, and its
action list; the bytes those meta tensors stand for are compared with the estimate.

The layout is the one `train` would build (`titan_async.config.assemble`): FSDP2 wraps
every stage except the streaming schedules' stages without data parallelism. Whatever
`train` would refuse about the config is reported as a warning.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import _clear_sharding_prop_cache
from torchtitan.components.optimizer.utils import init_optim_state
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.pipeline_parallel import (
    _generate_llm_fqn_per_model_part,
    _get_pipeline_metadata,
    _get_pp_rank_to_stage_indices_mapping,
)
from torchtitan.distributed.utils import init_fake_mode, set_spmd_backend
from torchtitan.models.common import compute_ffn_hidden_dim
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.tools.utils import device_type, set_default_dtype

from titan_async.config.assemble import ACTIVATION_CHECKPOINTS, plain_parameters, tokenizer_vocab_size
from titan_async.config.run_config import RunConfig
from titan_async.errors import UserError
from titan_async.model import build_model_spec
from titan_async.optim.error_feedback import PREVIOUS_UPDATE, STEPS
from titan_async.optim.routing import route_parameters
from titan_async.pipeline.emulation import stage_modules
from titan_async.pipeline.schedules import (
    SCHEDULE_NAMES,
    SchedulePipeDream2BW,
    register as register_schedules,
    streaming_schedule,
)
from titan_async.pipeline.fsdp_stage import FsdpStage
from titan_async.pipeline.versions import two_versions
from titan_async.plan_memory import (
    COMPARED_SCHEDULES,
    STATE_COMPONENTS,
    Setup,
    StageShape,
    compare_schedules,
    fsdp_traffic_bytes,
    gib,
    held_microbatches,
    parse_size,
    rank_memory,
    transport_bytes,
)

ESTIMATE_ONLY_NOTE = (
    "activations, FSDP unsharded buffers and P2P buffers are estimates only: meta tensors hold no activations, "
    "FSDP allocates unsharded buffers only while it gathers, and the pipeline transport only while it sends and receives"
)
TIGHT = 0.9
"""A rank above this share of --gpu-memory fits, but is reported as tight."""


@dataclass(frozen=True)
class Cluster:
    """The GPUs a plan is made for."""

    nodes: int
    gpus_per_node: int
    gpu_memory: int

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @classmethod
    def parse(cls, nodes: int, gpus_per_node: int, gpu_memory: str) -> Cluster:
        """UserError naming the argument for counts below 1 or an unreadable memory size."""
        for flag, value in (("--nodes", nodes), ("--gpus-per-node", gpus_per_node)):
            if value < 1:
                raise UserError(f"{flag} {value}: must be at least 1")
        try:
            memory = parse_size(gpu_memory)
        except ValueError as err:
            raise UserError(f"--gpu-memory {gpu_memory!r}: {err}") from None
        return cls(nodes, gpus_per_node, memory)


@dataclass(frozen=True)
class Layout:
    """How `run` splits over the cluster: degrees, stages and which pipeline rank holds which."""

    pp: int
    fsdp: int
    """data_parallel_shard_degree, resolved."""
    schedule: str
    microbatches: int
    stage_modules: list[list[str]]
    rank_stages: list[tuple[int, ...]]
    """Pipeline rank -> indices of the stages it holds."""
    emulated: bool
    fsdp_applied: bool
    """Whether FSDP2 wraps the stages (`plain_parameters` says when it does not)."""
    two_versions: bool
    streaming: bool

    def gpus_per_pp_rank(self, world_size: int) -> int:
        return world_size // self.pp

    def pipeline_stages(self) -> int:
        return len(self.stage_modules) if self.pp > 1 or self.emulated else 1


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


def resolve_vocab_size(run: RunConfig) -> int:
    """model.vocab_size, or for 0 the tokenizer's: data.tokenizer's tokenizer.json, else the
    built-in stdlib BPE's data.vocab_size (nothing is downloaded or built)."""
    try:
        vocab = int(run.model.resolved(0)["vocab_size"])
    except ValueError as err:
        raise UserError(f"{run.source}: {err}") from None
    if vocab:
        return vocab
    if not run.data.tokenizer:
        return run.data.vocab_size
    directory = Path(run.data.tokenizer).expanduser()
    if not (directory / "tokenizer.json").is_file():
        raise UserError(
            f"{run.source}: model.vocab_size = 0 takes the tokenizer's size, but data.tokenizer = "
            f"{run.data.tokenizer!r} has no tokenizer.json; set model.vocab_size"
        )
    return tokenizer_vocab_size(directory)


@dataclass(frozen=True)
class MetaModel:
    """The model spec training would use and the whole model built from it on the meta device.

    `module` is never parallelized: torchtitan's pipeline split deep-copies the modules of
    each stage, and a dry run without pipeline parallelism works on a copy."""

    spec: ModelSpec
    module: torch.nn.Module


def build_meta_model(run: RunConfig, vocab: int, fsdp: bool) -> MetaModel:
    """`run`'s model on meta, its config updated for the parallelism as the trainer does."""
    try:
        spec = build_model_spec(run.model, vocab, fsdp=fsdp)
        spec.model.update_from_config(config=SimpleNamespace(parallelism=run.parallelism))
    except (ValueError, NotImplementedError) as err:
        raise UserError(f"{run.source}: {err}") from None
    with torch.device("meta"), set_default_dtype(TORCH_DTYPE_MAP[run.training.dtype]):
        return MetaModel(spec, spec.model.build())


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
    layers = len(model_config.layers)
    try:
        if pp > 1:
            # Of the parallel dims, torchtitan's metadata reads only the PP degree.
            stages, _, first, last = _get_pipeline_metadata(SimpleNamespace(pp=pp), p, model_config)
            modules = p.module_fqns_per_model_part or _generate_llm_fqn_per_model_part(stages, layers, first, last)
            ranks = [_get_pp_rank_to_stage_indices_mapping(r, pp, p.pipeline_parallel_schedule, len(modules)) for r in range(pp)]
        elif p.emulated_stages:
            modules = stage_modules(p, layers)
            ranks = [tuple(range(len(modules)))]
        else:
            modules, ranks = _generate_llm_fqn_per_model_part(1, layers), [(0,)]
    except ValueError as err:
        raise UserError(f"{run.source}: {err}") from None
    streaming = streaming_schedule(p.pipeline_parallel_schedule)
    return Layout(
        pp=pp,
        fsdp=shard,
        schedule=p.pipeline_parallel_schedule,
        microbatches=run.microbatches(),
        stage_modules=modules,
        rank_stages=ranks,
        emulated=bool(p.emulated_stages) and pp == 1,
        fsdp_applied=not plain_parameters(run, cluster.world_size),
        two_versions=streaming is SchedulePipeDream2BW or bool(t.gradient_delay),
        streaming=streaming is not None,
    )


def _owner(name: str) -> str:
    """The top-level module a parameter belongs to, as the stage FQN lists name it."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" else parts[0]


def stage_shapes(model: torch.nn.Module, modules: list[list[str]]) -> list[StageShape]:
    """Parameter counts of each stage, routed to Muon or AdamW as the optimizer would."""
    counts: Counter[str] = Counter()
    matrices: Counter[str] = Counter()
    for route in route_parameters(model):
        owner = _owner(route.name)
        counts[owner] += route.param.numel()
        if route.optimizer == "muon":
            matrices[owner] += route.param.numel()
    shapes = []
    for index, names in enumerate(modules):
        units = [counts[n] for n in names if n not in ("norm", "lm_head")]
        units.append(sum(counts[n] for n in names if n in ("norm", "lm_head")))
        shapes.append(
            StageShape(
                index=index,
                modules=tuple(names),
                params=sum(counts[n] for n in names),
                matrix_params=sum(matrices[n] for n in names),
                layers=sum(n.startswith("layers.") for n in names),
                largest_unit=max(units),
                last="lm_head" in names,
            )
        )
    return shapes


def make_setup(run: RunConfig, layout: Layout, vocab: int) -> Setup:
    """The per-rank memory parameters of `run` (dtypes, sharding, tokens per microbatch)."""
    s, p, t = run.model.resolved(vocab), run.parallelism, run.training
    dim, heads = int(s["dim"]), int(s["n_heads"])
    split = p.context_parallel_degree * p.tensor_parallel_degree
    sequences = p.pipeline_parallel_microbatch_size if layout.pp > 1 or layout.emulated else t.local_batch_size
    compute = t.mixed_precision_param if layout.fsdp_applied else t.dtype
    return Setup(
        dim=dim,
        kv_dim=int(s["n_kv_heads"]) * (dim // heads),
        ffn_dim=compute_ffn_hidden_dim(dim, multiple_of=int(s["multiple_of"]), ffn_dim_multiplier=s["ffn_dim_multiplier"] or None),
        vocab_size=vocab,
        tokens=sequences * t.seq_len // split,
        param_bytes=TORCH_DTYPE_MAP[t.dtype].itemsize,
        compute_bytes=TORCH_DTYPE_MAP[compute].itemsize,
        reduce_bytes=TORCH_DTYPE_MAP[t.mixed_precision_reduce].itemsize,
        weight_shards=layout.fsdp * split if layout.fsdp_applied else 1,
        fsdp=layout.fsdp_applied,
        fsdp_degree=layout.fsdp,
        unsharded_for_step=layout.pp > 1,
        version_copies=int(layout.two_versions),
        gathered_versions=int(layout.two_versions and layout.fsdp_applied and layout.pp > 1),
        optimizer=run.optimizer.name,
        error_feedback=run.optimizer.error_feedback.enabled,
        activation_checkpoint=run.activation_checkpoint.mode,
    )


def _held(layout: Layout, rank: int) -> list[float]:
    """Microbatches held in flight on each stage of pipeline rank `rank`."""
    stages = layout.rank_stages[rank]
    if layout.emulated:
        return [min(layout.microbatches, len(stages) - s) for s in stages]
    if layout.pp == 1:
        return [1.0]
    total = held_microbatches(layout.schedule, rank, layout.pp, layout.microbatches, len(stages))
    return [total / len(stages)] * len(stages)


def estimate_ranks(layout: Layout, shapes: list[StageShape], setup: Setup, cluster: Cluster) -> list[dict[str, Any]]:
    """One row per pipeline rank: its GPUs, stages, held microbatches and memory per GPU."""
    per_rank = layout.gpus_per_pp_rank(cluster.world_size)
    rows = []
    for rank, indices in enumerate(layout.rank_stages):
        stages = [shapes[i] for i in indices]
        held = _held(layout, rank)
        transport = 0.0 if layout.emulated else transport_bytes(layout.schedule, rank, layout.pp, setup)
        memory = {key: round(value) for key, value in rank_memory(stages, held, setup, transport).items()}
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


def communication(layout: Layout, shapes: list[StageShape], setup: Setup, accumulation: int | None) -> list[dict[str, Any]]:
    """FSDP bytes per steady-state step of every pipeline rank, for each schedule `plan` compares
    (`fsdp_traffic_bytes`; each rank keeps this config's stages); empty without a pipeline or
    without FSDP collectives."""
    if layout.pp < 2 or not setup.fsdp or setup.fsdp_degree < 2:
        return []
    rows = []
    for name in COMPARED_SCHEDULES:
        ranks = [fsdp_traffic_bytes(name, [shapes[i] for i in indices], setup, layout.microbatches, accumulation)
                 for indices in layout.rank_stages]
        busiest = max(ranks, key=lambda r: r["all_gather"] + r["reduce_scatter"])
        rows.append({"name": name, "ranks": ranks, "busiest": busiest, "selected": name.lower() == layout.schedule.lower()})
    return rows


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def _no_loss(*args, **kwargs):
    raise RuntimeError("the plan's dry run computes nothing")


def _build_rank(run: RunConfig, model: MetaModel, world: int) -> tuple[list[torch.nn.Module], Any, int]:
    """This (fake) rank's model parts, pipeline schedule (None without PP) and pipeline rank, on meta,
    parallelized and initialized as the trainer does (initializing re-ties tied weights)."""
    spec = model.spec
    parallelism = run.parallelism
    parallel_dims = ParallelDims.from_config(parallelism, world)
    checkpointing = ACTIVATION_CHECKPOINTS[run.activation_checkpoint.mode]
    common = dict(
        parallel_dims=parallel_dims,
        training=run.training,
        parallelism=parallelism,
        compile_config=dataclasses.replace(run.compile, enable=False),
        ac_config=checkpointing() if checkpointing else None,
        dump_folder="",
    )
    if parallel_dims.pp_enabled:
        schedule, parts, _, _ = spec.pipelining_fn(
            model.module, **common, device=torch.device(device_type), model_config=spec.model,
            parallelize_fn=spec.parallelize_fn, loss_fn=_no_loss,
        )
        pp_rank = parallel_dims.get_mesh("pp").get_local_rank()
    else:
        schedule, parts, pp_rank = None, [spec.parallelize_fn(copy.deepcopy(model.module), **common)], 0
    with torch.no_grad():
        for part in parts:
            part.init_weights(buffer_device=None)
    return parts, schedule, pp_rank


def _allocated_state(run: RunConfig, layout: Layout, parts: list[torch.nn.Module]) -> dict[str, int]:
    """Bytes of the state tensors training creates on this rank (`STATE_COMPONENTS`), on meta:
    its (sharded) parameters, the 2BW weight versions, the optimizer state and the sharded gradients."""
    params = [p for part in parts for p in part.parameters()]
    allocated = dict.fromkeys(STATE_COMPONENTS, 0)
    allocated["weights"] = sum(_local_bytes(p) for p in params)
    if layout.two_versions:
        for part in parts:
            versions = two_versions(part, layout.microbatches, FsdpStage.of(part))
            allocated["weight_versions"] += sum(_local_bytes(t) for t in versions.copies())
    # Fused kernels refuse meta tensors; the foreach implementation keeps the same state.
    section = dataclasses.replace(run.optimizer, implementation="foreach")
    optimizers = section.container_config().build(model_parts=parts)
    for optimizer in optimizers.optimizers:
        init_optim_state(optimizer)
        for state in optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    component = "error_feedback" if key in (PREVIOUS_UPDATE, STEPS) else "optimizer"
                    allocated[component] += _local_bytes(value)
    for param in params:
        param.grad = torch.zeros_like(param)
    allocated["gradients"] = sum(_local_bytes(p.grad) for p in params)
    return allocated


def _actions(schedule: Any, pp_rank: int) -> tuple[list[str], dict[str, int]]:
    """The schedule's action list for `pp_rank` (torch's schedule IR; None = idle) and the
    count of each action type. Streaming schedules give two windows and a drain."""
    order = (getattr(schedule, "pipeline_order", None) or {}).get(pp_rank, [])
    names = [str(action) if action is not None else "idle" for action in order]
    counts = Counter(action.computation_type.value if action is not None else "idle" for action in order)
    return names, dict(counts)


def dry_run_rank(run: RunConfig, layout: Layout, model: MetaModel, world: int, rank: int) -> dict[str, Any]:
    """Set up global rank `rank` of `world` with a fake process group and report what it holds."""
    init_fake_mode(world, rank=rank)
    try:
        parts, schedule, pp_rank = _build_rank(run, model, world)
        actions, counts = _actions(schedule, pp_rank)
        return {
            "rank": rank,
            "pp_rank": pp_rank,
            "stages": list(layout.rank_stages[pp_rank]),
            "local_parameters": sum(
                (p.to_local() if isinstance(p, DTensor) else p).numel() for part in parts for p in part.parameters()
            ),
            "fsdp_wrapped": any(isinstance(p, DTensor) for part in parts for p in part.parameters()),
            "allocated": _allocated_state(run, layout, parts),
            "actions": actions,
            "action_counts": counts,
        }
    finally:
        dist.destroy_process_group()
        # DTensor caches sharding decisions by mesh equality across process groups.
        _clear_sharding_prop_cache()


def inspected_ranks(layout: Layout, world: int) -> list[int]:
    """The first GPU of every pipeline rank, and the last GPU."""
    per_rank = layout.gpus_per_pp_rank(world)
    return sorted({r * per_rank for r in range(layout.pp)} | {world - 1})


def dry_run(run: RunConfig, layout: Layout, model: MetaModel, world: int, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`dry_run_rank` for every inspected rank, with its pipeline rank's estimate of the same components."""
    if dist.is_initialized():
        raise RuntimeError("plan's dry run needs a process without a process group")
    set_spmd_backend(run.parallelism.spmd_backend)
    results = []
    for rank in inspected_ranks(layout, world):
        result = dry_run_rank(run, layout, model, world, rank)
        estimate = {key: rows[result["pp_rank"]]["memory"][key] for key in STATE_COMPONENTS}
        result["estimate"] = estimate
        result["ratio"] = sum(result["allocated"].values()) / max(1, sum(estimate.values()))
        results.append(result)
    return results


def make_plan(run: RunConfig, cluster: Cluster) -> dict[str, Any]:
    """Everything `plan` reports, as one JSON-ready object."""
    check_world_size(run, cluster)
    name = run.parallelism.pipeline_parallel_schedule
    if name.lower() not in {known.lower() for known in SCHEDULE_NAMES}:
        raise UserError(
            f"{run.source}: parallelism.pipeline_parallel_schedule = {name!r}: unknown schedule; "
            f"valid names are {', '.join(SCHEDULE_NAMES)}"
        )
    register_schedules()
    warnings = []
    try:
        run.check(cluster.world_size)
    except UserError as err:
        warnings.append(f"titan-async train would stop with: {err}")
    vocab = resolve_vocab_size(run)
    model = build_meta_model(run, vocab, fsdp=not plain_parameters(run, cluster.world_size))
    layout = make_layout(run, cluster, model.spec.model)
    setup = make_setup(run, layout, vocab)
    shapes = stage_shapes(model.module, layout.stage_modules)
    rows = estimate_ranks(layout, shapes, setup, cluster)
    for row in rows:
        if not row["fits"]:
            first, last = row["gpus"]
            warnings.append(
                f"pipeline rank {row['pp_rank']} (GPUs {first}-{last}) needs {gib(row['memory']['total']):.1f} GiB "
                f"per GPU, more than --gpu-memory {gib(cluster.gpu_memory):.1f} GiB: it will not fit"
            )
    sizes = run.model.resolved(vocab)
    parallelism, t = run.parallelism, run.training
    schedules = compare_schedules(layout.pipeline_stages(), layout.microbatches)
    for entry in schedules:
        entry["selected"] = entry["name"].lower() == layout.schedule.lower() and layout.pipeline_stages() > 1
    return {
        "config": run.source,
        "nodes": cluster.nodes,
        "gpus_per_node": cluster.gpus_per_node,
        "world_size": cluster.world_size,
        "gpu_memory_bytes": cluster.gpu_memory,
        "model": {
            "preset": run.model.preset,
            "parameters": sum(p.numel() for p in model.module.parameters()),
            **{k: sizes[k] for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "weight_tying")},
            "ffn_dim": setup.ffn_dim,
        },
        "layout": {
            "pipeline_parallel": layout.pp,
            "pipeline_stages": layout.pipeline_stages(),
            "data_parallel_shard": layout.fsdp,
            "data_parallel_replicate": parallelism.data_parallel_replicate_degree,
            "tensor_parallel": parallelism.tensor_parallel_degree,
            "context_parallel": parallelism.context_parallel_degree,
            "schedule": layout.schedule,
            "microbatches": layout.microbatches,
            "microbatch_tokens": setup.tokens,
            "tokens_per_step": t.local_batch_size * t.seq_len * run.data_parallel_degree(cluster.world_size),
            "fsdp_applied": layout.fsdp_applied,
            "param_dtype": t.dtype,
            "compute_dtype": t.mixed_precision_param if layout.fsdp_applied else t.dtype,
            "reduce_dtype": t.mixed_precision_reduce,
            "activation_checkpoint": run.activation_checkpoint.mode,
            "float8": run.model.float8,
            "optimizer": run.optimizer.name,
            "error_feedback": run.optimizer.error_feedback.enabled,
        },
        "ranks": rows,
        "peak_bytes": max(row["memory"]["total"] for row in rows),
        "fits": all(row["fits"] for row in rows),
        "schedules": schedules,
        "communication": communication(layout, shapes, setup, run.parallelism.paci.accumulation),
        "dry_run": {"ranks": dry_run(run, layout, model, cluster.world_size, rows), "note": ESTIMATE_ONLY_NOTE},
        "warnings": warnings,
    }


_SHORT_NAMES = {"tok_embeddings": "embed", "lm_head": "head"}


def _modules(names: list[str]) -> str:
    """A stage's modules, short: consecutive layers folded (embed, L0-4; L37-39, norm, head)."""
    parts: list[str] = []
    layers: list[int] = []

    def flush() -> None:
        if layers:
            parts.append(f"L{layers[0]}" + (f"-{layers[-1]}" if len(layers) > 1 else ""))
            layers.clear()

    for name in names:
        index = name.removeprefix("layers.")
        if index.isdigit():
            if layers and int(index) != layers[-1] + 1:
                flush()
            layers.append(int(index))
        else:
            flush()
            parts.append(_SHORT_NAMES.get(name, name))
    flush()
    return ", ".join(parts)


def _count(n: int) -> str:
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}{suffix}"
    return str(n)


_HEADERS = {"weights": "weights", "weight_versions": "2BW", "gradients": "grads", "optimizer": "optim",
            "error_feedback": "EF", "fsdp_buffers": "FSDP", "p2p_buffers": "P2P", "activations": "act (held mb)"}


@dataclass
class Table:
    """A titled table of strings; the first `left` columns are text, the rest numbers."""

    title: str
    columns: list[str]
    rows: list[list[str]]
    left: int = 1


def _memory_table(plan: dict[str, Any]) -> Table:
    memory = plan["gpu_memory_bytes"]
    table = Table(
        "Memory per GPU (GiB); all GPUs of a pipeline rank hold the same (their FSDP shards)",
        ["pp (GPUs)", "stage: modules", "params", *_HEADERS.values(), "total", f"of {gib(memory):g} GiB"],
        [],
        left=2,
    )
    for row in plan["ranks"]:
        m = row["memory"]
        share = m["total"] / memory
        verdict = "NO" if share > 1 else "tight" if share > TIGHT else "fits"
        stages = "; ".join(f"{s['index']}: {_modules(s['modules'])}" for s in row["stages"])
        table.rows.append([
            "{} ({}-{})".format(row["pp_rank"], *row["gpus"]), stages, _count(row["parameters"]),
            *(f"{gib(m[key]):.2f}" for key in STATE_COMPONENTS), f"{gib(m['fsdp_buffers']):.2f}", f"{gib(m['p2p_buffers']):.2f}",
            f"{gib(m['activations']):.2f} ({row['held_microbatches']:g})", f"{gib(m['total']):.2f}", f"{share:.0%} {verdict}",
        ])
    return table


def _schedule_table(plan: dict[str, Any]) -> Table:
    layout = plan["layout"]
    return Table(
        f"Schedules (p = {layout['pipeline_stages']} stages, m = {layout['microbatches']} microbatches; "
        "Interleaved1F1B with v = 2 chunks per rank)",
        ["schedule", "bubble", "throughput vs 1F1B", ""],
        [[s["name"], f"{s['bubble']:.1%}", f"{s['relative_throughput']:.2f}x", "<- this config" if s["selected"] else ""]
         for s in plan["schedules"]],
    )


def _communication_table(plan: dict[str, Any]) -> Table:
    def total(row: dict[str, Any]) -> float:
        return row["busiest"]["all_gather"] + row["busiest"]["reduce_scatter"]

    rows = plan["communication"]
    baseline = next(total(r) for r in rows if r["name"] == "1F1B")
    return Table(
        "FSDP communication per step, busiest rank (GB; steady state, titan_async.plan_memory.fsdp_traffic_bytes)",
        ["schedule", "all-gather", "reduce-scatter", "total", "vs 1F1B", ""],
        [[r["name"], f"{r['busiest']['all_gather'] / 1e9:.2f}", f"{r['busiest']['reduce_scatter'] / 1e9:.2f}",
          f"{total(r) / 1e9:.2f}", f"{total(r) / baseline:.2f}x",
          "<- this config" if r["selected"] else ""] for r in rows],
    )


def _dry_run_table(plan: dict[str, Any]) -> Table:
    table = Table(
        f"Dry run: {plan['world_size']} ranks on a fake process group, meta device (GiB; {plan['dry_run']['note']})",
        ["rank", "pp", "local params", *(_HEADERS[k] for k in STATE_COMPONENTS), "allocated", "estimate", "ratio", "actions"],
        [],
    )
    for r in plan["dry_run"]["ranks"]:
        table.rows.append([
            str(r["rank"]), str(r["pp_rank"]), _count(r["local_parameters"]),
            *(f"{gib(r['allocated'][k]):.2f}" for k in STATE_COMPONENTS),
            f"{gib(sum(r['allocated'].values())):.2f}", f"{gib(sum(r['estimate'].values())):.2f}", f"{r['ratio']:.3f}",
            ", ".join(f"{n} {kind}" for kind, n in r["action_counts"].items()) or "-",
        ])
    return table


def _header(plan: dict[str, Any]) -> list[str]:
    m, l = plan["model"], plan["layout"]
    schedule = l["schedule"] if l["pipeline_stages"] > 1 else "no pipeline"
    return [
        f"plan: {plan['config']} on {plan['nodes']} node(s) x {plan['gpus_per_node']} GPU(s) = {plan['world_size']} GPUs "
        f"of {gib(plan['gpu_memory_bytes']):g} GiB",
        f"model: {m['preset']}, {m['parameters']:,} parameters (dim {m['dim']}, {m['n_layers']} layers, "
        f"{m['n_heads']} heads, {m['n_kv_heads']} KV heads, FFN {m['ffn_dim']}, vocab {m['vocab_size']})",
        f"layout: PP {l['pipeline_parallel']} x FSDP {l['data_parallel_shard']} x replicate {l['data_parallel_replicate']} "
        f"x TP {l['tensor_parallel']} x CP {l['context_parallel']}; {schedule}, {l['microbatches']} microbatch(es) "
        f"of {l['microbatch_tokens']} tokens per GPU, {l['tokens_per_step']:,} tokens per step",
        f"precision: weights {l['param_dtype']}, compute {l['compute_dtype']}, reduce {l['reduce_dtype']}"
        f"{'' if l['fsdp_applied'] else ' (no FSDP2: streaming stages without data parallelism)'}"
        f"{'' if l['float8'] == 'none' else ', float8 ' + l['float8'] + ' linears'}; "
        f"activation checkpointing {l['activation_checkpoint']}; optimizer {l['optimizer']}"
        f"{' + error feedback' if l['error_feedback'] else ''}",
    ]


def _plain(table: Table) -> str:
    cells = [table.columns, *table.rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(table.columns))]
    lines = [table.title]
    for row in cells:
        lines.append("  ".join(c.ljust(w) if i < table.left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip())
    return "\n".join(lines)


def _print_rich(header: list[str], tables: list[Table]) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table as RichTable

    console = Console()
    for line in header:
        console.print(line, highlight=False)
    for table in tables:
        rich_table = RichTable(title=table.title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
        for i, column in enumerate(table.columns):
            rich_table.add_column(column, justify="left" if i < table.left else "right")
        for row in table.rows:
            rich_table.add_row(*row)
        console.print(rich_table)


def print_plan(plan: dict[str, Any], as_json: bool) -> None:
    """One JSON object, rich tables on a terminal, or plain text."""
    if as_json:
        print(json.dumps(plan))
        return
    tables = [_memory_table(plan), _schedule_table(plan), *([_communication_table(plan)] if plan["communication"] else []),
              _dry_run_table(plan)]
    if sys.stdout.isatty():
        _print_rich(_header(plan), tables)
    else:
        print("\n".join(_header(plan)))
        for table in tables:
            print("\n" + _plain(table))
    for rank in plan["dry_run"]["ranks"]:
        if rank["actions"]:
            more = " ..." if len(rank["actions"]) > 16 else ""
            print(f"rank {rank['rank']} actions ({len(rank['actions'])}): {' '.join(rank['actions'][:16])}{more}")


def run_plan(run: RunConfig, cluster: Cluster, strict: bool, as_json: bool) -> int:
    """Print the plan; 1 if `strict` and some rank does not fit, else 0. Warnings go to stderr."""
    plan = make_plan(run, cluster)
    print_plan(plan, as_json)
    for warning in plan["warnings"]:
        print(f"titan-async: warning: {warning}", file=sys.stderr)
    return 1 if strict and not plan["fits"] else 0
