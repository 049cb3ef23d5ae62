"""Learning-rate schedulers logged under each optimizer's own name."""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan.components.optimizer import LRSchedulersContainer


class RunLRSchedulers(LRSchedulersContainer):
    """torchtitan's schedulers, with learning rates logged as `lr/<optimizer>` after the optimizer
    that steps, also when error feedback wraps it (`lr/Muon`, `lr/AdamW`, not two `lr/ErrorFeedback`
    of which one hides the other)."""

    @dataclass(kw_only=True, slots=True)
    class Config(LRSchedulersContainer.Config):
        def build(self, **kwargs) -> RunLRSchedulers:
            return RunLRSchedulers(LRSchedulersContainer.Config.build(self, **kwargs).schedulers)

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
