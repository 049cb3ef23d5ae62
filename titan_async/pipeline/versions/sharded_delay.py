"""PipeDream-2BW's d + 1 versions of FSDP2 parameters for a gradient delay of d > 1 steps."""

from __future__ import annotations

from collections.abc import Callable

import torch

from titan_async.parallel.fsdp_stage import FsdpStage, exchange_storage, spare_storage
from titan_async.pipeline.versions.common import local_storage, preserved_versions, sharded_like
from titan_async.pipeline.versions.stashed import OneStepDelay, TwoVersions


class ShardedDelayedVersions(OneStepDelay):
    """`TwoVersions`' rule at a delay of d = `lag` steps on FSDP2 parameters: batch t runs on
    U_t = W[t - d], and once batch b's gradient is complete U_{b+d+1} = U_{b+d} - Opt(g_b)
    replaces U_b. After u updates the live versions are U_u .. U_{u+d}.

    Shards: the parameters' shard storage holds one live version (`held`); a side shard per
    other live version (`sides`, by version). Switching exchanges storages
    (`fsdp_stage.exchange_storage`): no bytes are copied. Invariant: the parameters' own
    storage holds the latest version, live again whenever an update or a checkpoint needs it
    (the update steps it in place, where a checkpointer's cache of the parameters finds it).

    Gathered: on a stage held gathered (`FsdpStage.hold_gathered`) a microbatch's forward saved
    views of the gathered buffer of its version, which its backward still reads; a switch
    therefore moves a live gathered version into a gathered side buffer (`spares`, by version)
    before FSDP gathers another, and moves it back when that version is needed again. So each
    live version is all-gathered once, at the cost of up to d gathered copies; a dropped
    version's gathered buffer is reused for the next park, its shard for the next version.
    Before the first update every version is the live weights (the side shards are copied from
    them when first needed; the gathered ones are gathered per version all the same). No Sync
    Start, prediction or versioned buffers (the config refuses them at d > 1)."""

    switches_tensors = False

    def __init__(self, params: list[torch.nn.Parameter], microbatches: int, stage: FsdpStage, lag: int) -> None:
        super().__init__(microbatches, 0, lag)
        self.params, self.stage = params, stage
        self.sides: dict[int, list[torch.Tensor]] = {}
        self.held = lag  # U_d = W[0], the latest version, in the parameters' own storage
        self.spares: dict[int, list[torch.Tensor]] = {}
        self.free: list[list[torch.Tensor]] = []
        """Gathered side buffers of dropped versions, reused before allocating another."""
        self.gathered_version: int | None = None

    def _latest(self) -> int:
        return self.updates + self.lag

    def _alive(self, version: int | None) -> bool:
        return version is not None and self.updates <= version <= self._latest()

    def _copies(self, sources: list[torch.Tensor]) -> list[torch.Tensor]:
        """New side shards, laid out as the parameters' shards, holding the local values of `sources`."""
        sides = [spare_storage(holders) for holders in self.stage.shard_storage(self.params)]
        for side, source in zip(sides, sources):
            side.copy_(local_storage(source))
        return sides

    def _made(self) -> dict[int, list[torch.Tensor]]:
        """The side shards, copied from the live weights if still pending (before the first update)."""
        if not self.sides:
            self.sides = {v: self._copies(self.params) for v in range(self.updates, self._latest() + 1) if v != self.held}
        return self.sides

    def _hold(self, version: int) -> None:
        """Exchange the side shard of `version` into the parameters' shard storage."""
        if version == self.held or not self.sides:
            return
        holders = self.stage.shard_storage(self.params)
        self.sides[self.held] = [exchange_storage(h, side) for h, side in zip(holders, self.sides.pop(version))]
        self.held = version
        self.stage.fence()

    def _park_gathered(self) -> None:
        """Move the gathered version, if live, into a new gathered side buffer, so that a reshard
        frees FSDP's storage, not the weights its microbatches' forwards saved."""
        if self._alive(self.gathered_version):
            holders = self.stage.gathered_storage()
            empty = self.free.pop() if self.free else [spare_storage(h) for h in holders]
            self.spares[self.gathered_version] = [exchange_storage(h, e) for h, e in zip(holders, empty)]

    def activate(self, batch: int) -> None:
        """Make the weights FSDP computes with hold version `batch`."""
        if self.stage.gathered and self.gathered_version != batch:
            if batch in self.spares:
                parked = self.gathered_version
                returned = [exchange_storage(h, s) for h, s in zip(self.stage.gathered_storage(), self.spares.pop(batch))]
                if self._alive(parked):
                    self.spares[parked] = returned
                self.gathered_version = batch
            else:
                if self.stage.manual:
                    self._park_gathered()
                self.stage.reshard()
        if not self.stage.gathered:
            self.stage.reshard()  # units FSDP left gathered hold other weights
            self.gathered_version = batch
        self._hold(batch)

    def apply_update(self, batch: int, optimizer_step: Callable[[], None]) -> None:
        """U_{batch+d+1} = U_{batch+d} - Opt(g_batch): the latest version, in the parameters' own
        storage, is copied into U_batch's side shard (which becomes U_{batch+d}'s) and steps in place."""
        self.stage.reduce()
        latest = self._latest()
        self._made()
        self._hold(latest)
        target = self.sides.pop(batch)
        for side, param in zip(target, self.params):
            side.copy_(local_storage(param))
        self.sides[latest] = target
        self.updates += 1
        with preserved_versions(self.params):
            optimizer_step()
        self.held = latest + 1
        self.stage.fence()
        if not self.stage.gathered:
            self.stage.reshard()
            self.gathered_version = self.held
        for version in [v for v in self.spares if not self._alive(v)]:
            self.free.append(self.spares.pop(version))  # its batches are done: reused by the next park

    def copies(self) -> list[torch.Tensor]:
        """The side shards (made now if still pending)."""
        return [t for side in self._made().values() for t in side]

    def extra_bytes(self) -> int:
        """Bytes of the side shards: d weight copies."""
        return sum(t.untyped_storage().nbytes() for side in self.sides.values() for t in side)

    def gathered_copy_bytes(self) -> int:
        """Bytes of the gathered side buffers, those kept for reuse included."""
        return sum(t.untyped_storage().nbytes() for side in [*self.spares.values(), *self.free] for t in side)

    def state_dict(self, names: list[str], step: int) -> dict[str, torch.Tensor]:
        """As `TwoVersions.state_dict`, sharded like the parameters: after a drain at `step` the
        parameters hold U_{step+d} (`expose_latest`); these are U_{step+i} for 0 <= i < d."""
        sides = self._made()
        return {TwoVersions._key(ahead, name): sharded_like(param, tensor) for ahead in range(self.lag)
                for name, param, tensor in zip(names, self.params, sides[step + ahead])}

    def load_state_dict(self, state: dict[str, torch.Tensor], names: list[str], step: int) -> None:
        """Restore every version after a checkpoint at `step` loaded U_{step+d} into the shards."""
        self.backwards.clear()
        self.updates = step
        self.sides = {step + ahead: self._copies([state[TwoVersions._key(ahead, name)] for name in names])
                      for ahead in range(self.lag)}
        self.held = self._latest()
        self.spares, self.free, self.gathered_version = {}, [], None
