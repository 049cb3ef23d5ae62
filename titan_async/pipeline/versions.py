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
from torch.distributed.tensor import DTensor

from titan_async.pipeline.fsdp_streams import param_write_fence


@contextmanager
def preserved_versions(params: list[torch.nn.Parameter]):
    """Let an optimizer update parameters in place without invalidating the graphs that saved them.

    Autograd saved the parameter objects of in-flight microbatches; 2BW updates a buffer
    none of them uses, and PACI's semantics is that their backward sees the new weights."""
    with ExitStack() as stack:
        for param in params:
            stack.enter_context(_unsafe_preserve_version_counter(param))
        yield


def _local(param: torch.Tensor) -> torch.Tensor:
    """The storage this rank holds of `param` (its FSDP shard for a DTensor)."""
    return param._local_tensor if isinstance(param, DTensor) else param.data


class TwoVersions:
    """Two weight versions per parameter; batch t uses version t % 2 (see module docstring).

    Plain parameters switch versions by pointing `param.data` at the other buffer (no copy;
    the live storage is one of the two buffers). FSDP2 parameters cannot: FSDP all-gathers
    from its own shard storage, so their versions are copied into it (two side buffers, and
    FSDP must reshard after forward so that every forward and backward re-gathers).
    """

    def __init__(self, params: list[torch.nn.Parameter], microbatches: int, fence: Callable[[], None] = lambda: None) -> None:
        """`fence` is called after every write to the parameters' storage (`fsdp_streams`)."""
        self.params = params
        self.microbatches = microbatches
        self.fence = fence
        self.in_place = any(isinstance(p, DTensor) for p in params)
        # Until the first update both versions are the live weights (W[-1] = W[0]); a version
        # left None holds the live weights' values and is copied out when first needed, so
        # weights loaded after construction (checkpoint.initial_load_path) become both versions.
        self.buffers = [None if self.in_place else [_local(p) for p in params], None]
        self.active = 0
        self.backwards = Counter()
        self.updates = 0

    def _version(self, index: int) -> list[torch.Tensor]:
        """Buffer `index`, copied from the live weights if it was left None (see __init__)."""
        if self.buffers[index] is None:
            self.buffers[index] = [_local(p).clone() for p in self.params]
        return self.buffers[index]

    def activate(self, batch: int) -> None:
        """Make every parameter hold the version batch `batch` uses."""
        index = batch % 2
        if index == self.active:
            return
        self._version(self.active)
        for param, tensor in zip(self.params, self._version(index)):
            if self.in_place:
                _local(param).copy_(tensor)
            else:
                param.data = tensor
        self.active = index
        self.fence()

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
        self._version(self.active)
        target, source = self._version(batch % 2), self._version((batch + 1) % 2)
        self.updates += 1
        if self.in_place:
            for param, tensor in zip(self.params, source):
                _local(param).copy_(tensor)
        else:
            for tensor, latest in zip(target, source):
                tensor.copy_(latest)
            self.active = -1
            self.activate(batch)
        with preserved_versions(self.params):
            optimizer_step()
        if self.in_place:
            for tensor, param in zip(target, self.params):
                tensor.copy_(_local(param))
        self.active = batch % 2
        self.fence()

    def lr_steps_due(self) -> int:
        """Learning-rate steps owed so far: one per batch applied (counting the one being applied)."""
        return self.updates

    def extra_bytes(self) -> int:
        """Bytes of the version buffers that are not the parameters' own storage."""
        live = {_local(p).untyped_storage().data_ptr() for p in self.params}
        buffers = [t for version in self.buffers if version is not None for t in version]
        return sum(t.untyped_storage().nbytes() for t in buffers if t.untyped_storage().data_ptr() not in live)

    def state_dict(self, names: list[str], step: int) -> dict[str, torch.Tensor]:
        """After `step` steps the parameters hold the latest version U_{step+1} = W[step];
        this is the other one, U_step, which the next batch still uses, sharded like the
        parameters. Never aliases the live parameters (a load fills these tensors while
        the model's own entries fill the parameters)."""
        tensors = self._version(step % 2)
        if not self.in_place and step % 2 == self.active:
            tensors = [t.clone() for t in tensors]
        return {name: _like(param, t) for name, param, t in zip(names, self.params, tensors)}

    def load_state_dict(self, state: dict[str, torch.Tensor], names: list[str], step: int) -> None:
        """Restore both versions after a checkpoint at `step` loaded U_{step+1} into the parameters.

        The model's own load may finish after this one (fused weights are merged afterwards),
        so the live version is copied into its side buffer only when it is first switched away."""
        self.buffers[(step + 1) % 2] = None if self.in_place else [_local(p) for p in self.params]
        self.buffers[step % 2] = [_local(state[name]).clone() for name in names]
        self.active = (step + 1) % 2
        self.backwards.clear()
        self.updates = step


def _like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` as a tensor sharded like `param` (a DTensor view for FSDP parameters)."""
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())


class LocalAccumulation:
    """PACI: step in place after every `accumulation` local backwards, keeping saved graphs valid."""

    def __init__(self, params: list[torch.nn.Parameter], accumulation: int, microbatches: int, fence: Callable[[], None] = lambda: None) -> None:
        """`fence` is called after every local step (`fsdp_streams`)."""
        self.params = params
        self.fence = fence
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
        self.fence()

    def lr_steps_due(self) -> int:
        """Learning-rate steps owed so far: one per `microbatches` local backwards."""
        return self.count // self.microbatches

    def extra_bytes(self) -> int:
        """No weight copies: PACI keeps only the live parameters."""
        return 0

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


def make_policy(schedule: str, module: torch.nn.Module, microbatches: int, accumulation: int | None):
    """The weight-version policy of streaming schedule `schedule` for one stage's parameters,
    with its writes ordered before FSDP's all-gathers on CUDA."""
    params, fence = list(module.parameters()), param_write_fence(module)
    if schedule == "PipeDream2BW":
        return TwoVersions(params, microbatches, fence)
    return LocalAccumulation(params, accumulation or microbatches, microbatches, fence)
