"""The `[health]` section: non-finite gradients skip the update; too many stop the run."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torchtitan.tools.logging import logger


@dataclass(kw_only=True, slots=True)
class HealthSection:
    """What to do when a loss or gradient is not finite."""

    max_nonfinite_steps: int = 3
    """Updates skipped for non-finite gradients before the run saves a checkpoint and exits with status 3."""
    inject_nonfinite_steps: list[int] = field(default_factory=list)
    """Fault injection for tests: make the gradient of stage `inject_stage` NaN at these steps."""
    inject_stage: int = 0
    """Pipeline stage whose gradient `inject_nonfinite_steps` poisons."""

    def __post_init__(self) -> None:
        if self.max_nonfinite_steps < 0:
            raise ValueError(f"health.max_nonfinite_steps must be >= 0, got {self.max_nonfinite_steps}")


class HealthGuard:
    """Decides, before each optimizer update, whether the gradients may be applied."""

    def __init__(self, section: HealthSection) -> None:
        self.section = section
        self.skipped = 0

    def allow_update(self, step: int, stage: int, params: list[torch.Tensor], group: dist.ProcessGroup | None) -> bool:
        """False (and the gradients zeroed) when a gradient of `stage` is not finite.

        The ranks of `group` agree: the whole world in synchronous training (one global
        update), a stage's data-parallel ranks for streaming schedules (each stage steps
        alone), none (None) for a stage without data parallelism.
        """
        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params if p.grad is not None]
        if step in self.section.inject_nonfinite_steps and stage == self.section.inject_stage and grads:
            grads[0].fill_(float("nan"))
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

    def exhausted(self) -> bool:
        """True once more updates were skipped than `max_nonfinite_steps` allows."""
        return self.skipped > self.section.max_nonfinite_steps
