"""PipeDream-2BW's stashed versions of plain (unsharded) parameters (`training.gradient_delay`
without PP, or a pipeline stage without FSDP), and their predicted variant."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch

from titan_async.pipeline.versions.common import preserved_versions


class OneStepDelay:
    """The batch bookkeeping every 2BW implementation shares, for a gradient delay of d = `lag`
    optimizer steps: batch t runs on version t, U_t = W[t - d] (W[j] = W[0] for j < 0), and
    version b + d + 1 = W[b + 1] is computed from version b + d once batch b's gradient is
    complete. d = 1 is PipeDream-2BW's constant one-step delay."""

    def __init__(self, microbatches: int, sync_start: int = 0, lag: int = 1) -> None:
        self.microbatches = microbatches
        self.sync_start = sync_start
        self.lag = lag
        self.backwards = Counter()
        self.updates = 0

    def delay(self, microbatch: int, crossed: int) -> int:
        """The staleness of a backward's gradient in optimizer steps: 0 in the synchronous
        batches, d after (whatever updates it `crossed`: its version is stashed)."""
        return self.lag if microbatch // self.microbatches >= self.sync_start else 0

    def before_forward(self, microbatch: int) -> None:
        self.activate(microbatch // self.microbatches)

    def before_backward(self, microbatch: int) -> None:
        self.activate(microbatch // self.microbatches)

    def after_forward(self, microbatch: int) -> None:
        pass

    def after_backward(self, microbatch: int) -> int | None:
        """The batch whose gradient this backward completed, if it completed one."""
        batch = microbatch // self.microbatches
        self.backwards[batch] += 1
        if self.backwards[batch] < self.microbatches:
            return None
        del self.backwards[batch]
        return batch

    def resize(self, microbatches: int) -> None:
        """Batches of `microbatches` from the next one on (a batch-size ramp). Microbatch ids are
        window * microbatches + j, so with nothing in flight (no batch part done) every later id
        still maps to its window's batch."""
        assert not self.backwards, "resized with microbatches in flight"
        self.microbatches = microbatches
        if isinstance(nested := getattr(self, "buffers", None), OneStepDelay):
            nested.resize(microbatches)

    def lr_steps_due(self) -> int:
        """Learning-rate steps owed so far: one per batch applied (counting the one being applied)."""
        return self.updates

    def update_of_batch(self, batch: int) -> int:
        """The number (1-based, as `updates` counts) of the update that applies batch `batch`."""
        return batch + 1

    def expose_latest(self, step: int) -> None:
        """After `step` steps with nothing in flight, make the parameters hold the latest
        weights, W[step] = U_{step+d}, for checkpoints and validation."""
        self.activate(step + self.lag)

    def step_of_update(self, update: int) -> int:
        """The step (1-based) that fed the batch update `update` applies."""
        return update

    def gathered_copy_bytes(self) -> int:
        """Bytes of gathered (unsharded) weights kept beyond FSDP's own."""
        return 0


class TwoVersions(OneStepDelay):
    """The d + 1 weight versions of plain parameters a delay of d = `lag` steps needs (two for
    PipeDream-2BW's d = 1); batch t uses version t, kept in buffer t % (d + 1) (module docstring).
    Batch b's update writes U_{b+d+1} into the buffer of U_b, which no batch in flight uses
    any more: b's own backwards are done, and every later batch uses a newer version.

    Versions switch by pointing `param.data` at another buffer (no copy; the live storage
    is one of the buffers)."""

    switches_tensors = True
    """Whether the model's tensors (parameters, buffers) change storage between versions: a
    checkpoint must then read the model state live, not from a cache of its tensors."""

    def __init__(self, params: list[torch.nn.Parameter], microbatches: int, sync_start: int = 0, lag: int = 1) -> None:
        super().__init__(microbatches, sync_start, lag)
        self.params = params
        self.slots = lag + 1
        self._all_live()

    def _all_live(self) -> None:
        """Until the first delayed update every version is the live weights (W[-d..0] = W[0], or
        U_N..U_{N+d} = W[N] after N synchronous batches). The other buffers are left None and
        copied from the live weights when first needed (all of them before the first update
        changes the live weights), so weights loaded after construction
        (checkpoint.initial_load_path) become every version."""
        self.active = self.sync_start % self.slots
        self.buffers = [None] * self.slots
        self.buffers[self.active] = [p.data for p in self.params]

    def _version(self, index: int) -> list[torch.Tensor]:
        """Buffer `index`, copied from the live weights if it was left None (see `_all_live`)."""
        if self.buffers[index] is None:
            self.buffers[index] = [p.data.clone() for p in self.params]
        return self.buffers[index]

    def activate(self, batch: int) -> None:
        """Make every parameter hold the version batch `batch` uses (the live weights while synchronous)."""
        index = batch % self.slots
        if batch < self.sync_start or index == self.active:
            return
        self._version(self.active)
        for param, tensor in zip(self.params, self._version(index)):
            param.data = tensor
        self.active = index

    def apply_update(self, batch: int, optimizer_step: Callable[[], None]) -> None:
        """U_{batch+d+1} = U_{batch+d} - Opt(g_batch), written into the buffer batch `batch`
        used; in place while synchronous."""
        self.updates += 1
        if batch >= self.sync_start:
            self.start_update(batch)
        with preserved_versions(self.params):
            optimizer_step()

    def start_update(self, batch: int) -> None:
        """Copy U_{batch+d} into the buffer batch `batch` used and make it the live one, for the
        update to write U_{batch+d+1} there."""
        for index in range(self.slots):  # the versions still pending are the weights before this update
            self._version(index)
        target, source = self.buffers[batch % self.slots], self.buffers[(batch + self.lag) % self.slots]
        for tensor, latest in zip(target, source):
            tensor.copy_(latest)
        self.active = -1
        self.activate(batch)

    def copies(self) -> list[torch.Tensor]:
        """The weight copies kept beyond the live weights (made now if still pending)."""
        return [t for index in range(self.slots) if index != self.active for t in self._version(index)]

    def extra_bytes(self) -> int:
        """Bytes of the version buffers that are not the parameters' own storage."""
        live = {p.data.untyped_storage().data_ptr() for p in self.params}
        buffers = [t for version in self.buffers if version is not None for t in version]
        return sum(t.untyped_storage().nbytes() for t in buffers if t.untyped_storage().data_ptr() not in live)

    def state_dict(self, names: list[str], step: int) -> dict[str, torch.Tensor]:
        """After `step` steps the parameters hold the latest version U_{step+d} = W[step];
        these are the others, U_step (under the parameters' names) and U_{step+i} for
        0 < i < d (under "ahead<i>.<name>"), which the next d batches still use (before the
        switch of a Sync Start, the live weights: no other buffer is made for them). Never
        aliases the live parameters (a load fills these tensors while the model's own
        entries fill the parameters)."""
        state = {}
        for ahead in range(self.lag):
            if step < self.sync_start:
                tensors = [p.data.clone() for p in self.params]
            else:
                index = (step + ahead) % self.slots
                tensors = self._version(index)
                if index == self.active:
                    tensors = [t.clone() for t in tensors]
            state |= {self._key(ahead, name): tensor for name, tensor in zip(names, tensors)}
        return state

    @staticmethod
    def _key(ahead: int, name: str) -> str:
        return f"ahead{ahead}.{name}" if ahead else name

    def load_state_dict(self, state: dict[str, torch.Tensor], names: list[str], step: int) -> None:
        """Restore every version after a checkpoint at `step` loaded U_{step+d} into the parameters."""
        self.backwards.clear()
        self.updates = step
        if step < self.sync_start:
            self._all_live()
            return
        self.buffers[(step + self.lag) % self.slots] = [p.data for p in self.params]
        for ahead in range(self.lag):
            self.buffers[(step + ahead) % self.slots] = [state[self._key(ahead, name)].clone() for name in names]
        self.active = (step + self.lag) % self.slots


class PredictedVersions(TwoVersions):
    """PipeDream-2BW with weight prediction (`optimizer.weight_prediction`, horizon h): batch t
    runs forward and backward on P_t = U_t + h d (U_t - U_{t-1}), where `TwoVersions` would use
    U_t = W[t - d]: the delayed gradient is taken where the weights are predicted to be when it
    is applied, d updates later (d = 1, h = 1: W[k-1] + (W[k-1] - W[k-2]) for W[k]). U_t = W[0]
    for t <= d, so P_0 .. P_d = W[0].

    The d + 1 version buffers hold the predictions of the batches in flight (batch t's in buffer
    t % (d + 1)); one more, `base`, holds the latest U, which the optimizer steps: once batch b's
    gradient is complete, U_{b+d+1} = U_{b+d} - Opt(g_b) in `base`, and P_{b+d+1} = U_{b+d+1} +
    h d (U_{b+d+1} - U_{b+d}) in the buffer batch b used. One weight copy more than
    `TwoVersions`. Between steps (`expose_latest`) the parameters hold `base`, the latest U, for
    checkpoints and validation. Before the first update every buffer equals the live weights, so
    each is copied from them when first needed (weights loaded after construction become all)."""

    def __init__(self, params: list[torch.nn.Parameter], microbatches: int, horizon: float, lag: int = 1) -> None:
        super().__init__(params, microbatches, lag=lag)
        self.horizon = horizon
        self.base: list[torch.Tensor] | None = None

    def _base(self) -> list[torch.Tensor]:
        if self.base is None:
            self.base = [p.data.clone() for p in self.params]
        return self.base

    def _point(self, tensors: list[torch.Tensor], index: int) -> None:
        for param, tensor in zip(self.params, tensors):
            param.data = tensor
        self.active = index

    def activate(self, batch: int) -> None:
        """Make every parameter hold P_batch."""
        if batch % self.slots != self.active:
            self._point(self._version(batch % self.slots), batch % self.slots)

    def apply_update(self, batch: int, optimizer_step: Callable[[], None]) -> None:
        """U_{batch+d+1} = U_{batch+d} - Opt(g_batch) in `base`; P_{batch+d+1} into the buffer batch `batch` used."""
        self.updates += 1
        for index in range(self.slots):  # the predictions still pending are the weights before this update
            self._version(index)
        target, base = self.buffers[batch % self.slots], self._base()
        for tensor, latest in zip(target, base):
            tensor.copy_(latest)
        self._point(base, -1)
        with preserved_versions(self.params):
            optimizer_step()
        ahead = self.horizon * self.lag
        for tensor, latest in zip(target, base):
            tensor.mul_(-ahead).add_(latest, alpha=1 + ahead)

    def expose_latest(self, step: int) -> None:
        """The parameters hold the latest U (before any update, the live weights already do)."""
        if self.base is not None:
            self._point(self.base, -1)

    def copies(self) -> list[torch.Tensor]:
        """The d + 1 predictions and the latest U, less the buffer the parameters hold."""
        live = self.active if self.active >= 0 else None
        kept = [self._version(i) for i in range(self.slots) if i != live] + ([self._base()] if live is not None else [])
        return [t for version in kept for t in version]

    def extra_bytes(self) -> int:
        live = {p.data.untyped_storage().data_ptr() for p in self.params}
        tensors = [t for version in [*self.buffers, self.base] if version is not None for t in version]
        return sum(t.untyped_storage().nbytes() for t in tensors if t.untyped_storage().data_ptr() not in live)

    @staticmethod
    def _key(ahead: int, name: str) -> str:
        return name if ahead == 0 else f"next.{name}" if ahead == 1 else f"next{ahead}.{name}"

    def state_dict(self, names: list[str], step: int) -> dict[str, torch.Tensor]:
        """After `step` steps (drained) the parameters hold U_{step+d}; these are P_step .. P_{step+d},
        under the parameters' names, "next.<name>", then "next<i>.<name>" (copies where a buffer is live)."""
        live = {p.data.untyped_storage().data_ptr() for p in self.params}
        state = {}
        for ahead in range(self.slots):
            for name, tensor in zip(names, self._version((step + ahead) % self.slots)):
                state[self._key(ahead, name)] = tensor.clone() if tensor.untyped_storage().data_ptr() in live else tensor
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor], names: list[str], step: int) -> None:
        """Restore every prediction after a checkpoint at `step` loaded U_{step+d} into the parameters."""
        self.backwards.clear()
        self.updates = step
        self.base = [p.data for p in self.params]
        for ahead in range(self.slots):
            self.buffers[(step + ahead) % self.slots] = [state[self._key(ahead, name)].clone() for name in names]
        self.active = -1
