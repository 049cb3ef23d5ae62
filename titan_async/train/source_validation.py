"""Validation of a token mixture source by source, beside the mixture's own validation loss."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from torchtitan.components.dataloader import BaseDataLoader

from titan_async.train.progress import VALIDATION_LOSS, RunValidator


def source_loss_key(name: str) -> str:
    """The metric that holds source `name`'s validation loss."""
    return f"{VALIDATION_LOSS}/{name}"


class _LossCapture:
    """Stands in for the metrics processor while one data set is validated: keeps its loss and
    the tokens it read instead of logging them."""

    def __init__(self) -> None:
        self.ntokens_since_last_log = 0
        self.loss: float | None = None

    def log_validation(self, loss: float, step: int, extra_metrics: dict | None = None) -> None:
        self.loss = loss


class SourceValidator(RunValidator):
    """torchtitan's validation of the mixture (`validation_metrics/loss`), then of each source's
    own validation data, logged in the same row as `validation_metrics/loss/<name>`."""

    @dataclass(kw_only=True, slots=True)
    class Config(RunValidator.Config):
        source_names: list[str] = field(default_factory=list)
        source_loaders: list[BaseDataLoader.Config] = field(default_factory=list)

    def validate(self, model_parts, step: int) -> None:
        metrics, mixture = self.metrics_processor, self.dl_config
        losses, tokens = {}, 0
        try:
            for name, loader in [(None, mixture), *zip(self.config.source_names, self.config.source_loaders)]:
                self.dl_config = replace(loader, infinite=mixture.infinite)
                self.metrics_processor = capture = _LossCapture()
                RunValidator.validate(self, model_parts, step)
                losses[name], tokens = capture.loss, tokens + capture.ntokens_since_last_log
        finally:
            self.metrics_processor, self.dl_config = metrics, mixture
        metrics.ntokens_since_last_log += tokens
        metrics.log_validation(loss=losses.pop(None), step=step,
                               extra_metrics={source_loss_key(name): loss for name, loss in losses.items()})
