"""Bytes FSDP2 all-gathers, reduce-scatters and all-reduces across replicas on this rank,
counted where FSDP issues them.

`FSDPModule.set_custom_all_gather` and `set_custom_reduce_scatter` (torch's extension points
for FSDP2's collectives) take every collective a unit issues; `count_fsdp_traffic` wraps the
unit's own ones (torch's defaults unless configured otherwise) with a byte count. An
all-gather counts its unsharded output, a reduce-scatter its unsharded input: the bytes of
the parameters gathered and of the gradients reduced, per rank. Units of a one-rank FSDP
group issue no collective and count nothing. With replicas (DDP or HSDP) FSDP all-reduces
the reduced gradient shard across them; torch has no custom all-reduce, so its bytes are
counted by an all-reduce hook (`set_all_reduce_hook`, which runs right after it and adds no
collective), set on each parameter group that all-reduces.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

from titan_async.parallel.fsdp_stage import FsdpStage


@dataclass
class FsdpTraffic:
    """Running byte totals of this rank's FSDP collectives."""

    all_gather: int = 0
    reduce_scatter: int = 0
    all_reduce: int = 0
    taken: tuple[int, int, int] = (0, 0, 0)

    def take(self) -> dict[str, int]:
        """Bytes moved since the previous call."""
        (gathered, reduced, all_reduced), self.taken = self.taken, (self.all_gather, self.reduce_scatter, self.all_reduce)
        return {
            "fsdp_all_gather_bytes": self.all_gather - gathered,
            "fsdp_reduce_scatter_bytes": self.reduce_scatter - reduced,
            "replica_all_reduce_bytes": self.all_reduce - all_reduced,
        }

    def count_all_reduce(self, reduced: torch.Tensor) -> None:
        self.all_reduce += _nbytes(reduced)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class _CountedAllGather(AllGather):
    def __init__(self, inner: AllGather, traffic: FsdpTraffic) -> None:
        self.inner, self.traffic = inner, traffic

    def allocate(self, size, *, dtype, device):
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.traffic.all_gather += _nbytes(output_tensor)
        return self.inner(output_tensor, input_tensor, group, async_op)


class _CountedReduceScatter(ReduceScatter):
    def __init__(self, inner: ReduceScatter, traffic: FsdpTraffic) -> None:
        self.inner, self.traffic = inner, traffic

    def allocate(self, size, *, dtype, device):
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.traffic.reduce_scatter += _nbytes(input_tensor)
        return self.inner(output_tensor, input_tensor, group, op, async_op)


def count_fsdp_traffic(modules: list[torch.nn.Module]) -> FsdpTraffic | None:
    """Count the collectives of every FSDP unit inside `modules`; None when there is none."""
    stages = [stage for module in modules if (stage := FsdpStage.of(module))]
    if not stages:
        return None
    traffic = FsdpTraffic()
    for stage in stages:
        for state in stage.states:  # one state per unit: wrapping twice counts twice
            # Each parameter group of the unit gets its own counted copy of its collectives and
            # its own all-reduce hook: under expert parallelism an MoE block is one unit with two
            # groups (the dense weights on the data mesh, the experts on the expert-data mesh),
            # where torch's `set_custom_all_gather` and `set_all_reduce_hook` refuse to choose one
            # for both. The hook is set per group as `set_all_reduce_hook` sets it, and only where
            # the group all-reduces: FSDP calls a group's hook after its reduce-scatter otherwise.
            for group in state._fsdp_param_groups:
                group._all_gather_comm = _CountedAllGather(group._all_gather_comm, traffic)
                group._reduce_scatter_comm = _CountedReduceScatter(group._reduce_scatter_comm, traffic)
                if _all_reduces_across_replicas(group):
                    group._all_reduce_hook = traffic.count_all_reduce
    return traffic


def _all_reduces_across_replicas(group: FSDPParamGroup) -> bool:
    """Whether FSDP all-reduces this parameter group's reduced shard across more than one replica."""
    return isinstance(group.mesh_info, DDPMeshInfo) and group.mesh_info.replicate_mesh_size > 1
