"""Weight-version policies: when a stage's optimizer steps and which weights each microbatch sees.

- `TwoVersions` and `ShardedTwoVersions` (PipeDream-2BW, and `training.gradient_delay = 1`
  without PP; plain and FSDP2 parameters): batch t runs forward and backward on version
  U_t; once batch b's gradient g_b is complete the stage computes U_{b+2} = U_{b+1} - Opt(g_b)
  in place of U_b. Net effect on every stage: W[k+1] = W[k] - Opt(grad f_k(W[k-1])), W[-1] = W[0].
- `PredictedVersions` and `ShardedPredictedVersions` (PipeDream-2BW with weight prediction;
  plain and FSDP2 parameters): batch t runs on the versions extrapolated along the last update,
  P_t = U_t + h (U_t - U_{t-1}).
- `PredictedAccumulation` (PACI with weight prediction; plain and FSDP2 parameters): forwards
  run at the weights extrapolated along the stage's last local step by its mean delay.
- `LocalAccumulation` (PACI): no stash; after every `a` local backwards the stage steps its
  optimizer in place, so a microbatch may see newer weights in its backward than in its forward
  (see its docstring for what activation checkpointing changes).

Under FSDP2 (torchtitan's replicas and TP stages included: FSDP2 wraps them too) the policies
keep and predict each rank's own shards: the extrapolation is elementwise, so the gathered
prediction is the prediction of the gathered weights.

Sync Start (`sync_start` = N > 0, `training.sync_start_steps`): batches 0..N-1 are synchronous,
W[k+1] = W[k] - Opt(grad f_k(W[k])): one in-place update per batch with the whole batch's
gradient, the trainer draining the stream after each of them so that no microbatch crosses an
update. From batch N on each policy runs its rule as a fresh policy would from W[N], numbers
shifted by N: 2BW's second version appears at the switch (U_N = U_{N+1} = W[N]), PACI counts
its `a` backwards from the switch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack, contextmanager

import torch
from torch.autograd import _unsafe_preserve_version_counter
from torch.distributed.tensor import DTensor

from titan_async.parallel.fsdp_stage import FsdpStage, exchange_storage, spare_storage
from titan_async.pipeline.load_balance import versioned_tensors


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


class OneStepDelay:
    """The batch bookkeeping both 2BW implementations share: batch t runs on version t, and
    version b + 2 is computed from b + 1 once batch b's gradient is complete."""

    def __init__(self, microbatches: int, sync_start: int = 0) -> None:
        self.microbatches = microbatches
        self.sync_start = sync_start
        self.backwards = Counter()
        self.updates = 0

    def delay(self, microbatch: int, crossed: int) -> int:
        """The staleness of a backward's gradient in optimizer steps: 0 in the synchronous
        batches, 1 after (whatever updates it `crossed`: its version is stashed)."""
        return int(microbatch // self.microbatches >= self.sync_start)

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

    def lr_steps_due(self) -> int:
        """Learning-rate steps owed so far: one per batch applied (counting the one being applied)."""
        return self.updates

    def update_of_batch(self, batch: int) -> int:
        """The number (1-based, as `updates` counts) of the update that applies batch `batch`."""
        return batch + 1

    def expose_latest(self, step: int) -> None:
        """After `step` steps with nothing in flight, make the parameters hold the latest
        weights, W[step] = U_{step+1}, for checkpoints and validation."""
        self.activate(step + 1)

    def step_of_update(self, update: int) -> int:
        """The step (1-based) that fed the batch update `update` applies."""
        return update

    def gathered_copy_bytes(self) -> int:
        """Bytes of gathered (unsharded) weights kept beyond FSDP's own."""
        return 0


class TwoVersions(OneStepDelay):
    """Two weight versions of plain parameters; batch t uses version t % 2 (module docstring).

    Versions switch by pointing `param.data` at the other buffer (no copy; the live storage
    is one of the two buffers)."""

    switches_tensors = True
    """Whether the model's tensors (parameters, buffers) change storage between versions: a
    checkpoint must then read the model state live, not from a cache of its tensors."""

    def __init__(self, params: list[torch.nn.Parameter], microbatches: int, sync_start: int = 0) -> None:
        super().__init__(microbatches, sync_start)
        self.params = params
        self._both_live()

    def _both_live(self) -> None:
        """Until the first delayed update both versions are the live weights (W[-1] = W[0], or
        U_N = U_{N+1} = W[N] after N synchronous batches). The buffer of version N + 1 is left
        None and copied from the live weights when first needed, so weights loaded after
        construction (checkpoint.initial_load_path) become both versions."""
        self.active = self.sync_start % 2
        self.buffers = [None, None]
        self.buffers[self.active] = [p.data for p in self.params]

    def _version(self, index: int) -> list[torch.Tensor]:
        """Buffer `index`, copied from the live weights if it was left None (see __init__)."""
        if self.buffers[index] is None:
            self.buffers[index] = [p.data.clone() for p in self.params]
        return self.buffers[index]

    def activate(self, batch: int) -> None:
        """Make every parameter hold the version batch `batch` uses (the live weights while synchronous)."""
        index = batch % 2
        if batch < self.sync_start or index == self.active:
            return
        self._version(self.active)
        for param, tensor in zip(self.params, self._version(index)):
            param.data = tensor
        self.active = index

    def apply_update(self, batch: int, optimizer_step: Callable[[], None]) -> None:
        """U_{batch+2} = U_{batch+1} - Opt(g_batch), written into the buffer batch `batch` used;
        in place while synchronous."""
        self.updates += 1
        if batch >= self.sync_start:
            self.start_update(batch)
        with preserved_versions(self.params):
            optimizer_step()

    def start_update(self, batch: int) -> None:
        """Copy U_{batch+1} into the buffer batch `batch` used and make it the live one, for the
        update to write U_{batch+2} there."""
        target, source = self._version(batch % 2), self._version((batch + 1) % 2)
        for tensor, latest in zip(target, source):
            tensor.copy_(latest)
        self.active = -1
        self.activate(batch)

    def copies(self) -> list[torch.Tensor]:
        """The weight copy kept beyond the live weights (made now if still pending)."""
        return self._version(1 - self.active)

    def extra_bytes(self) -> int:
        """Bytes of the version buffers that are not the parameters' own storage."""
        live = {p.data.untyped_storage().data_ptr() for p in self.params}
        buffers = [t for version in self.buffers if version is not None for t in version]
        return sum(t.untyped_storage().nbytes() for t in buffers if t.untyped_storage().data_ptr() not in live)

    def state_dict(self, names: list[str], step: int) -> dict[str, torch.Tensor]:
        """After `step` steps the parameters hold the latest version U_{step+1} = W[step];
        this is the other one, U_step, which the next batch still uses (before the switch
        of a Sync Start, the live weights: no second buffer is made for it). Never aliases
        the live parameters (a load fills these tensors while the model's own entries fill
        the parameters)."""
        if step < self.sync_start:
            return {name: p.data.clone() for name, p in zip(names, self.params)}
        tensors = self._version(step % 2)
        if step % 2 == self.active:
            tensors = [t.clone() for t in tensors]
        return dict(zip(names, tensors))

    def load_state_dict(self, state: dict[str, torch.Tensor], names: list[str], step: int) -> None:
        """Restore both versions after a checkpoint at `step` loaded U_{step+1} into the parameters."""
        self.backwards.clear()
        self.updates = step
        if step < self.sync_start:
            self._both_live()
            return
        self.buffers[(step + 1) % 2] = [p.data for p in self.params]
        self.buffers[step % 2] = [state[name].clone() for name in names]
        self.active = (step + 1) % 2


class PredictedVersions(TwoVersions):
    """PipeDream-2BW with weight prediction (`optimizer.weight_prediction`, horizon h): batch t
    runs forward and backward on P_t = U_t + h (U_t - U_{t-1}), where `TwoVersions` would use
    U_t: the delayed gradient is taken where the weights are predicted to be when it is applied
    (h = 1: W[k-1] + (W[k-1] - W[k-2]) for W[k]). U_0 = U_1 = W[0], so P_0 = P_1 = W[0].

    The two version buffers hold the predictions of the batches in flight; a third, `base`,
    holds the latest U, which the optimizer steps: once batch b's gradient is complete,
    U_{b+2} = U_{b+1} - Opt(g_b) in `base`, and P_{b+2} = U_{b+2} + h (U_{b+2} - U_{b+1}) in the
    buffer batch b used. One weight copy more than `TwoVersions`. Between steps (`expose_latest`)
    the parameters hold `base`, the latest U, for checkpoints and validation. Before the first
    update every buffer equals the live weights, so each is copied from them when first needed
    (weights loaded after construction become all three)."""

    def __init__(self, params: list[torch.nn.Parameter], microbatches: int, horizon: float) -> None:
        super().__init__(params, microbatches)
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
        if batch % 2 != self.active:
            self._point(self._version(batch % 2), batch % 2)

    def apply_update(self, batch: int, optimizer_step: Callable[[], None]) -> None:
        """U_{batch+2} = U_{batch+1} - Opt(g_batch) in `base`; P_{batch+2} into the buffer batch `batch` used."""
        self.updates += 1
        target, _ = self._version(batch % 2), self._version((batch + 1) % 2)
        base = self._base()
        for tensor, latest in zip(target, base):
            tensor.copy_(latest)
        self._point(base, -1)
        with preserved_versions(self.params):
            optimizer_step()
        for tensor, latest in zip(target, base):
            tensor.mul_(-self.horizon).add_(latest, alpha=1 + self.horizon)

    def expose_latest(self, step: int) -> None:
        """The parameters hold the latest U (before any update, the live weights already do)."""
        if self.base is not None:
            self._point(self.base, -1)

    def copies(self) -> list[torch.Tensor]:
        """The two predictions and the latest U, less the buffer the parameters hold."""
        live = self.active if self.active >= 0 else None
        kept = [self._version(i) for i in (0, 1) if i != live] + ([self._base()] if live is not None else [])
        return [t for version in kept for t in version]

    def extra_bytes(self) -> int:
        live = {p.data.untyped_storage().data_ptr() for p in self.params}
        tensors = [t for version in [*self.buffers, self.base] if version is not None for t in version]
        return sum(t.untyped_storage().nbytes() for t in tensors if t.untyped_storage().data_ptr() not in live)

    def state_dict(self, names: list[str], step: int) -> dict[str, torch.Tensor]:
        """After `step` steps (drained) the parameters hold U_{step+1}; these are P_step, under the
        parameters' names, and P_{step+1}, under "next.<name>" (copies where a buffer is live)."""
        live = {p.data.untyped_storage().data_ptr() for p in self.params}
        state = {}
        for prefix, index in (("", step % 2), ("next.", (step + 1) % 2)):
            for name, tensor in zip(names, self._version(index)):
                state[prefix + name] = tensor.clone() if tensor.untyped_storage().data_ptr() in live else tensor
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor], names: list[str], step: int) -> None:
        """Restore both predictions after a checkpoint at `step` loaded U_{step+1} into the parameters."""
        self.backwards.clear()
        self.updates = step
        self.base = [p.data for p in self.params]
        self.buffers[step % 2] = [state[name].clone() for name in names]
        self.buffers[(step + 1) % 2] = [state[f"next.{name}"].clone() for name in names]
        self.active = -1


