"""PipeDream2BW and PACI as torch pipeline schedules, selectable by name in torchtitan.

They are single-stage-per-rank schedules (`PipelineScheduleSingle`), so torchtitan's
pipeline builder splits and wraps the model exactly as for 1F1B. Unlike torch's
schedules they do not flush: `attach` returns the rank's `StreamEngine`, which the
trainer feeds one window per optimizer step and drains before checkpoints,
validation and the end of training.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist
from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from titan_async.pipeline import actions as plan
from titan_async.pipeline.executor import Microbatch, StageExecutor
from titan_async.pipeline.stream import StreamEngine
from titan_async.pipeline.trace import Timeline
from titan_async.pipeline.transport import P2PTransport, edge_groups
from titan_async.pipeline.versions import make_policy

_EVAL_IDS = 1 << 23


class StreamingSchedule(PipelineScheduleSingle):
    """A torch schedule name for a streaming stream; `attach` builds the stream of this rank's stage."""

    name: str

    def _get_pipeline_order(self):
        return plan.pipeline_order(self._num_stages, self._n_microbatches, windows=2)

    def _step_microbatches(self, *args, **kwargs):
        raise RuntimeError(f"{type(self).__name__} is driven by titan-async's trainer (its stream), not step()")

    def attach(self, *, optimizer_step: Callable[[], None], microbatches: int, accumulation: int | None, keep_trace: bool,
               sync_start: int = 0, prediction: float = 0.0) -> StreamEngine:
        """This rank's stream: its stage, the weight policy (synchronous for the first `sync_start`
        batches; 2BW's versions predicted with horizon `prediction`), P2P transport and timeline;
        a window holds `microbatches` (those of every local batch an optimizer step accumulates)."""
        stage = self._stage
        self.policy = make_policy(self.name, stage.submod, microbatches, accumulation, hold_gathered=True, sync_start=sync_start,
                                 prediction=prediction, stages_after=stage.num_stages - 1 - stage.stage_index,
                                 lag=plan.gradient_delay(stage.num_stages, microbatches))
        self.timeline = Timeline(dist.get_rank(), keep_trace, stage.device)
        groups = edge_groups(stage.group, stage.stage_index_to_group_rank, stage.device)
        self.transport = P2PTransport(groups, stage.stage_index, stage.num_stages, stage.device)
        self.executor = StageExecutor(
            stage.submod, stage.stage_index, stage.num_stages, self.transport, self.policy, self._loss_fn, self.timeline
        )
        return StreamEngine([self.executor], stage.num_stages, microbatches, {stage.stage_index: optimizer_step})

    def eval(self, *args, arg_mbs=None, kwarg_mbs=None, target_mbs=None, losses=None, **kwargs):
        """Forward-only pass for validation (the trainer drains the stream first)."""
        microbatches = [
            Microbatch(args=arg_mbs[i] if arg_mbs else (), kwargs=kwarg_mbs[i], target=target_mbs[i] if target_mbs else None)
            for i in range(len(kwarg_mbs))
        ]
        result = self.executor.evaluate(microbatches, {}, _EVAL_IDS)
        if losses is not None:
            losses.extend(result)


class SchedulePipeDream2BW(StreamingSchedule):
    """PipeDream-2BW: two weight versions per stage, a constant one-step gradient delay."""

    name = "PipeDream2BW"


class SchedulePACI(StreamingSchedule):
    """PACI: no stash; each stage steps in place after every `accumulation` local backwards
    (`versions.LocalAccumulation`: the rule it trains, with and without activation checkpointing)."""

    name = "PACI"


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
