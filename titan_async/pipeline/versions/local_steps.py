"""PACI's policies: local steps in place after every `a` backwards, no stash."""

from __future__ import annotations

from collections.abc import Callable

import torch

from titan_async.parallel.fsdp_stage import FsdpStage
from titan_async.pipeline.versions.common import local_storage, preserved_versions, sharded_like


class LocalAccumulation:
    """PACI: step in place after every `accumulation` local backwards, keeping saved graphs valid.

    A backward reads the weights current when it runs. Without activation checkpointing it
    combines them with the activations its forward saved (the forward's weights): PACI's rule.
    Under full activation checkpointing each block first recomputes its forward from the input
    the forward stored, with the current weights, so the block's backward is its gradient at the
    current weights (PACI's "mem" mode; modules outside blocks keep the first rule). Selective
    checkpointing would keep some outputs of a block's forward and recompute the rest, a mix of
    both rules: the config refuses it (`pipeline.config.check_activation_checkpoint`).

    Under FSDP2 the stage reduces its gradients right before each local step and re-gathers
    after it, so in-flight backwards read the new weights."""

    switches_tensors = False
    """The weights stay in their tensors (see `TwoVersions.switches_tensors`)."""

    def __init__(self, params: list[torch.nn.Parameter], accumulation: int, microbatches: int, stage: FsdpStage | None = None,
                 sync_start: int = 0) -> None:
        self.params = params
        self.stage = stage
        self.accumulation = accumulation
        self.microbatches = microbatches
        self.synchronous_backwards = sync_start * microbatches
        """The backwards of the synchronous batches: each `microbatches` of them make one update."""
        self.count = 0
        self.updates = 0

    def before_forward(self, microbatch: int) -> None:
        pass

    before_backward = after_forward = before_forward

    def _updates_after(self, count: int) -> int:
        """The updates made once `count` local backwards have run."""
        sync = self.synchronous_backwards
        if count <= sync:
            return count // self.microbatches
        return sync // self.microbatches + (count - sync) // self.accumulation

    def _pending(self) -> int:
        """The local backwards since the last update (accumulated in the gradients)."""
        sync = self.synchronous_backwards
        return self.count % self.microbatches if self.count <= sync else (self.count - sync) % self.accumulation

    def after_backward(self, microbatch: int) -> int | None:
        self.count += 1
        return None if self._pending() else self._updates_after(self.count)

    def delay(self, microbatch: int, crossed: int) -> int:
        """The staleness of a backward's gradient: the local updates it `crossed` since its forward."""
        return crossed

    def apply_update(self, batch: int, optimizer_step: Callable[[], None]) -> None:
        """Update in place; in-flight backwards read the new weights."""
        self.updates += 1
        if self.stage:
            self.stage.reduce()
        with preserved_versions(self.params):
            optimizer_step()
        if self.stage:
            self.stage.fence()
            self.stage.reshard()

    def lr_steps_due(self) -> int:
        """Learning-rate steps owed so far: one per `microbatches` local backwards."""
        return self.count // self.microbatches

    def update_of_batch(self, batch: int) -> int:
        """The number (1-based, as `updates` counts; 0: none yet) of the last update whose
        microbatches all belong to batches up to `batch`: update u covers microbatches
        [(u - 1) a, u a) on every stage (after the synchronous batches' updates, one per batch)."""
        return self._updates_after((batch + 1) * self.microbatches)

    def step_of_update(self, update: int) -> int:
        """The step (1-based) that fed the batch holding update `update`'s last microbatch (one
        update per batch while synchronous)."""
        synchronous = self.synchronous_backwards // self.microbatches
        if update <= synchronous:
            return update
        return synchronous + ((update - synchronous) * self.accumulation - 1) // self.microbatches + 1

    def extra_bytes(self) -> int:
        """No weight copies: PACI keeps only the live parameters."""
        return 0

    gathered_copy_bytes = extra_bytes

    def state_dict(self, names: list[str], step: int) -> dict[str, torch.Tensor]:
        """Backward count and the gradients accumulated since the last local step (reduced,
        when FSDP held them unsharded)."""
        if self.stage and self._pending():
            self.stage.reduce()
        state = {"count": torch.tensor(self.count)}
        for name, param in zip(names, self.params):
            state[f"grad.{name}"] = param.grad if param.grad is not None else torch.zeros_like(param)
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor], names: list[str], step: int) -> None:
        self.count = int(state["count"])
        self.updates = self._updates_after(self.count)
        for name, param in zip(names, self.params):
            param.grad = state[f"grad.{name}"].clone()


