"""Weight-version policies: when a stage's optimizer steps and which weights each microbatch sees.

- `TwoVersions` (PipeDream-2BW, and `training.gradient_delay = 1` without PP): batch t runs
  forward and backward on version U_t; once batch b's gradient g_b is complete the stage
  computes U_{b+2} = U_{b+1} - Opt(g_b) into the buffer batch b used. Net effect on every
  stage: W[k+1] = W[k] - Opt(grad f_k(W[k-1])), W[-1] = W[0].
- `LocalAccumulation` (PACI): no stash; after every `a` local backwards the stage steps its
  optimizer in place, so a microbatch may see newer weights in its backward than in its forward.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack, contextmanager

import torch
from torch.autograd import _unsafe_preserve_version_counter


@contextmanager
def preserved_versions(params: list[torch.nn.Parameter]):
    """Let an optimizer update parameters in place without invalidating the graphs that saved them.

    Autograd saved the parameter objects of in-flight microbatches; 2BW updates a buffer
    none of them uses, and PACI's semantics is that their backward sees the new weights."""
    with ExitStack() as stack:
        for param in params:
            stack.enter_context(_unsafe_preserve_version_counter(param))
        yield


class TwoVersions:
    """Two weight buffers per parameter; batch t uses buffer t % 2 (see module docstring)."""

    def __init__(self, params: list[torch.nn.Parameter], microbatches: int) -> None:
        self.params = params
        self.microbatches = microbatches
        self.buffers = [[p.data for p in params], [p.data.clone() for p in params]]
        self.active = 0
        self.backwards = Counter()
        self.updates = 0

    def activate(self, batch: int) -> None:
        """Point every parameter at the version batch `batch` uses."""
        index = batch % 2
        if index != self.active:
            for param, tensor in zip(self.params, self.buffers[index]):
                param.data = tensor
            self.active = index

    def before_forward(self, microbatch: int) -> None:
        self.activate(microbatch // self.microbatches)

    before_backward = before_forward

    def after_backward(self, microbatch: int) -> int | None:
        """The batch whose gradient this backward completed, if it completed one."""
        batch = microbatch // self.microbatches
        self.backwards[batch] += 1
        if self.backwards[batch] < self.microbatches:
            return None
        del self.backwards[batch]
        return batch

    def apply_update(self, batch: int, optimizer_step: Callable[[], None]) -> None:
        """U_{batch+2} = U_{batch+1} - Opt(g_batch), written into the buffer batch `batch` used."""
        for target, source in zip(self.buffers[batch % 2], self.buffers[(batch + 1) % 2]):
            target.copy_(source)
        self.activate(batch)
        self.updates += 1
        with preserved_versions(self.params):
            optimizer_step()

    def lr_steps_due(self) -> int:
        """Learning-rate steps owed so far: one per batch applied (counting the one being applied)."""
        return self.updates

    def state_dict(self, names: list[str], step: int) -> dict[str, torch.Tensor]:
        """After `step` steps the parameters hold the latest version U_{step+1} = W[step];
        this is the other one, U_step, which the next batch still uses. Never aliases the live
        parameters (a load fills these tensors while the model's own entries fill the parameters)."""
        tensors = self.buffers[step % 2]
        if step % 2 == self.active:
            tensors = [t.clone() for t in tensors]
        return dict(zip(names, tensors))

    def load_state_dict(self, state: dict[str, torch.Tensor], names: list[str], step: int) -> None:
        """Restore both versions after a checkpoint at `step` loaded U_{step+1} into the parameters."""
        self.buffers[(step + 1) % 2] = [p.data for p in self.params]
        self.buffers[step % 2] = [state[name].clone() for name in names]
        self.active = (step + 1) % 2
        self.backwards.clear()
        self.updates = step


class LocalAccumulation:
    """PACI: step in place after every `accumulation` local backwards, keeping saved graphs valid."""

    def __init__(self, params: list[torch.nn.Parameter], accumulation: int, microbatches: int) -> None:
        self.params = params
        self.accumulation = accumulation
        self.microbatches = microbatches
        self.count = 0
        self.updates = 0

    def before_forward(self, microbatch: int) -> None:
        pass

    before_backward = before_forward

    def after_backward(self, microbatch: int) -> int | None:
        self.count += 1
        return self.count // self.accumulation if self.count % self.accumulation == 0 else None

    def apply_update(self, batch: int, optimizer_step: Callable[[], None]) -> None:
        """Update in place; in-flight backwards read the new weights."""
        self.updates += 1
        with preserved_versions(self.params):
            optimizer_step()

    def lr_steps_due(self) -> int:
        """Learning-rate steps owed so far: one per `microbatches` local backwards."""
        return self.count // self.microbatches

    def state_dict(self, names: list[str], step: int) -> dict[str, torch.Tensor]:
        """Backward count and the gradients accumulated since the last local step."""
        state = {"count": torch.tensor(self.count)}
        for name, param in zip(names, self.params):
            state[f"grad.{name}"] = param.grad if param.grad is not None else torch.zeros_like(param)
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor], names: list[str], step: int) -> None:
        self.count = int(state["count"])
        self.updates = self.count // self.accumulation
        for name, param in zip(names, self.params):
            param.grad = state[f"grad.{name}"].clone()


def make_policy(schedule: str, params: list[torch.nn.Parameter], microbatches: int, accumulation: int | None):
    """The weight-version policy of streaming schedule `schedule` for one stage's parameters."""
    if schedule == "PipeDream2BW":
        return TwoVersions(params, microbatches)
    return LocalAccumulation(params, accumulation or microbatches, microbatches)