class ShardedTwoVersions(OneStepDelay):
    """2BW's two versions of FSDP2 parameters (same rule as `TwoVersions`).

    Shards: FSDP all-gathers from the parameters' own shard storage, which holds one version
    (`shard_version`); one side shard holds the other. Gathered: FSDP's unsharded parameters
    hold one version (`gathered_version`) and, once a stage has gathered both (2BW's tail
    backwards run on the older one while the forwards run on the newer), a gathered side
    buffer holds the other on a stage that holds its units gathered, so that each version is
    all-gathered once. Switching to the side shard or the side buffer exchanges storages
    (`fsdp_stage.exchange_storage`): no bytes are copied. Invariant: when the latest version
    is active and gathered, the shard holds it too (checkpoints save the shard, and the next
    update starts from it).
    """

    def __init__(self, params: list[torch.nn.Parameter], microbatches: int, stage: FsdpStage,
                 buffers: list[torch.Tensor] = (), sync_start: int = 0) -> None:
        """`buffers`: unsharded tensors versioned with the weights (MoE expert biases), kept as
        `TwoVersions` keeps plain parameters."""
        super().__init__(microbatches, sync_start)
        self.params, self.stage = params, stage
        self.buffers = TwoVersions(list(buffers), microbatches, sync_start) if buffers else None
        self.spare: list[torch.Tensor] | None = None
        self._both_live()

    @property
    def switches_tensors(self) -> bool:
        """The shards change storage in place; only the plain buffers (`TwoVersions`) switch tensors."""
        return self.buffers is not None

    def _both_live(self) -> None:
        """Until the first delayed update versions N and N + 1 (N = sync_start) are both the live
        weights: a side shard left None holds the shard's values and is copied out when first needed."""
        self.side: list[torch.Tensor] | None = None
        self.shard_version, self.side_version = self.sync_start + 1, self.sync_start
        self.exchanged = False  # whether the shards are in the storage the side shard was made with
        self.gathered_version: int | None = None
        self.spare_version: int | None = None

    def _alive(self, version: int | None) -> bool:
        return version in (self.updates, self.updates + 1)

    def _side(self) -> list[torch.Tensor]:
        """The side shards (laid out as the parameters' shards, for `exchange_storage`)."""
        if self.side is None:
            self.side = self._copies(self.params)
        return self.side

    def _copies(self, sources: list[torch.Tensor]) -> list[torch.Tensor]:
        """New side shards, laid out as the parameters' shards (for `exchange_storage`), holding
        the local values of `sources` (one per parameter)."""
        sides = [spare_storage(holders) for holders in self.stage.shard_storage(self.params)]
        for side, source in zip(sides, sources):
            side.copy_(_local(source))
        return sides

    def _swap_shards(self) -> None:
        if self.side is not None:
            self.side = [exchange_storage(holders, side) for holders, side in zip(self.stage.shard_storage(self.params), self.side)]
            self.exchanged = not self.exchanged
            self.stage.fence()
        self.shard_version, self.side_version = self.side_version, self.shard_version

    def _swap_gathered(self) -> None:
        self.spare = [exchange_storage(holders, spare) for holders, spare in zip(self.stage.gathered_storage(), self.spare)]
        self.gathered_version, self.spare_version = self.spare_version, self.gathered_version

    def activate(self, batch: int) -> None:
        """Make the parameters FSDP computes with (and the buffers) hold version `batch`: while
        synchronous, the shard's weights, which FSDP gathers after each update's reshard."""
        if batch < self.sync_start:
            return
        if self.buffers:
            self.buffers.activate(batch)
        if self.stage.gathered and self.gathered_version != batch:
            if self.spare_version == batch:
                self._swap_gathered()
            else:
                if self.stage.manual and self._alive(self.gathered_version):  # kept as the spare (see FsdpStage)
                    if self.spare is None:
                        self.spare = [spare_storage(holders) for holders in self.stage.gathered_storage()]
                    self._swap_gathered()
                self.stage.reshard()
        if not self.stage.gathered:
            self.stage.reshard()  # units FSDP left gathered hold older weights
            self._hold(batch)
            self.gathered_version = batch
        elif batch == self.updates + 1:
            self._hold(batch)

    def _hold(self, version: int) -> None:
        """Make the parameters' shards hold version `version`."""
        if self.shard_version != version:
            self._swap_shards()

    def apply_update(self, batch: int, optimizer_step: Callable[[], None]) -> None:
        """U_{batch+2} = U_{batch+1} - Opt(g_batch): the shard steps from U_{batch+1}, the side
        shard keeps U_{batch+1}, and U_batch is dropped. U_{batch+1} is in the parameters' own
        storage (the last update wrote it there), live again first if a switch had exchanged
        it: so the latest version is always there, where whatever keeps the parameters'
        tensors (a checkpointer's cache of them, DCP's staging buffers) finds it after a drain.
        While synchronous the shard steps in place and the stage reshards."""
        if batch < self.sync_start:
            self._synchronous_update(optimizer_step)
            return
        self.stage.reduce()
        latest = batch + 1
        if self.exchanged:
            self._swap_shards()
        for param, side in zip(self.params, self._side()):
            side.copy_(_local(param))
        self.updates += 1
        if self.buffers:
            self.buffers.start_update(batch)
        with preserved_versions(self.params):
            optimizer_step()
        self.shard_version, self.side_version = latest + 1, latest
        self.stage.fence()
        if not self.stage.gathered:
            self.stage.reshard()
            self.gathered_version = self.shard_version
        if not self._alive(self.spare_version):
            self.spare_version = None

    def _synchronous_update(self, optimizer_step: Callable[[], None]) -> None:
        """A Sync Start update: the shard steps in place, the stage reshards, so the next forward
        gathers the new weights; the versions' bookkeeping stays as at construction."""
        self.stage.reduce()
        self.updates += 1
        with preserved_versions(self.params):
            optimizer_step()
        self.stage.fence()
        self.stage.reshard()

    def copies(self) -> list[torch.Tensor]:
        """The side shard (made now if still pending) and the buffers' other version."""
        return self._side() + (self.buffers.copies() if self.buffers else [])

    def extra_bytes(self) -> int:
        """Bytes of the side shard: the one weight copy 2BW keeps."""
        return sum(t.untyped_storage().nbytes() for t in self.side or [])

    def gathered_copy_bytes(self) -> int:
        """Bytes of the gathered side buffer: a second set of unsharded parameters."""
        return sum(t.untyped_storage().nbytes() for t in self.spare or [])

    def state_dict(self, names: list[str], step: int) -> dict[str, torch.Tensor]:
        """As `TwoVersions.state_dict`, sharded like the parameters: the side shard (after a drain
        the shard holds U_{step+1}, the latest version); then the buffers' other version."""
        side = [_local(p).clone() for p in self.params] if step < self.sync_start else self._side()
        state = {name: _like(param, t) for name, param, t in zip(names, self.params, side)}
        return state | self._buffers_state(names, step)

    def _buffers_state(self, names: list[str], step: int) -> dict[str, torch.Tensor]:
        """The buffers' versions, under the names after the parameters'."""
        return self.buffers.state_dict(names[len(self.params):], step) if self.buffers else {}

    def _load_step(self, state: dict[str, torch.Tensor], names: list[str], step: int) -> None:
        """Restore the buffers' versions and the update count of a checkpoint at `step`."""
        if self.buffers:
            self.buffers.load_state_dict(state, names[len(self.params):], step)
        self.backwards.clear()
        self.updates = step

    def load_state_dict(self, state: dict[str, torch.Tensor], names: list[str], step: int) -> None:
        """Restore both versions after a checkpoint at `step` loaded U_{step+1} into the shard."""
        self._load_step(state, names, step)
        if step < self.sync_start:
            self._both_live()
            return
        self.side = self._copies([state[name] for name in names[:len(self.params)]])
        self.exchanged = False
        self.shard_version, self.side_version = step + 1, step
        self.gathered_version = self.spare_version = None


