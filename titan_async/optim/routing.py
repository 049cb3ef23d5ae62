"""Which optimizer each parameter gets: Muon for hidden matrices, AdamW for everything else.

Rules look at one parameter at a time (its canonical name, its module, its shape), so any
pipeline stage routes on its own, whatever subset of the model it holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch.nn as nn
from torchtitan.components.checkpointer.utils import canonical_fqn
from torchtitan.models.common.attention import FusedQKVLinear

from titan_async.optim.blocks import ExpertBlocks, FusedQKVBlocks, MatrixBlocks, WholeMatrix

WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_orig_mod")
"""Name segments that wrappers (activation checkpointing, FSDP1, torch.compile) insert."""
EMBEDDING_NAMES = ("tok_embeddings",)
HEAD_NAMES = ("lm_head", "output")


@dataclass(frozen=True, eq=False)
class Route:
    """One trainable parameter and the optimizer it belongs to."""

    name: str
    """Canonical name (wrapper segments removed), as torchtitan's checkpoints key it."""
    param: nn.Parameter
    optimizer: Literal["muon", "adamw"]
    reason: str
    blocks: MatrixBlocks


def canonical_name(name: str) -> str:
    """`name` without wrapper segments."""
    return canonical_fqn(name, WRAPPER_SEGMENTS)


def route_parameters(model: nn.Module) -> list[Route]:
    """A route for every trainable parameter of `model` (a whole model or one pipeline stage).

    Muon: 2-D parameters other than embeddings and the output head, and MoE experts' 3-D
    weights (each expert's matrix on its own). AdamW: embeddings
    (`tok_embeddings`, any nn.Embedding), the output head (`lm_head`/`output`), and every
    other parameter that is not 2-D (norms, biases), and MoE routers' gates.
    A fused `wqkv.weight` gets its Q, K, V blocks.
    """
    embeddings = {canonical_name(n) for n, m in model.named_modules() if isinstance(m, nn.Embedding)}
    fused_qkv = {
        canonical_name(f"{n}.wqkv.weight"): FusedQKVBlocks(heads_per_kv=m.heads_per_kv, head_dim=m.head_dim)
        for n, m in model.named_modules()
        if isinstance(m, FusedQKVLinear)
    }
    routes = []
    for raw_name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        name = canonical_name(raw_name)
        top = name.split(".")[0]
        if param.ndim == 3 and name.rpartition(".")[0].endswith("inner_experts"):
            optimizer, reason = "muon", "MoE experts"
        elif param.ndim != 2:
            optimizer, reason = "adamw", "not a matrix"
        elif ".router." in f".{name}":
            optimizer, reason = "adamw", "MoE router"
        elif top in EMBEDDING_NAMES or name.rpartition(".")[0] in embeddings:
            optimizer, reason = "adamw", "embedding"
        elif top in HEAD_NAMES:
            optimizer, reason = "adamw", "output head"
        else:
            optimizer, reason = "muon", "hidden matrix"
        blocks = WholeMatrix()
        if optimizer == "muon":
            blocks = ExpertBlocks(param.shape[0]) if param.ndim == 3 else fused_qkv.get(name, WholeMatrix())
        routes.append(Route(name=name, param=param, optimizer=optimizer, reason=reason, blocks=blocks))
    return routes
