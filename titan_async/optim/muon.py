"""Muon: momentum orthogonalised per matrix block, for 2-D hidden-layer parameters."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from titan_async.optim.blocks import ExpertBlocks, MatrixBlocks, WholeMatrix
from titan_async.optim.full_matrix import exchange_group, map_full_matrices
from titan_async.optim.newton_schulz import NS_DTYPES, flops, resolve_dtype
from titan_async.optim.newton_schulz_batched import orthogonalize_all

LrScaling = Literal["original", "match_rms_adamw"]
NsDtype = Literal["auto", "float32", "bfloat16"]

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
    """Muon for 2-D parameters and 3-D stacks of expert matrices (plain, or DTensors sharded by
    FSDP2, TP or both).

    For a parameter W with gradient G and momentum buffer B:
    B <- mu B + (1 - mu) G; M = (1 - mu) G + mu B with Nesterov, else M = B;
    W <- W - u with u = lr (O + wd W), where O's blocks (see `blocks`) are each
    orthogonalize(M_block) * lr_scale(lr_scaling, block shape). O is always computed on the
    full logical matrix (see `map_full_matrices`), never per shard: each matrix on one owner
    rank of the ranks that shard it, owners balanced by Newton-Schulz FLOPs, and each rank runs one
    batched iteration per distinct block shape over all the blocks it holds (Q, K and V of a
    fused matrix are blocks like any other; see `orthogonalize_all`, which in float32 takes the
    cheaper Gram form for wide blocks). ns_dtype "auto" iterates in bfloat16 on CUDA and in
    float32 elsewhere.

    `blocks` maps parameter names (the groups' `param_names`) to their block layout;
    other parameters are one block. A matrix split over several mesh dimensions (FSDP x TP) is
    exchanged over a group that `create_exchange_groups` made beforehand, on every rank
    (`RoutedOptimizersContainer` does).
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
        ns_dtype: NsDtype = "auto",
        lr_scaling: LrScaling = "match_rms_adamw",
        blocks: Mapping[str, MatrixBlocks] | None = None,
    ) -> None:
        if lr < 0:
            raise ValueError(f"Muon lr must be >= 0, got {lr}")
        if not 0 <= momentum < 1:
            raise ValueError(f"Muon momentum must be in [0, 1), got {momentum}")
        if ns_steps < 1:
            raise ValueError(f"Muon ns_steps must be >= 1, got {ns_steps}")
        if ns_dtype not in NS_DTYPES:
            raise ValueError(f"Muon ns_dtype must be one of {', '.join(NS_DTYPES)}, got {ns_dtype!r}")
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
                self.blocks[param] = blocks.get(name, WholeMatrix())
                if param.ndim != 2 and not (param.ndim == 3 and isinstance(self.blocks[param], ExpertBlocks)):
                    raise ValueError(f"Muon takes 2-D parameters (3-D with ExpertBlocks) only; {name} has shape {tuple(param.shape)}")
                exchange_group(param)  # fails now, not at the first step, if its group was never made

    def lr_scales(self, param: torch.Tensor, group: Mapping[str, Any]) -> list[tuple[str, tuple[int, int], float]]:
        """(block name, block shape, lr multiplier) for each block of `param`."""
        blocks = self.blocks[param]
        shapes = blocks.shapes(tuple(param.shape))
        return [(name, shape, lr_scale(group["lr_scaling"], shape)) for name, shape in zip(blocks.names, shapes)]

    def newton_schulz_flops(self, param: torch.Tensor, group: Mapping[str, Any]) -> int:
        """FLOPs of orthogonalising the blocks of `param` (full logical shape) once."""
        dtype = resolve_dtype(group["ns_dtype"], param.device)
        return sum(flops(shape, group["ns_steps"], dtype) for shape in self.blocks[param].shapes(tuple(param.shape)))

    def _orthogonal_updates(
        self, matrices: list[torch.Tensor], params: list[torch.Tensor], groups: list[Mapping[str, Any]]
    ) -> list[torch.Tensor]:
        """lr * O for each full matrix; the blocks of all of them go through `orthogonalize_all`
        together, per (ns_steps, iteration dtype)."""
        splits = [self.blocks[param].split(matrix) for matrix, param in zip(matrices, params)]
        settings: dict[tuple[int, torch.dtype], list[tuple[int, int]]] = {}
        for k, (matrix, group) in enumerate(zip(matrices, groups)):
            key = (group["ns_steps"], resolve_dtype(group["ns_dtype"], matrix.device))
            settings.setdefault(key, []).extend((k, b) for b in range(len(splits[k])))
        for (steps, dtype), members in settings.items():
            for (k, b), result in zip(members, orthogonalize_all([splits[k][b] for k, b in members], steps, dtype)):
                scale = groups[k]["lr"] * lr_scale(groups[k]["lr_scaling"], tuple(result.shape))
                splits[k][b] = result * scale
        return [self.blocks[param].merge(blocks) for param, blocks in zip(params, splits)]

    @torch.no_grad()
    def updates(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(parameter, u) for every parameter with a gradient, u in the parameter's local layout.

        Advances the momentum buffers and leaves the weights alone: `step` is W -= u. Every
        rank of an FSDP group must call this at the same time (it exchanges the matrices).
        With `found_inf` set (a 0-dim tensor, as torch's fused optimizers take it), a value of
        1 skips the update on the device: the buffers stay and every u is zero.
        """
        found_inf = getattr(self, "found_inf", None)
        keep = None if found_inf is None else (found_inf == 0)
        params, groups, momenta = [], [], []
        for group in self.param_groups:
            momentum = group["momentum"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(param.grad)
                grad, buffer = _local(param.grad), _local(state["momentum_buffer"])
                if keep is None:
                    buffer.lerp_(grad, 1 - momentum)
                else:
                    buffer.copy_(torch.where(keep, buffer.lerp(grad, 1 - momentum), buffer))
                momenta.append(grad.lerp(buffer, momentum) if group["nesterov"] else buffer)
                params.append(param)
                groups.append(group)
        updates = map_full_matrices(
            momenta,
            params,
            lambda indices, matrices: self._orthogonal_updates(
                matrices, [params[i] for i in indices], [groups[i] for i in indices]
            ),
            costs=[self.newton_schulz_flops(param, group) for param, group in zip(params, groups)],
        )
        for param, group, update in zip(params, groups, updates):
            if group["weight_decay"]:
                update.add_(_local(param), alpha=group["lr"] * group["weight_decay"])
            if keep is not None:
                update.mul_(keep)
        return list(zip(params, updates))

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for param, update in self.updates():
            _local(param).sub_(update)
        return loss
