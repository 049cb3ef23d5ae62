"""What a run shows and records: a live display (or plain lines), metrics.jsonl, a summary.

`RunMetrics` is torchtitan's MetricsProcessor with its metric logger wrapped, so
every scalar torchtitan sends to TensorBoard also reaches the display and the
run directory's metrics.jsonl, on the rank that holds the loss.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from rich.console import Console
from rich.live import Live
from rich.table import Table
from torchtitan.components.metrics import BaseLogger, MetricsProcessor, _get_metrics_rank
from torchtitan.components.validate import Validator
from torchtitan.tools.logging import logger

from titan_async.core import platform
from titan_async.rundir.jsonl import set_aside_cut_line, set_aside_path
from titan_async.train.wandb_runs import configure_main_run

LOSS = "loss_metrics/global_avg_loss"
VALIDATION_LOSS = "validation_metrics/loss"
TOKENS_PER_SECOND = "throughput(tps)"
MEMORY = "memory/max_reserved(GiB)"
TRAINING_SECONDS = "time_metrics/training(s)"
"""Seconds spent in training steps since the previous logged step (validation and checkpoints
excluded; a streaming schedule's drain counts): summed over steps, the run's training wall-clock."""


class ProgressDisplay:
    """Step, loss, tokens/s, ETA and memory: a live table on a terminal, else one line a step."""

    def __init__(self, total_steps: int, live: bool) -> None:
        self.total_steps = total_steps
        self.console = Console(file=sys.stdout)
        self.created = self.started = time.perf_counter()
        self.first_step: int | None = None
        self.rows: dict[str, str] = {}
        self.history: dict[str, float] = {}
        self.live = Live(self._table(), console=self.console, refresh_per_second=4) if live else None
        if self.live:
            self.live.start()

    def _eta(self, step: int) -> str:
        if self.first_step is None or step <= self.first_step:
            return "-"
        per_step = (time.perf_counter() - self.started) / (step - self.first_step)
        seconds = int(per_step * (self.total_steps - step))
        return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"

    def _table(self) -> Table:
        table = Table(title="titan-async", show_header=False)
        for key, value in self.rows.items():
            table.add_row(key, value)
        return table

    def train_step(self, step: int, metrics: dict[str, Any]) -> None:
        if self.first_step is None:
            self.first_step, self.started = step, time.perf_counter()
        lr = next((v for k, v in metrics.items() if k.startswith("lr")), None)
        self.rows.update(
            step=f"{step}/{self.total_steps}",
            loss=f"{metrics[LOSS]:.4f}",
            lr="-" if lr is None else f"{lr:.2e}",
            grad_norm=f"{metrics.get('grad_norm', float('nan')):.3f}",
            tokens_per_s=f"{metrics.get(TOKENS_PER_SECOND, 0):,.0f}",
            memory=f"{metrics.get(MEMORY, 0):.2f} GiB",
            eta=self._eta(step),
        )
        self.history.setdefault("first_loss", metrics[LOSS])
        self.history["last_loss"] = metrics[LOSS]
        self.history["peak_memory_gib"] = max(self.history.get("peak_memory_gib", 0), metrics.get(MEMORY, 0))
        self._show(" | ".join(f"{k} {v}" for k, v in self.rows.items() if k not in ("validation_loss", "benchmark")))

    def validation(self, step: int, loss: float) -> None:
        self.rows["validation_loss"] = f"{loss:.4f} (step {step})"
        self.history.setdefault("first_validation_loss", loss)
        self.history["last_validation_loss"] = loss
        self._show(f"validation step {step} | loss {loss:.4f}")

    def benchmark(self, step: int, metrics: dict[str, float]) -> None:
        scores = ", ".join(f"{key.removeprefix('benchmark/')} {value:.4f}" for key, value in metrics.items())
        self.rows["benchmark"] = f"{scores} (step {step})"
        self._show(f"benchmark step {step} | {scores}")

    def _show(self, line: str) -> None:
        if self.live:
            self.live.update(self._table())
        else:
            print(line, flush=True)

    def close(self, last_step: int, tokens: int) -> None:
        if self.live:
            self.live.stop()
        elapsed = time.perf_counter() - self.created
        summary = Table(title="run summary")
        summary.add_column("metric")
        summary.add_column("value", justify="right")
        summary.add_row("last step", str(last_step))
        for key, value in self.history.items():
            summary.add_row(key.replace("_", " "), f"{value:.4f}")
        summary.add_row("tokens seen", f"{tokens:,}")
        summary.add_row("wall time (s)", f"{elapsed:.1f}")
        self.console.print(summary)


def _benchmark(metrics: dict[str, Any]) -> bool:
    return any(key.startswith("benchmark/") for key in metrics)


class _TeeLogger(BaseLogger):
    """Forwards scalars to torchtitan's loggers, metrics.jsonl and the display. It appends to
    metrics.jsonl after the last complete row: a row a killed run left cut short is set aside
    first (`titan_async.rundir.jsonl`)."""

    def __init__(self, inner: BaseLogger, path: Path) -> None:
        self.inner = inner
        self.path = path
        if set_aside_cut_line(path) is not None:
            logger.warning(f"{path} ended in a row cut short (a killed run): moved it to {set_aside_path(path)}")
        self.display: ProgressDisplay | None = None

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.inner.log(metrics, step)
        kind = "validation" if VALIDATION_LOSS in metrics else "benchmark" if _benchmark(metrics) else "train"
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, "kind": kind, **metrics}) + "\n")
        if self.display is None:
            return
        if kind == "validation":
            self.display.validation(step, metrics[VALIDATION_LOSS])
        elif kind == "benchmark":
            self.display.benchmark(step, metrics)
        else:
            self.display.train_step(step, metrics)

    def close(self) -> None:
        self.inner.close()


class RunMetrics(MetricsProcessor):
    """MetricsProcessor that also feeds the progress display and metrics.jsonl."""

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        pipeline_trace: bool = False
        """Record every pipeline action's start and end (every pipeline schedule): trace JSON, a Gantt PNG and each
        rank's measured bubble per step."""
        wandb_project: str = "titan-async"
        """The W&B project of `enable_wandb`."""
        wandb_entity: str | None = None
        """The W&B team or user (default: the logged-in user's)."""
        wandb_mode: Literal["online", "offline"] = "online"
        """offline: write the W&B runs into the run directory only, for `wandb sync` later."""
        wandb_rank_runs: bool = False
        """With enable_wandb, also a W&B run per pipeline stage for the stage's scalars (pipeline/stage<s>.jsonl);
        off, the job has one W&B run."""

    def __init__(self, config: Config, *, parallel_dims, dump_folder: str = "./outputs", pp_schedule: str = "1F1B", **kwargs):
        # torchtitan's MFU divides by a GPU's peak FLOPS; it leaves MFU out where that peak does not
        # apply (`has_quantization`), which on CPU is always.
        if platform.is_cpu():
            kwargs["has_quantization"] = True
            logger.info("mfu(%) is not reported on CPU: torchtitan computes it against a GPU's peak FLOPS")
        if config.enable_wandb:
            configure_main_run(Path(dump_folder), config)
        super().__init__(config, parallel_dims=parallel_dims, dump_folder=dump_folder, pp_schedule=pp_schedule, **kwargs)
        import torch.distributed as dist

        self.is_reporting_rank = dist.get_rank() == _get_metrics_rank(parallel_dims=parallel_dims, pp_schedule=pp_schedule)
        self.tee: _TeeLogger | None = None
        self.unlogged_training_s = 0.0
        self.step_started: float | None = None
        if self.is_reporting_rank:
            self.tee = _TeeLogger(self.logger, Path(dump_folder) / "metrics.jsonl")
            self.logger = self.tee

    def start_training_step(self) -> None:
        self.step_started = time.perf_counter()

    def end_training_step(self) -> None:
        self.unlogged_training_s += time.perf_counter() - self.step_started
        self.step_started = None

    def log(self, step: int, global_avg_loss: float, global_max_loss: float, grad_norm: float, extra_metrics: dict | None = None):
        """torchtitan's log, with TRAINING_SECONDS: the training steps' time since the last log,
        including the current step so far (the rest of it counts towards the next log)."""
        training_s, self.unlogged_training_s = self.unlogged_training_s, 0.0
        if self.step_started is not None:
            now = time.perf_counter()
            training_s, self.step_started = training_s + now - self.step_started, now
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics={**(extra_metrics or {}), TRAINING_SECONDS: training_s})

    def hold(self, step: int, global_avg_loss: float, global_max_loss: float, extra_metrics: dict) -> dict[str, Any]:
        """`log`'s row of `step`, measured now (throughput, times and memory since the last log)
        but not written: `write_held` writes it once its gradient norm is known. torchtitan's
        console line is left out; the display shows the row when it is written."""
        held: list[dict[str, Any]] = []
        logger_, self.logger = self.logger, _Holder(held)
        muted = lambda record: False  # noqa: E731
        logger.addFilter(muted)
        try:
            self.log(step, global_avg_loss, global_max_loss, float("nan"), extra_metrics)
        finally:
            self.logger = logger_
            logger.removeFilter(muted)
        return held[0]

    def write_held(self, step: int, row: dict[str, Any], grad_norm: float, extra_metrics: dict) -> None:
        """Write a row from `hold` with its gradient norm."""
        self.logger.log({**row, "grad_norm": grad_norm, **extra_metrics}, step)
        logger.info(f"step: {step:2}  loss: {row[LOSS]:8.5f}  grad_norm: {grad_norm:7.4f}")

    def start_display(self, total_steps: int) -> None:
        """Start showing progress (on the reporting rank only)."""
        if self.tee is not None:
            self.tee.display = ProgressDisplay(total_steps, live=sys.stdout.isatty())

    def close_display(self, last_step: int, tokens: int) -> None:
        if self.tee is not None and self.tee.display is not None:
            self.tee.display.close(last_step, tokens)
            self.tee.display = None


class _Holder(BaseLogger):
    """A logger that keeps the rows it is given."""

    def __init__(self, rows: list) -> None:
        self.rows = rows

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.rows.append(metrics)


class RunValidator(Validator):
    """torchtitan's Validator that also validates at the run's last step."""

    @dataclass(kw_only=True, slots=True)
    class Config(Validator.Config):
        pass

    last_step: int = 0

    def should_validate(self, step: int) -> bool:
        return step == self.last_step or Validator.should_validate(self, step)
