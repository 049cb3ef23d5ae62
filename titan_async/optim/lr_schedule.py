"""Learning-rate schedulers logged under each optimizer's own name, rescheduled for delayed gradients."""

from __future__ import annotations

from dataclasses import dataclass

from torch.optim.lr_scheduler import LambdaLR
from torchtitan.components.optimizer import LRSchedulersContainer


def delay_rescheduling(step: int, delay: float, steps: int) -> float:
    """The factor d ** -(1 - min(k / K, 1)) of scheduler step k (0-based) at gradient delay d over K
    steps: 1 / d at the first step, rising geometrically to 1 at step K (PipeMare's learning-rate
    rescheduling); a delay below one step counts as one."""
    return max(delay, 1.0) ** -(1 - min(step / steps, 1.0))


class RunLRSchedulers(LRSchedulersContainer):
    """torchtitan's schedulers, with learning rates logged as `lr/<optimizer>` after the optimizer
    that steps, also when error feedback wraps it (`lr/Muon`, `lr/AdamW`, not two `lr/ErrorFeedback`
    of which one hides the other)."""

    @dataclass(kw_only=True, slots=True)
    class Config(LRSchedulersContainer.Config):
        delay_rescheduling_steps: int = 0
        """Divide each stage's lr of scheduler step k by d ** (1 - min(k / K, 1)), K this many steps
        and d the stage's gradient delay in its own updates (PipeDream2BW's or
        training.gradient_delay on every stage; PACI's mean on each stage): lr / d at the start,
        the schedule's own lr from step K on; 0: off. A no-op where d <= 1; the trainer applies
        it per stage (`reschedule`)."""

        def build(self, **kwargs) -> RunLRSchedulers:
            return RunLRSchedulers(LRSchedulersContainer.Config.build(self, **kwargs).schedulers)

    def __init__(self, schedulers: list) -> None:
        self.schedulers = schedulers

    def reschedule(self, indices: list[int], delay: float, steps: int) -> None:
        """Rebuild schedulers `indices` (one stage's, before its first step) with their lr divided by
        `delay_rescheduling(k, delay, steps)` at scheduler step k, from their optimizers' unchanged
        initial lrs, so that the first step's lr is rescheduled too."""
        for i in indices:
            schedule = self.schedulers[i].lr_lambdas[0]
            self.schedulers[i] = LambdaLR(self.schedulers[i].optimizer,
                                          lambda k, schedule=schedule: schedule(k) * delay_rescheduling(k, delay, steps))

    def get_metrics(self) -> dict[str, float]:
        metrics = {}
        for scheduler in self.schedulers:
            name = type(getattr(scheduler.optimizer, "base", scheduler.optimizer)).__name__
            rates = scheduler.get_last_lr()
            for index, rate in enumerate(rates):
                metrics[f"lr/{name}" if len(rates) == 1 else f"lr/{name}/{index}"] = float(rate)
        return metrics
