"""The toy emulation under FSDP2, with a model of when FSDP's all-gather streams see shard writes.

`fsdp_write_order.py SCHEDULE FSDP VARIANT OUT` runs toy_pipeline's `emulate` (4 stages,
AdamW, one-rank FSDP2 on CPU) and writes OUT/stage<S>.pt as it does, plus OUT/violations.pt.

The model (CUDA semantics that a CPU run cannot show): FSDP copies shards into its all-gather
buffer on its own streams, which are ordered after the compute stream only by a fence: FSDP's
root pre-forward (when it opens an iteration) or `FsdpStage.fence`. A write to a shard (seen
through the version counters of the shard), or a change of the storage it is in (2BW's version
switches exchange it with the side shard's, written earlier), that no fence separates from a
later all-gather of that shard is a violation: on a GPU with more than one rank, that
all-gather may read the shard before the write lands.

VARIANT "exact"; "no-fence": `FsdpStage.fence` does nothing (the model must report
violations); "stale-spare": 2BW's gathered side buffer is never swapped in, so computation
runs on a stale gathered version (the references must reject it).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

sys.path.insert(0, str(Path(__file__).resolve().parent))
import toy_pipeline  # noqa: E402

from titan_async.parallel.fsdp_stage import FsdpStage  # noqa: E402
from titan_async.pipeline.versions import ShardedTwoVersions  # noqa: E402


def _writes(param) -> tuple[int, int, int]:
    """In-place writes so far to an FSDP parameter's shard: through FSDP's flat storage, or
    through the sharded parameter's local tensor (a separate version counter on one storage);
    and that storage."""
    flat = param._sharded_param_data
    return flat._version, param.sharded_param._local_tensor._version, flat.untyped_storage().data_ptr()


class WriteOrder:
    """Shard versions at each stream context's last fence; all-gathers of later writes."""

    def __init__(self) -> None:
        self.groups: list[FSDPParamGroup] = []
        self.fenced: dict[int, int] = {}
        self.violations: list[str] = []

    def fence(self, comm_ctx) -> None:
        for group in self.groups:
            if group.comm_ctx is comm_ctx:
                for param in group.fsdp_params:
                    self.fenced[id(param)] = _writes(param)

    def all_gather(self, group: FSDPParamGroup) -> None:
        if group not in self.groups:  # first seen: its first all-gather follows FSDP's lazy init
            self.groups.append(group)
            self.fenced.update({id(p): _writes(p) for p in group.fsdp_params})
        for param in group.fsdp_params:
            if self.fenced[id(param)] != _writes(param):
                self.violations.append(param._param_fqn)


def install(order: WriteOrder, variant: str) -> None:
    unshard, root_pre_forward, fence = FSDPParamGroup.unshard, FSDPState._root_pre_forward, FsdpStage.fence

    def checked_unshard(self, async_op: bool = False):
        order.all_gather(self)
        return unshard(self, async_op)

    def fencing_root_pre_forward(self, module, args, kwargs):
        opens = self._state_ctx.iter_forward_root is None
        result = root_pre_forward(self, module, args, kwargs)
        if opens:
            order.fence(self._comm_ctx)
        return result

    def recorded_fence(self):
        if variant == "no-fence":
            return
        fence(self)
        for state in self.states:
            order.fence(state._comm_ctx)

    FSDPParamGroup.unshard = checked_unshard
    FSDPState._root_pre_forward = fencing_root_pre_forward
    FsdpStage.fence = recorded_fence
    if variant == "stale-spare":
        def stale_swap(self):
            self.gathered_version, self.spare_version = self.spare_version, self.gathered_version

        ShardedTwoVersions._swap_gathered = stale_swap


def main() -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    schedule, fsdp, variant, out = sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4])
    out.mkdir(parents=True, exist_ok=True)
    order = WriteOrder()
    install(order, variant)
    toy_pipeline.emulate(schedule, "adamw", 2, 4, torch.device("cpu"), fsdp, out)
    torch.save(order.violations, out / "violations.pt")


if __name__ == "__main__":
    main()
