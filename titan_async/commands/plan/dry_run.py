"""The plan's dry run: each inspected rank set up on torch's fake process group and the meta
device as the trainer sets it up (stage, FSDP2 wrapping, what `AsyncTrainer.__init__` applies
to the built parts, optimizer state, gradients), and the bytes of what it allocates, beside the
estimate of the same components. A layout the trainer would fail to build fails here, before
any launch."""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import _clear_sharding_prop_cache
from torchtitan.components.optimizer import OptimizersContainer, register_moe_load_balancing_hook
from torchtitan.components.optimizer.utils import init_optim_state
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.utils import init_fake_mode, set_spmd_backend
from torchtitan.tools.utils import device_type

from titan_async.cluster.estimate import Layout
from titan_async.cluster.memory import STATE_COMPONENTS
from titan_async.config.assemble import ACTIVATION_CHECKPOINTS
from titan_async.config.run_config import RunConfig
from titan_async.model.init import reinitialize_by_name
from titan_async.model.meta import MetaModel
from titan_async.optim.error_feedback import PREVIOUS_UPDATE, STEPS
from titan_async.parallel.expert import with_expert_parallel_backend
from titan_async.parallel.fsdp_stage import FsdpStage
from titan_async.parallel.fsdp_traffic import count_fsdp_traffic
from titan_async.pipeline.actions import gradient_delay, pipeline_order
from titan_async.pipeline.emulation import stage_modules, stage_view
from titan_async.pipeline.load_balance import moe_blocks
from titan_async.pipeline.schedules import StreamingSchedule
from titan_async.pipeline.versions import (
    PredictedAccumulation, ShardedDelayedVersions, ShardedTwoVersions, TwoVersions, make_policy, two_versions,
)

ESTIMATE_ONLY_NOTE = (
    "activations, the optimizer step's scratch, FSDP's unsharded and flat buffers, P2P, stage-input and NCCL buffers "
    "are estimates only: meta tensors hold no activations, and the optimizer, FSDP and the pipeline transport "
    "allocate these buffers only while they step, gather, reduce, send and receive"
)
NOT_BUILT_NOTE = "not built: titan-async train would stop before building this layout (see the warning)"


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def _no_loss(*args, **kwargs):
    raise RuntimeError("the plan's dry run computes nothing")


def _build_rank(run: RunConfig, model: MetaModel, world: int) -> tuple[list[torch.nn.Module], Any, int, ParallelDims]:
    """This (fake) rank's model parts, pipeline schedule (None without PP), pipeline rank and
    parallel dims, on meta, parallelized and initialized as the trainer does (initializing
    re-ties tied weights; `debug.seed` redraws them by name)."""
    spec = model.spec
    parallelism = with_expert_parallel_backend(run.parallelism)
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
    if run.debug.seed is not None:
        reinitialize_by_name(parts, run.debug.seed)
    return parts, schedule, pp_rank, parallel_dims


def _build_optimizers(run: RunConfig, modules: list[torch.nn.Module]) -> OptimizersContainer:
    """The optimizers training builds for `modules` (Muon's exchange groups included), in the
    foreach implementation: fused kernels refuse meta tensors, and foreach keeps the same state."""
    section = dataclasses.replace(run.optimizer, implementation="foreach")
    return section.container_config().build(model_parts=modules)


def _no_step() -> None:
    raise RuntimeError("the plan's dry run steps no optimizer")


@dataclasses.dataclass
class TrainerSetup:
    """What `AsyncTrainer.__init__` applies to one rank's built parts."""

    optimizers: OptimizersContainer
    policies: list[Any]
    """The weight policies of the stages this rank steps (none for synchronous training)."""
    balanced_moe_blocks: int
    """MoE blocks whose expert biases move at this rank's steps."""


def _weight_policies(run: RunConfig, layout: Layout, parts: list[torch.nn.Module], schedule: Any) -> list[tuple[torch.nn.Module, Any]]:
    """(stage module, weight policy) as the trainer attaches them: a streaming schedule's stream
    (`attach`: its FSDP units held gathered, P2P transport, executor), the emulation's stage
    views, `training.gradient_delay`'s d + 1 versions of the whole model; none otherwise."""
    accumulation, t = run.parallelism.paci.accumulation, run.training
    if isinstance(schedule, StreamingSchedule):
        stream = schedule.attach(optimizer_step=_no_step, microbatches=layout.window, accumulation=accumulation, keep_trace=False,
                                 sync_start=t.sync_start_steps, prediction=t.weight_prediction)
        return [(executor.module, executor.policy) for executor in stream.executors]
    if layout.emulated:
        views = [stage_view(parts[0], names) for names in stage_modules(run.parallelism, len(parts[0].layers))]
        return [(view, make_policy(layout.schedule, view, layout.window, accumulation, sync_start=t.sync_start_steps,
                                   prediction=t.weight_prediction, stages_after=len(views) - 1 - i,
                                   lag=gradient_delay(len(views), layout.window))) for i, view in enumerate(views)]
    if t.gradient_delay:
        return [(parts[0], two_versions(parts[0], 1, FsdpStage.of(parts[0]), t.sync_start_steps, t.weight_prediction,
                                        t.gradient_delay))]
    return []


