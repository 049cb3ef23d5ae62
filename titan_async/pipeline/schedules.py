"""PipeDream2BW and PACI as torch pipeline schedules, selectable by name in torchtitan.

They are single-stage-per-rank schedules (`PipelineScheduleSingle`), so torchtitan's
pipeline builder splits and wraps the model exactly as for 1F1B. Unlike torch's
schedules they do not flush: the trainer calls `run_window` once per optimizer step
and `drain` before checkpoints, validation and the end of training.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from titan_async.pipeline import actions as plan
from titan_async.pipeline.executor import Microbatch, StageExecutor
from titan_async.pipeline.trace import Timeline
from titan_async.pipeline.transport import P2PTransport
from titan_async.pipeline.versions import LocalAccumulation, TwoVersions

_EVAL_IDS = 1 << 23


class StreamingSchedule(PipelineScheduleSingle):
    """Streaming 1F1B with a weight-version policy; see the module docstring."""

    def _get_pipeline_order(self):
        return plan.pipeline_order(self._num_stages, self._n_microbatches, windows=2)

    def attach(
        self,
        *,
        optimizer_step: Callable[[], None],
        accumulation: int,
        keep_trace: bool,
        param_names: list[str],
    ) -> None:
        """Bind the stage's optimizer step and weight policy; called once by the trainer."""
        stage = self._stage
        params = [p for p in stage.submod.parameters()]
        self.param_names = param_names
        self.optimizer_step = optimizer_step
        self.policy = self._make_policy(params, accumulation)
        self.timeline = Timeline(dist.get_rank(), keep_trace)
        self.transport = P2PTransport(stage.group, stage.stage_index, stage.num_stages, stage.device)
        self.executor = StageExecutor(
            stage.submod, stage.stage_index, stage.num_stages, self.transport, self.policy, self._loss_fn, self.timeline
        )
        self.window = 0
        self.drained = True

    @abstractmethod
    def _make_policy(self, params, accumulation: int):
        """The weight-version policy of this schedule."""

    def _step_microbatches(self, *args, **kwargs):
        raise RuntimeError(f"{type(self).__name__} is driven by titan-async's trainer (run_window/drain), not step()")

    def _microbatches(self, arg_mbs, kwarg_mbs, target_mbs) -> list[Microbatch]:
        count = len(kwarg_mbs)
        return [
            Microbatch(
                args=arg_mbs[i] if arg_mbs else (),
                kwargs=kwarg_mbs[i],
                target=target_mbs[i] if target_mbs else None,
            )
            for i in range(count)
        ]

    def run_window(self, arg_mbs, kwarg_mbs, target_mbs, loss_kwargs: dict[str, Any]) -> list[torch.Tensor]:
        """Feed one batch (the next window) into the stream; returns its losses on the last stage."""
        stage = self._stage
        first = self.window * self._n_microbatches
        microbatches = dict(enumerate(self._microbatches(arg_mbs, kwarg_mbs, target_mbs), start=first))
        window_actions = plan.window_actions(stage.stage_index, stage.num_stages, self._n_microbatches, self.window, self.drained)
        self.timeline.start_window()
        losses = self.executor.run(window_actions, microbatches, loss_kwargs, self.optimizer_step)
        self.window += 1
        self.drained = False
        self.loss_kwargs = loss_kwargs
        return losses

    def drain(self) -> None:
        """Run the backwards still in flight, so no microbatch crosses this point."""
        if self.drained:
            return
        stage = self._stage
        tail = plan.drain_actions(stage.stage_index, stage.num_stages, self._n_microbatches, self.window - 1)
        self.executor.run(tail, {}, self.loss_kwargs, self.optimizer_step)
        self.transport.finish_sends()
        self.drained = True

    def eval(self, *args, arg_mbs=None, kwarg_mbs=None, target_mbs=None, losses=None, **kwargs):
        """Forward-only pass (validation); the stream must be drained."""
        assert self.drained, "drain the stream before validation"
        result = self.executor.evaluate(self._microbatches(arg_mbs, kwarg_mbs, target_mbs), {}, _EVAL_IDS)
        if losses is not None:
            losses.extend(result)

    def bubble(self) -> float:
        return self.timeline.bubble()

    def write_trace(self, path: Path) -> None:
        self.timeline.write(path)


class SchedulePipeDream2BW(StreamingSchedule):
    """PipeDream-2BW: two weight versions per stage, a constant one-step gradient delay."""

    def _make_policy(self, params, accumulation: int):
        if self._n_microbatches < self._num_stages:
            raise ValueError(
                f"PipeDream2BW needs at least as many microbatches ({self._n_microbatches}) as stages ({self._num_stages})"
            )
        return TwoVersions(params, self._n_microbatches)


class SchedulePACI(StreamingSchedule):
    """PACI: no stash; each stage steps in place after every `accumulation` local backwards."""

    def _make_policy(self, params, accumulation: int):
        return LocalAccumulation(params, accumulation or self._n_microbatches, self._n_microbatches)


STREAMING_SCHEDULES: dict[str, type[StreamingSchedule]] = {
    "PipeDream2BW": SchedulePipeDream2BW,
    "PACI": SchedulePACI,
}


TORCH_SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
SCHEDULE_NAMES = TORCH_SCHEDULES + tuple(STREAMING_SCHEDULES)


def streaming_schedule(name: str) -> type[StreamingSchedule] | None:
    """The streaming schedule class called `name` (case-insensitive), if it is one."""
    return next((cls for known, cls in STREAMING_SCHEDULES.items() if known.lower() == name.lower()), None)


def register() -> None:
    """Make torch's and torchtitan's schedule lookups know the streaming schedules (idempotent)."""
    from torchtitan.distributed import pipeline_parallel

    original = torch_schedules.get_schedule_class
    if getattr(original, "knows_streaming", False):
        return

    def get_schedule_class(name: str):
        return streaming_schedule(name) or original(name)

    get_schedule_class.knows_streaming = True
    torch_schedules.get_schedule_class = get_schedule_class
    pipeline_parallel.get_schedule_class = get_schedule_class
