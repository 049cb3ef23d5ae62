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

Write fence (CUDA). FSDP2 copies shards into its all-gather buffer on its own streams,
which wait for the compute stream only in the root pre-forward
(torch/distributed/fsdp/_fully_shard/_fsdp_state.py, `_root_pre_forward`:
`all_gather_copy_in_stream.wait_stream(current_stream)`; the TODO in
`_register_root_post_backward_final_callback` says the backward does not). A streaming
schedule writes shards between a forward and a backward (a 2BW version switch, a local
step), so after every such write `fence()` makes both all-gather streams wait for the
compute stream, exactly as the root pre-forward does. Writes cannot overtake an earlier
all-gather's read: the compute stream already waited for every all-gather whose output it
used. Copies between gathered parameters and side buffers run on the compute stream,
which also runs FSDP's copy-out, so they need no fence of their own; `reshard()` fences,
since the next all-gather may reuse the memory it frees.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state


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
        self.on_cuda = next(module.parameters()).device.type == "cuda"
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

    def gathered_params(self) -> list[torch.Tensor]:
        """The unsharded parameters, in a fixed order (valid while `gathered`)."""
        return [p.unsharded_param for group in self.groups for p in group.fsdp_params]

    def reshard(self) -> None:
        """Free the unsharded parameters; the next forward or backward gathers the shards. Fenced:
        the next all-gather may reuse the freed memory, which copies on the compute stream may
        still be reading."""
        for module in self.modules:
            module.reshard()
        self.fence()

    def fence(self) -> None:
        """Call after writing the shards: FSDP's next all-gather reads what was written."""
        if not self.on_cuda:
            return
        current = torch.cuda.current_stream()
        contexts = {id(s._comm_ctx): s._comm_ctx for s in self.states}
        for ctx in contexts.values():
            if hasattr(ctx, "all_gather_stream"):  # streams exist after FSDP's lazy init (the first forward)
                ctx.all_gather_copy_in_stream.wait_stream(current)
                ctx.all_gather_stream.wait_stream(current)
