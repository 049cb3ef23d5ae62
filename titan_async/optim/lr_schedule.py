"""Learning-rate schedulers logged under each optimizer's own name, rescheduled for delayed gradients."""

from __future__ import annotations

from dataclasses import dataclass

from torch.optim.lr_scheduler import LambdaLR
from torchtitan.components.optimizer import LRSchedulersContainer


def delay_rescheduling(step: int, delay: int, steps: int) -> float:
    """The factor d ** -(1 - min(k / K, 1)) of scheduler step k (0-based) at gradient delay d over K
    steps: 1 / d at the first step, rising geometrically to 1 at step K (PipeMare's learning-rate
    rescheduling with one delay on every stage)."""
    return delay ** -(1 - min(step / steps, 1.0))


class RunLRSchedulers(LRSchedulersContainer):
    """torchtitan's schedulers, with learning rates logged as `lr/<optimizer>` after the optimizer
    that steps, also when error feedback wraps it (`lr/Muon`, `lr/AdamW`, not two `lr/ErrorFeedback`
    of which one hides the other)."""

    @dataclass(kw_only=True, slots=True)
    class Config(LRSchedulersContainer.Config):
        delay_rescheduling_steps: int = 0
        """Divide the lr of scheduler step k by d ** (1 - min(k / K, 1)), K this many steps and d the
        run's gradient delay in steps (PipeDream2BW's, or training.gradient_delay): lr / d at the
        start, the schedule's own lr from step K on; 0: off. A no-op at d = 1."""
        _gradient_delay: int = 1
        """d, set from the run's schedule when the trainer is assembled (not a config key)."""

        def build(self, *, optimizers, training_steps) -> RunLRSchedulers:
            schedulers = LRSchedulersContainer.Config.build(self, optimizers=optimizers, training_steps=training_steps).schedulers
            if self.delay_rescheduling_steps and self._gradient_delay > 1:
                schedule = schedulers[0].lr_lambdas[0]
                delay, steps = self._gradient_delay, self.delay_rescheduling_steps
                # Rebuilt from the optimizers' unchanged initial lrs: step 0's lr is rescheduled too.
                schedulers = [LambdaLR(o, lambda k: schedule(k) * delay_rescheduling(k, delay, steps)) for o in optimizers]
            return RunLRSchedulers(schedulers)

    def __init__(self, schedulers: list) -> None:
        self.schedulers = schedulers

    def get_metrics(self) -> dict[str, float]:
        metrics = {}
        for scheduler in self.schedulers:
            name = type(getattr(scheduler.optimizer, "base", scheduler.optimizer)).__name__
            rates = scheduler.get_last_lr()
            for index, rate in enumerate(rates):
                metrics[f"lr/{name}" if len(rates) == 1 else f"lr/{name}/{index}"] = float(rate)
        return metrics
