"""Error feedback around any optimizer, for one-step-delayed gradients."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

PREVIOUS_UPDATE = "ef_previous_update"
STEPS = "ef_steps"


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class ErrorFeedback(Optimizer):
    """`base` with error feedback: w_{t+1} = w_t - u_t - c (u_t - u_{t-1}).

    u_t is the update `base` made this step (weights before minus after); the correction
    starts at a parameter's second step. The wrapper shares `base`'s param groups and state,
    and keeps per parameter `ef_previous_update` (u_{t-1}, shaped like the parameter) and
    `ef_steps` in that state, so `base`'s state dict and torchtitan's flat DCP state carry them.
    A step where every group's lr is 0 (torchtitan's `init_optim_state`) only creates that
    state. Parameters without a gradient are left alone. During a step the weights are copied
    once (to measure u_t); between steps the only extra memory is `ef_previous_update`.
    `last_correction_norm` is the L2 norm of the last step's correction c (u_t - u_{t-1})
    over this rank's local shards (None before the first step).
    """

    def __init__(self, base: Optimizer, coefficient: float = 1.0) -> None:
        if not 0 <= coefficient <= 2:
            raise ValueError(f"error feedback coefficient must be in [0, 2], got {coefficient}")
        self.base = base
        self.coefficient = coefficient
        self.last_correction_norm: torch.Tensor | None = None
        # Sets up Optimizer's hook tables without registering parameters of its own.
        Optimizer.__setstate__(self, {"defaults": base.defaults})

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.base.param_groups

    @property
    def state(self) -> dict[torch.Tensor, Any]:
        return self.base.state

    def state_dict(self) -> dict[str, Any]:
        return self.base.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.base.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.base.zero_grad(set_to_none=set_to_none)

    def _create_state(self, params: list[torch.Tensor]) -> None:
        for param in params:
            state = self.state[param]
            if PREVIOUS_UPDATE not in state:
                state[PREVIOUS_UPDATE] = torch.zeros_like(param)
                state[STEPS] = torch.zeros((), dtype=torch.float32)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        if all(float(group["lr"]) == 0 for group in self.param_groups):
            loss = self.base.step(closure)
            self._create_state(params)
            return loss
        weights = [_local(p) for p in params]
        updates = [w.clone() for w in weights]
        loss = self.base.step(closure)
        self._create_state(params)
        squared_norms = []
        for param, weight, update in zip(params, weights, updates):
            state = self.state[param]
            update.sub_(weight)
            correction = _local(state[PREVIOUS_UPDATE])
            correction.sub_(update).mul_(-self.coefficient * state[STEPS].clamp(max=1))
            weight.sub_(correction)
            squared_norms.append(correction.float().square().sum())
            correction.copy_(update)
            state[STEPS] += 1
        self.last_correction_norm = torch.stack(squared_norms).sum().sqrt() if squared_norms else None
        return loss