def _apply_trainer_setup(run: RunConfig, layout: Layout, parts: list[torch.nn.Module], schedule: Any,
                         parallel_dims: ParallelDims) -> TrainerSetup:
    """Apply to `parts` what `AsyncTrainer.__init__` applies, in its order: the optimizers, FSDP's
    traffic counters and hooks (`count_fsdp_traffic`), the weight policies (the emulation
    rebuilds the optimizers on its stage views) and MoE load balancing (per stage where
    policies step the stages, torchtitan's optimizer hook otherwise)."""
    optimizers = _build_optimizers(run, parts)
    count_fsdp_traffic(parts)
    stages = _weight_policies(run, layout, parts, schedule)
    if layout.emulated:
        optimizers = _build_optimizers(run, [module for module, _ in stages])
    if stages:
        balanced = sum(len(moe_blocks(module)) for module, _ in stages)
    else:
        register_moe_load_balancing_hook(optimizers, parts, parallel_dims)
        balanced = sum(len(moe_blocks(part)) for part in parts)
    return TrainerSetup(optimizers, [policy for _, policy in stages], balanced)


def _allocated_state(parts: list[torch.nn.Module], setup: TrainerSetup) -> dict[str, int]:
    """Bytes of the state tensors training creates on this rank (`STATE_COMPONENTS`), on meta:
    its (sharded) parameters, the MoE experts' (3-D) apart, the 2BW weight versions (with the
    expert biases), the optimizer state and the sharded gradients."""
    params = [p for part in parts for p in part.parameters()]
    allocated = dict.fromkeys(STATE_COMPONENTS, 0)
    allocated["weights"] = sum(_local_bytes(p) for p in params if p.ndim != 3)
    allocated["expert_weights"] = sum(_local_bytes(p) for p in params if p.ndim == 3)
    for policy in setup.policies:
        if isinstance(policy, (TwoVersions, ShardedTwoVersions, ShardedDelayedVersions, PredictedAccumulation)):
            allocated["weight_versions"] += sum(_local_bytes(t) for t in policy.copies())
    for optimizer in setup.optimizers.optimizers:
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


def _pipeline_order(schedule: Any, layout: Layout) -> dict[int, list]:
    """Pipeline rank -> actions (torch's schedule IR): a streaming schedule's for two windows of
    K x m microbatches and a drain (torchtitan builds the schedule with one local batch's m); a
    synchronous schedule's for one flush of m, of the K a step runs."""
    if layout.streaming and schedule is not None:
        return pipeline_order(layout.pipeline_stages(), layout.window, windows=2)
    return getattr(schedule, "pipeline_order", None) or {}


def _actions(schedule: Any, layout: Layout, pp_rank: int) -> tuple[list[str], dict[str, int]]:
    """The action list of `pp_rank` (None = idle) and the count of each action type."""
    order = _pipeline_order(schedule, layout).get(pp_rank, [])
    names = [str(action) if action is not None else "idle" for action in order]
    counts = Counter(action.computation_type.value if action is not None else "idle" for action in order)
    return names, dict(counts)


def dry_run_rank(run: RunConfig, layout: Layout, model: MetaModel, world: int, rank: int) -> dict[str, Any]:
    """Set up global rank `rank` of `world` with a fake process group and report what it holds."""
    init_fake_mode(world, rank=rank)
    try:
        parts, schedule, pp_rank, parallel_dims = _build_rank(run, model, world)
        setup = _apply_trainer_setup(run, layout, parts, schedule, parallel_dims)
        actions, counts = _actions(schedule, layout, pp_rank)
        return {
            "rank": rank,
            "pp_rank": pp_rank,
            "stages": list(layout.rank_stages[pp_rank]),
            "local_parameters": sum(
                (p.to_local() if isinstance(p, DTensor) else p).numel() for part in parts for p in part.parameters()
            ),
            "fsdp_wrapped": any(isinstance(p, DTensor) for part in parts for p in part.parameters()),
            "weight_policies": [type(policy).__name__ for policy in setup.policies],
            "balanced_moe_blocks": setup.balanced_moe_blocks,
            "allocated": _allocated_state(parts, setup),
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
    set_spmd_backend(with_expert_parallel_backend(run.parallelism).spmd_backend)
    results = []
    for rank in inspected_ranks(layout, world):
        result = dry_run_rank(run, layout, model, world, rank)
        estimate = {key: rows[result["pp_rank"]]["memory"][key] for key in STATE_COMPONENTS}
        result["estimate"] = estimate
        result["ratio"] = sum(result["allocated"].values()) / max(1, sum(estimate.values()))
        results.append(result)
    return results