class ShardedPredictedVersions(ShardedTwoVersions):
    """`PredictedVersions` on FSDP2 parameters: each rank predicts its own shards (the
    extrapolation is elementwise, so FSDP gathers the prediction of the gathered weights).

    The parameters' own shard storage holds the latest U, which the optimizer steps; two side
    shards hold the predictions of the batches in flight, keyed by the parity of their batch as
    `PredictedVersions` keys its buffers. Where `ShardedTwoVersions.activate` makes the shards
    hold version t, the shard of P_t is exchanged into the parameters (`_hold`), and the
    gathered versions are P_t. Once batch b's gradient is complete, U_{b+2} = U_{b+1} - Opt(g_b)
    in the parameters' own storage and P_{b+2} = U_{b+2} + h (U_{b+2} - U_{b+1}) in the side
    shard of P_b. Between steps (`expose_latest`) the parameters hold their own storage, the
    latest U, and the units are resharded, so that validation gathers it and checkpoints save
    it. Two side shards: one weight copy more than `ShardedTwoVersions`. Before the first update
    every version is the live weights: the side shards are copied from them when first needed."""

    LATEST = "latest"

    def __init__(self, params: list[torch.nn.Parameter], microbatches: int, stage: FsdpStage, horizon: float,
                 buffers: list[torch.Tensor] = ()) -> None:
        """`buffers`: unsharded tensors versioned with the weights (MoE expert biases), predicted
        as `PredictedVersions` predicts plain parameters."""
        super().__init__(params, microbatches, stage)
        self.horizon = horizon
        self.buffers = PredictedVersions(list(buffers), microbatches, horizon) if buffers else None
        self.sides: dict[int | str, list[torch.Tensor]] = {}
        """The shards the parameters do not hold: P_t under t % 2, the latest U under LATEST."""
        self.held: int | str = self.LATEST

    def _sides(self) -> dict[int | str, list[torch.Tensor]]:
        """The side shards (the predictions made now, from the live weights, if still pending)."""
        if not self.sides:
            self.sides = {parity: self._copies(self.params) for parity in (0, 1)}
        return self.sides

    def _hold(self, version: int | str) -> None:
        """Exchange the shards of P_version (or of the latest U, `LATEST`) into the parameters."""
        key = version if version == self.LATEST else version % 2
        if key == self.held or not self.sides:
            return
        holders = self.stage.shard_storage(self.params)
        self.sides[self.held] = [exchange_storage(h, side) for h, side in zip(holders, self.sides.pop(key))]
        self.held = key
        self.stage.fence()

    def apply_update(self, batch: int, optimizer_step: Callable[[], None]) -> None:
        """U_{batch+2} = U_{batch+1} - Opt(g_batch) in the parameters' own shards; P_{batch+2}
        into the side shard of P_batch (and the buffers' likewise)."""
        self.stage.reduce()
        self._sides()
        self._hold(self.LATEST)
        target = self.sides[batch % 2]
        with torch.no_grad():
            for side, param in zip(target, self.params):
                side.copy_(_local(param))
        self.updates += 1

        def step() -> None:
            with preserved_versions(self.params):
                optimizer_step()

        if self.buffers:
            self.buffers.apply_update(batch, step)
        else:
            step()
        with torch.no_grad():
            for side, param in zip(target, self.params):
                side.mul_(-self.horizon).add_(_local(param), alpha=1 + self.horizon)
        self.stage.fence()
        if not self.stage.gathered:
            self.stage.reshard()
            self.gathered_version = None
        if not self._alive(self.spare_version):
            self.spare_version = None

    def expose_latest(self, step: int) -> None:
        """The parameters hold the latest U, and FSDP gathers it next."""
        if self.buffers:
            self.buffers.expose_latest(step)
        self._hold(self.LATEST)
        self.stage.reshard()
        self.gathered_version = None

    def copies(self) -> list[torch.Tensor]:
        """The two side shards (made now if still pending) and the buffers' copies."""
        return [t for side in self._sides().values() for t in side] + (self.buffers.copies() if self.buffers else [])

    def extra_bytes(self) -> int:
        """Bytes of the two side shards."""
        return sum(t.untyped_storage().nbytes() for side in self.sides.values() for t in side)

    def state_dict(self, names: list[str], step: int) -> dict[str, torch.Tensor]:
        """After `step` steps (drained) the parameters hold U_{step+1}; these are P_step under
        the parameters' names and P_{step+1} under "next.<name>", sharded like the parameters,
        then the buffers' (as `PredictedVersions.state_dict`)."""
        sides = self._sides()
        state = {prefix + name: _like(param, t) for prefix, version in (("", step), ("next.", step + 1))
                 for name, param, t in zip(names, self.params, sides[version % 2])}
        return state | self._buffers_state(names, step)

    def load_state_dict(self, state: dict[str, torch.Tensor], names: list[str], step: int) -> None:
        """Restore both predictions after a checkpoint at `step` loaded U_{step+1} into the shards."""
        self._load_step(state, names, step)
        own = names[:len(self.params)]
        self.sides = {version % 2: self._copies([state[prefix + name] for name in own]) for prefix, version in (("", step), ("next.", step + 1))}
        self.held = self.LATEST
        self.gathered_version = self.spare_version = None


