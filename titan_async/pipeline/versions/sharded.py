"""PipeDream-2BW's versions of FSDP2 parameters: side shards exchanged into the parameters'
storage, and their predicted variant."""

from __future__ import annotations

from collections.abc import Callable

import torch

from titan_async.parallel.fsdp_stage import FsdpStage, exchange_storage, spare_storage
from titan_async.pipeline.versions.common import local_storage, preserved_versions, sharded_like
from titan_async.pipeline.versions.stashed import OneStepDelay, PredictedVersions, TwoVersions


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
            side.copy_(local_storage(source))
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
            side.copy_(local_storage(param))
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
        side = [local_storage(p).clone() for p in self.params] if step < self.sync_start else self._side()
        state = {name: sharded_like(param, t) for name, param, t in zip(names, self.params, side)}
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
                side.copy_(local_storage(param))
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
                side.mul_(-self.horizon).add_(local_storage(param), alpha=1 + self.horizon)
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
        state = {prefix + name: sharded_like(param, t) for prefix, version in (("", step), ("next.", step + 1))
                 for name, param, t in zip(names, self.params, sides[version % 2])}
        return state | self._buffers_state(names, step)

    def load_state_dict(self, state: dict[str, torch.Tensor], names: list[str], step: int) -> None:
        """Restore both predictions after a checkpoint at `step` loaded U_{step+1} into the shards."""
        self._load_step(state, names, step)
        own = names[:len(self.params)]
        self.sides = {version % 2: self._copies([state[prefix + name] for name in own]) for prefix, version in (("", step), ("next.", step + 1))}
        self.held = self.LATEST
        self.gathered_version = self.spare_version = None
