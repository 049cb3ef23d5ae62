"""Muon: momentum orthogonalised per matrix block, for 2-D hidden-layer parameters."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from titan_async.optim.blocks import MatrixBlocks, WholeMatrix
from titan_async.optim.full_matrix import map_full_matrices
from titan_async.optim.newton_schulz import orthogonalize

LrScaling = Literal["original", "match_rms_adamw"]
NsDtype = Literal["float32", "bfloat16"]

LR_SCALING_RULES: dict[str, Callable[[int, int], float]] = {
    "original": lambda rows, cols: math.sqrt(max(1.0, rows / cols)),
    "match_rms_adamw": lambda rows, cols: 0.2 * math.sqrt(max(rows, cols)),
}
"""Multiplier of the lr for a block of shape (rows, cols)."""


def lr_scale(rule: str, shape: tuple[int, int]) -> float:
    """The lr multiplier that `rule` gives a block of `shape`."""
    return LR_SCALING_RULES[rule](*shape)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class Muon(Optimizer):
    """Muon for 2-D parameters (plain or FSDP2-sharded on dim 0).

    For a parameter W with gradient G and momentum buffer B:
    B <- mu B + (1 - mu) G; M = (1 - mu) G + mu B with Nesterov, else M = B;
    W <- (1 - lr wd) W - lr * O, where O's blocks (see `blocks`) are each
    orthogonalize(M_block) * lr_scale(lr_scaling, block shape). O is always computed on the
    full logical matrix (see `map_full_matrices`), never per shard.

    `blocks` maps parameter names (the groups' `param_names`) to their block layout;
    other parameters are one block.
    """

    def __init__(
        self,
        params: Any,
        *,
        lr: float,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        ns_steps: int = 5,
        ns_dtype: NsDtype = "float32",
        lr_scaling: LrScaling = "match_rms_adamw",
        blocks: Mapping[str, MatrixBlocks] | None = None,
    ) -> None:
        if lr < 0:
            raise ValueError(f"Muon lr must be >= 0, got {lr}")
        if not 0 <= momentum < 1:
            raise ValueError(f"Muon momentum must be in [0, 1), got {momentum}")
        if ns_steps < 1:
            raise ValueError(f"Muon ns_steps must be >= 1, got {ns_steps}")
        if ns_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"Muon ns_dtype must be float32 or bfloat16, got {ns_dtype!r}")
        if lr_scaling not in LR_SCALING_RULES:
            raise ValueError(f"Muon lr_scaling must be one of {', '.join(LR_SCALING_RULES)}, got {lr_scaling!r}")
        defaults = dict(
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            weight_decay=weight_decay,
            ns_steps=ns_steps,
            ns_dtype=ns_dtype,
            lr_scaling=lr_scaling,
        )
        super().__init__(params, defaults)
        blocks = blocks or {}
        self.blocks: dict[torch.Tensor, MatrixBlocks] = {}
        for group in self.param_groups:
            names = group.get("param_names") or [None] * len(group["params"])
            for name, param in zip(names, group["params"]):
                if param.ndim != 2:
                    raise ValueError(f"Muon takes 2-D parameters only; {name} has shape {tuple(param.shape)}")
                self.blocks[param] = blocks.get(name, WholeMatrix())

    def lr_scales(self, param: torch.Tensor, group: Mapping[str, Any]) -> list[tuple[str, tuple[int, int], float]]:
        """(block name, block shape, lr multiplier) for each block of `param`."""
        blocks = self.blocks[param]
        shapes = blocks.shapes(tuple(param.shape))
        return [(name, shape, lr_scale(group["lr_scaling"], shape)) for name, shape in zip(blocks.names, shapes)]

    def _scaled_orthogonal(self, matrix: torch.Tensor, param: torch.Tensor, group: Mapping[str, Any]) -> torch.Tensor:
        blocks = self.blocks[param]
        dtype = getattr(torch, group["ns_dtype"])
        return blocks.merge(
            [
                orthogonalize(block, group["ns_steps"], dtype) * lr_scale(group["lr_scaling"], tuple(block.shape))
                for block in blocks.split(matrix)
            ]
        )

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params, groups, updates = [], [], []
        for group in self.param_groups:
            momentum = group["momentum"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(param.grad)
                grad, buffer = _local(param.grad), _local(state["momentum_buffer"])
                buffer.lerp_(grad, 1 - momentum)
                updates.append(grad.lerp(buffer, momentum) if group["nesterov"] else buffer)
                params.append(param)
                groups.append(group)
        orthogonal = map_full_matrices(
            updates, params, lambda i, matrix: self._scaled_orthogonal(matrix, params[i], groups[i])
        )
        for param, group, update in zip(params, groups, orthogonal):
            weights = _local(param)
            if group["weight_decay"]:
                weights.mul_(1 - group["lr"] * group["weight_decay"])
            weights.add_(update, alpha=-group["lr"])
        return loss
