"""Expert parallelism (`parallelism.expert_parallel_degree` = ep > 1) inside each pipeline stage,
laid out as torchtitan lays it out.

torchtitan re-views a stage's data ranks as dp_shard x cp x tp == efsdp x ep
(torchtitan/distributed/parallel_dims.py). `parallelize_qwen3` calls `model.parallelize`, which
shards every expert stack (`w1_EFD`, `w2_EDF`, `w3_EFD`) by expert over the ep dimension and wires
the token dispatcher (torchtitan/models/common/token_dispatcher.py: `AllToAllTokenDispatcher`) to
the ep mesh: each MoE block exchanges its per-expert token counts, then all-to-alls the routed
tokens to the ranks that hold their experts and back, with uneven splits. FSDP2 then wraps each
MoE block as one unit with two parameter groups, the dense weights on the data mesh and the
experts on the efsdp mesh (torchtitan/distributed/fsdp.py: `apply_fsdp_to_decoder`). The
streaming stages drive that unit as any other (`fsdp_stage`): the all-to-alls run inside the
forwards and backwards, where they belong to exactly one microbatch, so the schedules need no
change, and the rest of the stage's step is made EP-aware where it must be: clipping
(`clip_grad_norm_(..., ep_enabled=True)`: the expert and dense norms are reduced over their own
meshes), Muon (`optim/full_matrix.py` gathers each expert stack over its mesh and orthogonalises
each expert's matrix), FSDP's byte counts (`fsdp_traffic`, one counter per parameter group,
the replica all-reduce's too: with `data_parallel_replicate_degree` > 1 both groups all-reduce
their reduced shard across the replicas).

The one choice this module makes is the SPMD backend of an EP run: `partial_dtensor`, whatever
`parallelism.spmd_backend` says. torchtitan's default, `spmd_types`, cannot run EP here, for two
reasons measured with torch 2.15 / torchtitan 0.3.0 on gloo:
- its dispatcher calls `spmd.all_to_all`, the list form of all-to-all, which gloo refuses with
  uneven splits ("ProcessGroupGloo::alltoall: invalid tensor size");
- its expert stacks are 2-D DTensors on (efsdp, ep) with a strided shard `(_S(0, 2), S(0))`, on
  which DTensor cannot propagate `copy_` ("Sharding propagation failed for aten.copy_"), so
  seeding the initial weights by name (`model/init.py`) fails, on any device.
Under `partial_dtensor` the dispatcher uses the functional `all_to_all_single` with uneven splits
(one flat buffer, the form NCCL runs natively; differentiable: its backward is the reversed
all-to-all), which gloo runs too, and `model.parallelize` gives the experts their ep DTensors
directly. The alternative, rewriting torchtitan's dispatch to use `all_to_all_single` under
`spmd_types`, would patch a library class for the same collective. Only EP runs switch: dense,
TP and EP-1 MoE runs keep the default backend, whose TP path is tested.
"""

from __future__ import annotations

import dataclasses

EXPERT_PARALLEL_BACKEND = "partial_dtensor"


def with_expert_parallel_backend(parallelism):
    """`parallelism` with the SPMD backend an EP run uses (module docstring); unchanged without EP."""
    if parallelism.expert_parallel_degree <= 1 or parallelism.spmd_backend == EXPERT_PARALLEL_BACKEND:
        return parallelism
    return dataclasses.replace(parallelism, spmd_backend=EXPERT_PARALLEL_BACKEND)


def expert_parallel_problem(parallelism, family: str, num_experts: int | None, shard_degree: int) -> str | None:
    """Why `parallelism.expert_parallel_degree` cannot lay out this model, naming the keys; None if it can.

    `shard_degree`: the data-parallel shard ranks of a stage (dp_shard, resolved for the world
    size); EP splits dp_shard x cp x tp into efsdp x ep."""
    ep = parallelism.expert_parallel_degree
    key = f"parallelism.expert_parallel_degree ({ep})"
    if ep < 1:
        return f"{key} must be >= 1"
    if ep == 1:
        return None
    if family != "qwen3_moe":
        return f"{key} applies to model.family = \"qwen3_moe\" only (this model is {family!r}); set it to 1"
    if num_experts % ep:
        return f"{key} must divide model.num_experts ({num_experts}): each expert-parallel rank holds whole experts"
    ranks = shard_degree * parallelism.context_parallel_degree * parallelism.tensor_parallel_degree
    if ranks % ep:
        return (f"{key} must divide the data ranks of a stage, parallelism.data_parallel_shard_degree x "
                f"context_parallel_degree x tensor_parallel_degree ({ranks}): experts are laid out over them "
                "as efsdp x ep (torchtitan's layout)")
    return None
