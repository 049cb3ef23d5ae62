"""Initial weights that depend on the seed and the parameter's name, not on the parallel layout."""

from __future__ import annotations

import zlib

import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from torchtitan.models.common.param_init import skip_param_init

_WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical_name(name: str) -> str:
    """A parameter's name in the unwrapped model (drops activation-checkpoint/compile wrappers)."""
    for segment in _WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    return name


@torch.no_grad()
def reinitialize_by_name(model_parts: list[torch.nn.Module], seed: int) -> None:
    """Redraw every parameter with its module's own initializer from an RNG seeded by (seed, name).

    The full tensor is drawn on every rank and each rank keeps its shard, so the same
    seed gives the same weights without PP, with PP, and under FSDP.
    """
    for part in model_parts:
        for module_name, module in part.named_modules():
            initializers = getattr(module, "_param_init", None)
            if not initializers:
                continue
            for name, param in module.named_parameters(recurse=False):
                if initializers[name] is skip_param_init:
                    continue
                fqn = canonical_name(f"{module_name}.{name}" if module_name else name)
                device = param.device
                full = torch.empty(param.shape, dtype=param.dtype, device=device)
                devices = [device] if device.type == "cuda" else []
                with torch.random.fork_rng(devices=devices):
                    torch.manual_seed(zlib.crc32(fqn.encode()) ^ (seed * 0x9E3779B1 % (1 << 32)))
                    initializers[name](full)
                if isinstance(param, DTensor):
                    full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
                param.copy_(full)
