"""The `[health]` section: non-finite gradients skip the update; too many stop the run."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from torchtitan.tools.logging import logger

from titan_async.optim.error_feedback import ErrorFeedback
from titan_async.optim.muon import Muon
from titan_async.train.late_read import LateRead


@dataclass(kw_only=True, slots=True)
class HealthSection:
    """What to do when a loss or gradient is not finite."""

    max_nonfinite_steps: int = 3
    """Updates skipped for non-finite gradients before the run saves a checkpoint and exits with status 3."""
    inject_nonfinite_steps: list[int] = field(default_factory=list)
    """Fault injection for tests: make the gradient of stage `inject_stage` NaN at these steps."""
    inject_stage: int = 0
    """Pipeline stage whose gradient `inject_nonfinite_steps` poisons."""
    inject_rank: int = -1
    """The one rank of that stage that poisons its gradient (its stage's other ranks must agree to
    skip); -1: every rank of the stage."""


def skips_on_device(optimizer: Optimizer) -> bool:
    """Whether `optimizer.step()` skips the update on the device when `optimizer.found_inf` is a
    0-dim tensor holding 1 (torch's fused Adam/AdamW, `Muon`, `ErrorFeedback` over either)."""
    if isinstance(optimizer, ErrorFeedback):
        return skips_on_device(optimizer.base)
    return isinstance(optimizer, Muon) or all(group.get("fused") for group in optimizer.param_groups)


def _local_grads(params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params if p.grad is not None]


class HealthGuard:
    """Decides, before each optimizer update, whether the gradients may be applied.

    `allow_update` decides on the host (one host sync per update: synchronous training).
    `found_nonfinite` decides on the device, for streaming stages that step inside a window:
    the optimizers skip the update themselves (`found_inf`), and the decisions are read at
    the end of the next step (`end_step`), behind the work queued since, never waiting for it.
    """

    def __init__(self, section: HealthSection) -> None:
        self.section = section
        self.skipped = 0
        self.step_flags: list[tuple[int, int, torch.Tensor]] = []
        self.unread: tuple[list[tuple[int, int]], LateRead] | None = None

    def allow_update(self, step: int, stage: int, params: list[torch.Tensor], group: dist.ProcessGroup | None) -> bool:
        """False (and the gradients zeroed) when a gradient of `stage` is not finite.

        The ranks of `group` agree: the whole world in synchronous training (one global
        update), a stage's data-parallel ranks for streaming schedules (each stage steps
        alone), none (None) for a stage without data parallelism.
        """
        grads = self._grads(step, stage, params)
        device = params[0].device if params else None
        finite = torch.stack([torch.isfinite(g).all() for g in grads]).all() if grads else torch.tensor(True, device=device)
        bad = (~finite).to(torch.int32).reshape(1)
        local_bad = bad.clone()
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
        if not bad.item():  # the one host sync of an update
            return True
        if local_bad.item():
            logger.warning(f"step {step}: stage {stage} (rank {dist.get_rank()}) has a non-finite gradient; update skipped")
        for g in grads:
            g.zero_()
        self.skipped += 1
        return False

    def _grads(self, step: int, stage: int, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """The local gradients of `params`, poisoned first where `inject_nonfinite_steps` says so."""
        grads = _local_grads(params)
        injected = step in self.section.inject_nonfinite_steps and stage == self.section.inject_stage
        if injected and self.section.inject_rank in (-1, dist.get_rank() if dist.is_initialized() else 0) and grads:
            grads[0].fill_(float("nan"))
        return grads

    def found_nonfinite(self, step: int, stage: int, params: list[torch.Tensor], group: dist.ProcessGroup | None) -> torch.Tensor:
        """`found_inf` for the optimizers: 1.0 (a 0-dim float tensor on the device) when a gradient
        of `stage` on any rank of `group` is not finite, else 0.0. Never waits for the device.
        When it is 1.0 every gradient is zeroed (so clipping stays finite) and the optimizers
        must skip the update on the device."""
        grads = self._grads(step, stage, params)
        device = params[0].device if params else None
        if not grads:
            return torch.zeros((), device=device)
        local = (~torch.stack([torch.isfinite(g).all() for g in grads]).all()).float()
        found = local.clone().reshape(1)
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
        found = found.reshape(())
        keep = 1 - found
        for g in grads:
            g.nan_to_num_(0.0, 0.0, 0.0).mul_(keep)
        self.step_flags.append((step, stage, torch.stack([local, found])))
        return found

    def end_step(self) -> None:
        """Start reading this step's device decisions; count those of the previous step."""
        previous, self.unread = self.unread, self._start_reading()
        self._count(previous)

    def settle(self) -> None:
        """Count every decision taken so far (at a drain, where waiting for the device costs nothing)."""
        previous, self.unread = self.unread, None
        self._count(previous)
        self._count(self._start_reading())

    def _start_reading(self) -> tuple[list[tuple[int, int]], LateRead] | None:
        if not self.step_flags:
            return None
        checks = [(step, stage) for step, stage, _ in self.step_flags]
        flags = LateRead(torch.stack([flags for _, _, flags in self.step_flags]))
        self.step_flags = []
        return checks, flags

    def _count(self, reading: tuple[list[tuple[int, int]], LateRead] | None) -> None:
        """Log the stages of this rank that saw a non-finite gradient; count the skipped updates."""
        if reading is None:
            return
        checks, flags = reading
        for (step, stage), (local_bad, bad) in zip(checks, flags.read()):
            if local_bad:
                logger.warning(f"step {step}: stage {stage} (rank {dist.get_rank()}) has a non-finite gradient; update skipped")
            self.skipped += int(bad)

    def exhausted(self) -> bool:
        """True once more updates were skipped than `max_nonfinite_steps` allows."""
        return self.skipped > self.section.max_nonfinite_steps
