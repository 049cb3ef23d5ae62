"""Error feedback around any optimizer, for one-step-delayed gradients."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

PREVIOUS_UPDATE = "ef_previous_update"
STEPS = "ef_steps"


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@runtime_checkable
class UpdateOptimizer(Protocol):
    """An optimizer whose step is W -= u for each parameter, with u available before it is applied."""

    def updates(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(parameter, u) for every parameter the step changes, u in its local layout; optimizer
        state advances as in a step, weights stay as they are."""
        ...


class ErrorFeedback(Optimizer):
    """`base` with error feedback: w_{t+1} = w_t - u_t - c d (u_t - u_{t-1}), d = `delay`.

    The correction extrapolates the update sequence by the steps the gradient is late: at
    PipeDream-2BW's one-step delay (d = 1) it is the published rule; a gradient d steps old
    takes the last update's change d times (`delay`, from fewer microbatches than stages or
    `training.gradient_delay`), as weight prediction scales its horizon.

    u_t is the update `base` made this step (weights before minus after); the correction
    starts at a parameter's second step. The wrapper shares `base`'s param groups and state,
    and keeps per parameter `ef_previous_update` (u_{t-1}, shaped like the parameter) and
    `ef_steps` in that state, so `base`'s state dict and torchtitan's flat DCP state carry them.
    A step where every group's lr is 0 (torchtitan's `init_optim_state`) only creates that
    state. Parameters without a gradient are left alone. A base with `updates()` (`Muon`, see
    `UpdateOptimizer`) hands u_t over before touching the weights, and the whole step is done in
    place, with no copy of the weights; any other base steps first, and its weights are copied
    once per step to measure u_t. Between steps the only extra memory is `ef_previous_update`.
    `last_correction_norm` is the L2 norm of the last step's correction c d (u_t - u_{t-1})
    over this rank's local shards (None before the first step).
    """

    def __init__(self, base: Optimizer, coefficient: float = 1.0, delay: int = 1) -> None:
        if not 0 <= coefficient <= 2:
            raise ValueError(f"error feedback coefficient must be in [0, 2], got {coefficient}")
        self.base = base
        self.coefficient = coefficient * delay
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
                state[STEPS] = torch.zeros((), dtype=torch.float32, device=_local(param).device)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """With `found_inf` set (a 0-dim tensor, passed on to the base optimizer), a value of 1
        skips the update on the device: weights, u_{t-1} and the step count stay."""
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None:
            self.base.found_inf = found_inf
        try:
            return self._step(closure, None if found_inf is None else found_inf == 0)
        finally:
            if found_inf is not None:
                del self.base.found_inf

    def _step(self, closure: Callable[[], float] | None, keep: torch.Tensor | None) -> float | None:
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        if all(float(group["lr"]) == 0 for group in self.param_groups):
            loss = self.base.step(closure)
            self._create_state(params)
            return loss
        if isinstance(self.base, UpdateOptimizer):
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            self._correct(self.base.updates(), applied=False, keep=keep)
            return loss
        weights = [_local(p) for p in params]
        updates = [w.clone() for w in weights]
        loss = self.base.step(closure)
        for weight, update in zip(weights, updates):
            update.sub_(weight)
        self._correct(list(zip(params, updates)), applied=True, keep=keep)
        return loss

    def _correct(self, updates: list[tuple[torch.Tensor, torch.Tensor]], applied: bool, keep: torch.Tensor | None) -> None:
        """Subtract u_t (unless `applied`) and c (u_t - u_{t-1}) from each parameter; keep u_t.
        Where `keep` is False (a skipped update, u_t = 0) nothing changes."""
        self._create_state([param for param, _ in updates])
        squared_norms = []
        for param, update in updates:
            state = self.state[param]
            weight = _local(param)
            correction = _local(state[PREVIOUS_UPDATE])
            previous = None if keep is None else correction.clone()
            correction.sub_(update).mul_(-self.coefficient * state[STEPS].clamp(max=1))
            if keep is not None:
                correction.mul_(keep)
            if not applied:
                weight.sub_(update)
            weight.sub_(correction)
            squared_norms.append(correction.float().square().sum())
            if keep is None:
                correction.copy_(update)
                state[STEPS] += 1
            else:
                correction.copy_(torch.where(keep, update, previous))
                state[STEPS] += keep
        self.last_correction_norm = torch.stack(squared_norms).sum().sqrt() if squared_norms else None
