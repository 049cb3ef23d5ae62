"""A pipeline stage's FSDP2 units, as the weight policies drive them.

Gather and reduce once (`hold_gathered`, on the stages of a real pipeline). torch's own
pipeline stage keeps a stage gathered from its first forward to its last backward and
reduce-scatters once per step (torch/distributed/pipelining/stage.py:
`backward_maybe_with_nosync` turns gradient sync and reshard-after-backward off,
`perform_reduce_grad` finalizes once). A streaming stage never empties, so it does the
same through FSDP2's manual backward finalization
(torch/distributed/fsdp/_fully_shard/_fully_shard.py: `set_manual_backward_finalization`,
`finalize_backward`): no unit reshards after a forward or a backward, backwards accumulate
unsharded gradients, `reduce()` reduce-scatters them once per update, and a unit is
gathered again only after `reshard()`, which the policies call when the weights the next
action needs are not the ones gathered. torch's docstring asks not to call `finalize_backward`
between a forward and its backward, which a streaming stage does (other microbatches are in
flight): tests/test_fsdp_stage.py pins the FSDP2 behaviour this relies on (units stay gathered,
each reduce holds exactly the gradients since the last, later backwards still reduce) against
plain modules, so a torch upgrade that changes it fails there. Without `hold_gathered` (the
single-process emulation, `gradient_delay`) FSDP reshards and reduces as configured, and the
policies only check `gathered` before they rely on gathered weights.

Replicas (DDP, HSDP). torchtitan shards a stage over a (replicate, shard) mesh; FSDP2 then
all-reduces the reduce-scattered shard across the replicas inside the same `finalize_backward`.
A held stage reduces only in `reduce()`, once per update, so its gradient crosses the replicas
once per update and its replicas step together at the stage's own time. What torch refuses under
manual finalization, an all-reduce delayed past earlier reduce-scatters
(`set_requires_all_reduce(False)` for some backwards), is never needed: a held stage does not
reduce-scatter between updates at all.

Write fence. FSDP2 copies shards into its all-gather buffer on its own streams,
which wait for the compute stream only in the root pre-forward
(torch/distributed/fsdp/_fully_shard/_fsdp_state.py, `_root_pre_forward`:
`all_gather_copy_in_stream.wait_stream(current_stream)`; the TODO in
`_register_root_post_backward_final_callback` says the backward does not). A streaming
schedule writes shards between a forward and a backward (a 2BW version switch, a local
step), so after every such write `fence()` makes the copy-in stream wait for the compute
stream, as the root pre-forward does. The all-gather stream needs no wait of its own: every
all-gather on it first waits for the copy-in stream (`foreach_all_gather`), and the stream model
shows the second wait changes nothing (tools/stream_mutations.py). Writes cannot overtake an
earlier all-gather's read: the compute stream already waited for every all-gather whose output
it used. `reshard()` fences, since the next all-gather may reuse the memory it frees.

Version switches (`exchange_storage`). 2BW keeps a second version of the shards and of the
gathered parameters beside FSDP's own tensors and switches by exchanging storages, not
values: every tensor that aliases FSDP's storage (`shard_storage`, `gathered_storage`: FSDP's
flat shard or all-gather output, and the parameter's data) is pointed at the other buffer, so
the module, the optimizer and FSDP's next all-gather (which reads that flat shard and, for the
gathered, writes that output) follow. Views made earlier keep their storage: autograd saved
no shard, and the gathered weights a microbatch's forward saved stay in the buffer that held
its version. That is exact only while a gathered buffer's values change just when the version
they hold is dropped: on a held stage FSDP frees (and so re-gathers into) a buffer only when
the policy reshards, which it does for a dropped version only, so 2BW keeps a gathered second
version there only. It relies on FSDP2's default all-gather (no `fsdp_pre_all_gather`
extension: one output per parameter, which the unsharded parameter views).
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state
from torch.distributed.tensor import DTensor

from titan_async.core import streams


class FsdpStage:
    """The FSDP2 units of one stage module (see the module docstring)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.root = module
        # One state per unit: a unit may span several modules (torchtitan shards norm and output
        # together), and a stage view of the emulation is FSDP-typed without a state of its own.
        states = {id(s): (m, s) for m in module.modules() if (s := _get_module_fsdp_state(m)) is not None}
        self.modules = [m for m, _ in states.values()]
        self.states = [s for _, s in states.values()]
        self.groups = [g for s in self.states for g in s._fsdp_param_groups]
        self.streams = streams.for_device(next(module.parameters()).device)
        self.manual = False

    @classmethod
    def of(cls, module: torch.nn.Module) -> FsdpStage | None:
        """The stage's FSDP units, or None when none of its parameters is sharded."""
        stage = cls(module)
        return stage if stage.groups else None

    def hold_gathered(self) -> None:
        """Gather once and reduce once per update from now on (before the first forward)."""
        if not isinstance(self.root, FSDPModule):
            raise RuntimeError("pipeline stage: FSDP must wrap the stage module itself to hold its units gathered")
        self.root.set_manual_backward_finalization(True)
        self.root.set_reshard_after_forward(False)
        self.root.set_reshard_after_backward(False)
        self.root.set_requires_gradient_sync(False)
        self.manual = True

    def reduce(self) -> None:
        """Reduce-scatter the gradients accumulated since the last reduce (with `hold_gathered`)."""
        if self.manual:
            self.root.set_requires_gradient_sync(True)
            self.root.finalize_backward()
            self.root.set_requires_gradient_sync(False)

    @property
    def gathered(self) -> bool:
        """Whether every unit holds its unsharded parameters."""
        return all(group.is_unsharded for group in self.groups)

    def gathered_storage(self) -> list[list[torch.Tensor]]:
        """Per unsharded parameter, in a fixed order, the tensors that alias its storage: FSDP's
        all-gather output (the whole storage) and the parameter's data (valid while `gathered`)."""
        storage = []
        for group in self.groups:
            for param in group.fsdp_params:
                if len(param.all_gather_outputs) != 1:
                    raise RuntimeError(f"{param._param_fqn}: FSDP all-gathers it through an extension; "
                                       "2BW's versions need the default all-gather")
                storage.append([param.all_gather_outputs[0], _data(param.unsharded_param)])
        return storage

    def shard_storage(self, params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """Per sharded parameter of `params`, the tensors that alias its shard's storage: FSDP's
        padded flat shard (the whole storage, which its all-gather reads) and the parameter's local data."""
        by_param = {id(p.sharded_param): p for group in self.groups for p in group.fsdp_params}
        return [[by_param[id(param)]._sharded_param_data, _data(param)] for param in params]

    def reshard(self) -> None:
        """Free the unsharded parameters; the next forward or backward gathers the shards. Fenced:
        the next all-gather may reuse the freed memory, which copies on the compute stream may
        still be reading."""
        for module in self.modules:
            module.reshard()
        self.fence()

    def fence(self) -> None:
        """Call after writing the shards: FSDP's next all-gather reads what was written."""
        current = self.streams.current()
        contexts = {id(s._comm_ctx): s._comm_ctx for s in self.states}
        for ctx in contexts.values():
            if hasattr(ctx, "all_gather_copy_in_stream"):  # streams exist after FSDP's lazy init (the first forward)
                ctx.all_gather_copy_in_stream.wait_stream(current)


def exchange_storage(holders: list[torch.Tensor], other: torch.Tensor) -> torch.Tensor:
    """Point every tensor of `holders` (aliases of one storage, the first spanning it, as
    `gathered_storage` and `shard_storage` list them) at `other`'s storage instead, each keeping its
    sizes, strides and offset; return the tensor laid out as `other` on the storage they held.
    No values are copied (see the module docstring)."""
    held = _on_storage(other, holders[0].untyped_storage())
    for tensor in holders:
        tensor.data = _on_storage(tensor, other.untyped_storage())
    return held


def spare_storage(holders: list[torch.Tensor]) -> torch.Tensor:
    """An uninitialised buffer for `exchange_storage` with `holders`: laid out as the last of them,
    on a new storage of the size of theirs."""
    return _on_storage(holders[-1], torch.empty_like(holders[0]).untyped_storage())


def _on_storage(like: torch.Tensor, storage: torch.UntypedStorage) -> torch.Tensor:
    """A tensor with `like`'s dtype, sizes, strides and storage offset, on `storage`."""
    return torch.empty(0, dtype=like.dtype, device=like.device).set_(storage, like.storage_offset(), like.size(), like.stride())


def _data(param: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding `param`'s (local) values: a DTensor's local tensor, else `param` itself."""
    return param._local_tensor if isinstance(param, DTensor) else param