def _like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` as a tensor sharded like `param` (a DTensor view for FSDP parameters)."""
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())


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
            self.live = [_local(p).clone() for p in self.params]
        elif not self.live_current:
            for live, param in zip(self.live, self.params):
                live.copy_(_local(param))
        self.live_current = True
        for param, before in zip(self.params, self.before):
            _local(param).mul_(1 + self.horizon).sub_(before, alpha=self.horizon)
        self._written()
        self.predicting = True

    @torch.no_grad()
    def after_forward(self, microbatch: int) -> None:
        if self.predicting:
            for param, live in zip(self.params, self.live):
                _local(param).copy_(live)
            self._written()
            self.predicting = False

    def apply_update(self, batch: int, optimizer_step: Callable[[], None]) -> None:
        if self.before is None:
            self.before = [_local(p).clone() for p in self.params]
        else:
            for saved, param in zip(self.before, self.params):
                saved.copy_(_local(param))
        super().apply_update(batch, optimizer_step)
        self.live_current = False

    def extra_bytes(self) -> int:
        """W_prev and the copy of the live weights."""
        return sum(t.untyped_storage().nbytes() for t in (self.before or []) + (self.live or []))

    gathered_copy_bytes = LocalAccumulation.extra_bytes

    def copies(self) -> list[torch.Tensor]:
        """W_prev and the copy of the live weights (made now if pending)."""
        return [t for kept in (self.before, self.live) for t in kept or [_local(p).clone() for p in self.params]]

    def state_dict(self, names: list[str], step: int) -> dict[str, torch.Tensor]:
        """PACI's state and W_prev (the live weights before the first step), sharded like the parameters."""
        state = super().state_dict(names, step)
        before = self.before or [_local(p).clone() for p in self.params]
        state.update({f"before.{name}": _like(param, t) for name, param, t in zip(names, self.params, before)})
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor], names: list[str], step: int) -> None:
        super().load_state_dict(state, names, step)
        self.before = [_local(state[f"before.{name}"]).clone() for name in names] if self.updates else None
        self.live_current = False


def two_versions(module: torch.nn.Module, microbatches: int, stage: FsdpStage | None = None, sync_start: int = 0,
                 prediction: float = 0.0):
    """PipeDream-2BW's versions of `module`'s parameters (and MoE expert biases,
    `load_balance.versioned_tensors`): sharded when `stage` (its FSDP units) is given;
    synchronous for the first `sync_start` batches; predicted with horizon `prediction` when
    it is not 0 (without Sync Start: the config refuses it)."""
    assert not (prediction and sync_start), "weight prediction runs without Sync Start"
    tensors = [tensor for _, tensor in versioned_tensors(module)]
    if stage:
        params = list(module.parameters())
        if prediction:
            return ShardedPredictedVersions(params, microbatches, stage, prediction, buffers=tensors[len(params):])
        return ShardedTwoVersions(params, microbatches, stage, buffers=tensors[len(params):], sync_start=sync_start)
    if prediction:
        return PredictedVersions(tensors, microbatches, prediction)
    return TwoVersions(tensors, microbatches, sync_start)


def make_policy(schedule: str, module: torch.nn.Module, microbatches: int, accumulation: int | None, hold_gathered: bool = False,
                sync_start: int = 0, prediction: float = 0.0, stages_after: int = 0):
    """The weight-version policy of streaming schedule `schedule` for one stage module,
    synchronous for the first `sync_start` batches (Sync Start, module docstring), its
    weights predicted with horizon `prediction` when it is not 0 (PACI's forwards by
    `prediction` x the stage's mean delay, `stages_after` / accumulation local steps). With
    `hold_gathered` (a pipeline stage of its own) its FSDP units gather and reduce once per
    update (`FsdpStage.hold_gathered`)."""
    stage = FsdpStage.of(module)
    if stage and hold_gathered:
        stage.hold_gathered()
    if schedule == "PipeDream2BW":
        return two_versions(module, microbatches, stage, sync_start, prediction)
    accumulation = accumulation or microbatches
    if prediction and stages_after:  # the last stage's microbatches cross no local step
        assert not sync_start, "weight prediction runs without Sync Start"
        return PredictedAccumulation(list(module.parameters()), accumulation, microbatches, prediction * stages_after / accumulation, stage)
    return LocalAccumulation(list(module.parameters()), accumulation, microbatches, stage, sync_start)