class PredictedAccumulation(LocalAccumulation):
    """PACI with weight prediction: a stage whose microbatches cross d of its local steps
    between forward and backward (on average; d = (p - 1 - s) / a in a steady window) runs each
    forward at W + `horizon` (W - W_prev), `horizon` = h d, W_prev the weights before its last
    local step: the activations a backward combines with the current weights come from weights
    predicted to be nearer to them. The prediction is written into the live weights for the
    forward and the weights are copied back after it, so that the backward reads the current
    weights wherever the forward saved them (the parameter, or a view of it such as a linear
    layer's transposed weight), as PACI's. W_prev and the copy of the live weights are two
    weight copies; W_prev is checkpointed.

    Under FSDP2 each rank predicts its own shards (the prediction is elementwise) and the stage
    reshards after writing them, before the forward and after it: the forward gathers the
    prediction, and the next action gathers the current weights into the storage the forward's
    saved views share (as `LocalAccumulation`'s in-flight backwards read a local step's
    weights). That is two all-gathers per forward on a stage that predicts."""

    def __init__(self, params: list[torch.nn.Parameter], accumulation: int, microbatches: int, horizon: float,
                 stage: FsdpStage | None = None) -> None:
        super().__init__(params, accumulation, microbatches, stage)
        self.horizon = horizon
        self.before: list[torch.Tensor] | None = None
        """W_prev: the weights (local shards) before the last local step (None until the first)."""
        self.live: list[torch.Tensor] | None = None
        """A copy of the live weights W, restored after each forward at the prediction."""
        self.live_current = False
        """Whether `live` holds W (it is taken again after a local step or a load)."""
        self.predicting = False

    def _written(self) -> None:
        """After writing the shards: FSDP gathers them next."""
        if self.stage:
            self.stage.reshard()

    @torch.no_grad()
    def before_forward(self, microbatch: int) -> None:
        """Write W + horizon (W - W_prev) into the parameters (before the first step, W itself)."""
        if self.before is None:
            return
        if self.live is None:
            self.live = [local_storage(p).clone() for p in self.params]
        elif not self.live_current:
            for live, param in zip(self.live, self.params):
                live.copy_(local_storage(param))
        self.live_current = True
        for param, before in zip(self.params, self.before):
            local_storage(param).mul_(1 + self.horizon).sub_(before, alpha=self.horizon)
        self._written()
        self.predicting = True

    @torch.no_grad()
    def after_forward(self, microbatch: int) -> None:
        if self.predicting:
            for param, live in zip(self.params, self.live):
                local_storage(param).copy_(live)
            self._written()
            self.predicting = False

    def apply_update(self, batch: int, optimizer_step: Callable[[], None]) -> None:
        if self.before is None:
            self.before = [local_storage(p).clone() for p in self.params]
        else:
            for saved, param in zip(self.before, self.params):
                saved.copy_(local_storage(param))
        super().apply_update(batch, optimizer_step)
        self.live_current = False

    def extra_bytes(self) -> int:
        """W_prev and the copy of the live weights."""
        return sum(t.untyped_storage().nbytes() for t in (self.before or []) + (self.live or []))

    gathered_copy_bytes = LocalAccumulation.extra_bytes

    def copies(self) -> list[torch.Tensor]:
        """W_prev and the copy of the live weights (made now if pending)."""
        return [t for kept in (self.before, self.live) for t in kept or [local_storage(p).clone() for p in self.params]]

    def state_dict(self, names: list[str], step: int) -> dict[str, torch.Tensor]:
        """PACI's state and W_prev (the live weights before the first step), sharded like the parameters."""
        state = super().state_dict(names, step)
        before = self.before or [local_storage(p).clone() for p in self.params]
        state.update({f"before.{name}": sharded_like(param, t) for name, param, t in zip(names, self.params, before)})
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor], names: list[str], step: int) -> None:
        super().load_state_dict(state, names, step)
        self.before = [local_storage(state[f"before.{name}"]).clone() for name in names] if self.updates else None
        self.live_current = False
