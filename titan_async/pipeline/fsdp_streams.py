"""Order writes to FSDP2's sharded parameters before FSDP's next all-gather on CUDA.

FSDP2 copies shards into its all-gather buffer on its own streams, which wait for the
compute stream only in the root pre-forward (torch/distributed/fsdp/_fully_shard/_fsdp_state.py,
`_root_pre_forward`: `all_gather_copy_in_stream.wait_stream(current_stream)`; the TODO in
`_register_root_post_backward_final_callback` says the backward does not). A streaming
schedule writes shards between a forward and a backward (a 2BW version switch, a PACI
local step), so after every such write `fence()` makes both all-gather streams wait
for the compute stream, exactly as the root pre-forward does. Writes themselves cannot
overtake an earlier all-gather's read: the compute stream already waited for every
all-gather whose output it used.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.fsdp import FSDPModule


def param_write_fence(module: torch.nn.Module) -> Callable[[], None]:
    """A function to call after writing `module`'s sharded parameters (a no-op off CUDA or without FSDP)."""
    fsdp_modules = [m for m in module.modules() if isinstance(m, FSDPModule)]
    if not fsdp_modules or next(module.parameters()).device.type != "cuda":
        return lambda: None

    def fence() -> None:
        current = torch.cuda.current_stream()
        contexts = {id(ctx): ctx for ctx in (m._get_fsdp_state()._comm_ctx for m in fsdp_modules)}
        for ctx in contexts.values():
            if hasattr(ctx, "all_gather_stream"):  # streams exist after FSDP's lazy init (the first forward)
                ctx.all_gather_copy_in_stream.wait_stream(current)
                ctx.all_gather_stream.wait_stream(current)

    return fence
