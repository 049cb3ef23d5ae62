"""The single-process emulation: every pipeline stage of a streaming schedule in this process.

Stage views share the full model's parameters, so validation and checkpoints see the
whole model, while each stage keeps its own optimizer, learning-rate schedule and
weight policy, exactly as one rank of the real pipeline would.
"""

from __future__ import annotations

import torch
from torchtitan.distributed.pipeline_parallel import _generate_llm_fqn_per_model_part
from torchtitan.protocols.module import ModuleDict


def stage_modules(parallelism, num_layers: int) -> list[list[str]]:
    """Module names of each stage, as torchtitan's pipeline builder splits them."""
    if parallelism.module_fqns_per_model_part:
        return parallelism.module_fqns_per_model_part
    return _generate_llm_fqn_per_model_part(
        parallelism.emulated_stages,
        num_layers,
        parallelism.pipeline_parallel_first_stage_less_layers,
        parallelism.pipeline_parallel_last_stage_less_layers,
    )


def stage_view(model: torch.nn.Module, names: list[str]) -> torch.nn.Module:
    """A shallow copy of `model` holding only the modules in `names` (parameters shared)."""
    view = object.__new__(type(model))  # not copy.copy: FSDP's __new__ would build the unwrapped class
    view.__dict__.update(model.__dict__, _modules=dict(model._modules))
    keep = set(names)
    for child_name, child in model.named_children():
        if isinstance(child, (torch.nn.ModuleDict, ModuleDict)):
            view._modules[child_name] = ModuleDict(
                {key: layer for key, layer in child.items() if f"{child_name}.{key}" in keep}
            )
        elif child_name not in keep:
            view._modules[child_name] = None
    return view
