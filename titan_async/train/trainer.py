"""torchtitan's Trainer with what titan-async runs need.

- exact resume (RNG state, weight versions) from a checkpoint whose checksums each rank verifies
  for its share of the files it loads (`verified_load`), a graceful stop on SIGINT/SIGTERM, progress;
- initial weights that depend only on the seed, whatever the parallel layout;
- one step runner per schedule family, picked once (`_step_runner`): torch's schedules and no
  pipeline (`SynchronousSteps`), the single-process delayed-gradient rule
  (`training.gradient_delay = 1`, `DelayedSteps`), the streaming schedules and their emulation
  (`StreamingSteps`: one window per step, drained before checkpoints, validation and the end,
  and after each of the first `training.sync_start_steps` steps, which are synchronous).

Gradient clipping: synchronous schedules clip the global norm (torchtitan). Streaming
schedules have no global synchronisation point: each stage clips its own gradient to
`training.max_norm` when it steps, or by a global norm three steps old
(`training.clipping`); the logged norm is the global one (`StreamingSteps`).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from titan_async.core import comm_log
from titan_async.data.batch_ramp import BatchRamp
from titan_async.model.init import reinitialize_by_name
from titan_async.optim import write_param_group_table
from titan_async.parallel.fsdp_traffic import count_fsdp_traffic
from titan_async.pipeline.schedules import StreamingSchedule
from titan_async.train.benchmarks import EvalSection, PeriodicBenchmarks
from titan_async.train.checkpoint_state import RNG, RNGState, configured_over_loaded, keep_weight_versions
from titan_async.train.delayed_steps import DelayedSteps
from titan_async.train.health import HealthGuard, HealthSection
from titan_async.train.late_read import LateAllReduce
from titan_async.train.save_hooks import SaveHooks
from titan_async.train.stage_records import StageRecords, written_stage
from titan_async.train.streaming_steps import StreamingSteps
from titan_async.train.synchronous_steps import SynchronousSteps
from titan_async.train.verified_load import verify_loads


BATCH_LOG_ENV = "TITAN_ASYNC_BATCH_LOG"


class StopRequest:
    """Turns SIGINT/SIGTERM, or too many non-finite gradients, into a stop that all ranks
    see at the same step.

    The first signal asks for the stop; the second (a launcher may forward a Ctrl-C that the
    terminal already delivered) only says that it is under way; the third aborts at once.
    """

    REASONS = (None, "signal", "nonfinite")

    def __init__(self) -> None:
        self.reason: str | None = None
        self.signals = 0
        self.pending: deque[LateAllReduce] = deque()
        self.behind = 1
        """Calls between an all-reduce's start and its read: the windows by which the pipeline's
        first stage trails its last (`actions.gradient_delay`; 1 without a pipeline)."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame) -> None:
        self.signals += 1
        if self.signals == 1:
            self.reason = self.reason or "signal"
        elif self.signals == 2 and os.environ.get("RANK", "0") == "0":
            print("titan-async: a stop is under way: the ranks finish their step and save a checkpoint; "
                  "a third signal aborts, losing the steps since the last checkpoint", file=sys.stderr, flush=True)
        elif self.signals > 2:
            raise KeyboardInterrupt

    def request(self, reason: str) -> None:
        self.reason = self.reason or reason

    def agreed(self, device: torch.device) -> str | None:
        """The reason to stop that any rank had `behind` calls ago, on every rank.

        Each call starts one all-reduce and reads the one every rank started `behind` steps ago
        (`LateAllReduce`): a step boundary is then no synchronisation point, on the host or on a
        device, so a streaming pipeline keeps flowing across it (its last stage finishes a
        window up to `behind` windows after the first). A stop takes effect `behind` steps
        after the request."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return self.reason
        code = torch.full((1,), self.REASONS.index(self.reason), device=device)
        self.pending.append(LateAllReduce(code, dist.ReduceOp.MAX))
        if len(self.pending) <= self.behind:
            return None
        return self.REASONS[int(self.pending.popleft().read()[0])]


class AsyncTrainer(Trainer):
    """Trainer for titan-async runs; see the module docstring."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        health: HealthSection = field(default_factory=HealthSection)
        eval: EvalSection = field(default_factory=EvalSection)

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        if config.debug.seed is not None:
            reinitialize_by_name(self.model_parts, config.debug.seed)
        if self.checkpointer.enable:
            self.checkpointer.states[RNG] = RNGState()
            verify_loads(self.checkpointer)
        if config.validator.enable:
            self.validator.last_step = config.training.steps
        self.stop_request = StopRequest()
        self.stop_reason: str | None = None
        self.health = HealthGuard(config.health)
        self.fsdp_traffic = count_fsdp_traffic(self.model_parts)
        self.save_hooks = SaveHooks(self.checkpointer)
        self.first_step_hooks: list[Callable[[], None]] = []  # called once, as the first step this process trains starts
        data_ranks = self.parallel_dims.dp_replicate * self.parallel_dims.dp_shard
        self.batch_ramp = BatchRamp.of(config.training, data_ranks) if config.training.batch_ramp_steps else None
        self.steps = self._step_runner()
        self.stop_request.behind = getattr(self.steps, "windows_behind", 1)
        keep_weight_versions(self, self.steps)
        configured_over_loaded(self)
        self.benchmarks = self._benchmark_after_saves(config)
        self.stage_records = self._stage_records(config)

    def _step_runner(self) -> SynchronousSteps | DelayedSteps | StreamingSteps:
        """The step runner of the run's schedule family: the one place that asks which it is."""
        if isinstance(getattr(self, "pp_schedule", None), StreamingSchedule):
            return StreamingSteps(self, emulated=False)
        if self.config.parallelism.emulated_stages:
            return StreamingSteps(self, emulated=True)
        if self.config.training.gradient_delay:
            return DelayedSteps(self)
        return SynchronousSteps(self)

    def _benchmark_after_saves(self, config: Config) -> PeriodicBenchmarks | None:
        """On the rank that writes metrics.jsonl, with `[eval] tasks`: evaluate the checkpoints
        of the benchmark steps once saved, and log finished evaluations at each step's save call
        (torchtitan calls `checkpointer.save` every step; it saves on the interval)."""
        if not config.eval.tasks or self.metrics_processor.tee is None:
            return None
        benchmarks = PeriodicBenchmarks(config.eval, config.checkpoint.interval, Path(config.dump_folder),
                                        self.metrics_processor.logger.log)

        def after_save(step: int, last_step: bool, saved: bool) -> None:
            if saved:
                benchmarks.after_save(step, getattr(self.checkpointer, "save_future", None))
            benchmarks.log_finished()

        self.save_hooks.after.append(after_save)
        return benchmarks

    def batch_generator(self, data_iterable):
        """torchtitan's batches; with `TITAN_ASYNC_BATCH_LOG=DIR` each rank also appends every batch
        it hands to training (token ids, positions, labels) to DIR/rank<R>.jsonl, in the order
        consumed: what the tests' independent reference trains on (tests/independent_reference.py)."""
        batches = super().batch_generator(data_iterable)
        folder = os.environ.get(BATCH_LOG_ENV)
        if not folder:
            yield from batches
            return
        Path(folder).mkdir(parents=True, exist_ok=True)
        path = Path(folder) / f"rank{dist.get_rank() if dist.is_initialized() else 0}.jsonl"
        for input_dict, labels in batches:
            record = {key: value.tolist() for key, value in input_dict.items()}
            with open(path, "a") as f:
                f.write(json.dumps({**record, "labels": labels.tolist()}) + "\n")
            yield input_dict, labels

    def train_step(self, data_iterator) -> None:
        while self.first_step_hooks:  # every rank has loaded the checkpoint (a collective) and built
            self.first_step_hooks.pop(0)()
        comm_log.note({"op": "step", "step": self.step})
        self.metrics_processor.start_training_step()
        if self.batch_ramp is not None:
            self._follow_batch_ramp()
        self.steps.run(data_iterator)
        self.health.end_step()
        if self.health.exhausted():
            self.stop_request.request("nonfinite")
        if self.steps.per_stage_records:
            self._record_stage_step()
        self.metrics_processor.end_training_step()

    def _follow_batch_ramp(self) -> None:
        """Accumulate the local batches of the ramp's global batch for this step (the streaming
        schedules drained before a step whose size changes, `StreamingSteps._must_drain`)."""
        size, dims = self.batch_ramp.size_at(self.step - 1), self.parallel_dims
        accumulation = size // (self.config.training.local_batch_size * dims.dp_replicate * dims.dp_shard)
        if accumulation == self.gradient_accumulation_steps:
            return
        logger.info(f"Batch-size ramp: {size} sequences per step from step {self.step} "
                    f"({accumulation} local batches per data rank)")
        self.gradient_accumulation_steps = accumulation
        self.steps.resize()

    def _stage_records(self, config: Config) -> StageRecords | None:
        """The writer of this rank's stage scalars, on the one rank per stage that writes them."""
        if not self.steps.per_stage_records:
            return None
        stage = written_stage(dist.get_rank(), self.parallel_dims.world_size, self.parallel_dims.pp)
        return None if stage is None else StageRecords(Path(config.dump_folder), stage, config.metrics)

    def _record_stage_step(self) -> None:
        """The stage's pipeline scalars for the step, as its writing rank sees them (`stage_records`):
        end time, step time, peak memory; with a streaming schedule the bubble, the staleness of
        the applied gradient and the memory of weight versions beyond the live weights (shards,
        and gathered under FSDP); with FSDP the bytes all-gathered and reduce-scattered; on
        logging steps, which read the device anyway, the error-feedback correction norm.
        metrics.jsonl only holds the reporting rank's view. Every rank takes the step's
        scalars, which resets their per-step counts; only the writer builds and writes the record."""
        now = time.time()
        scalars = self.steps.rank_scalars()
        if self.stage_records is None:
            return
        step_time, self._last_step_end = now - getattr(self, "_last_step_end", now), now
        record = {
            "step": self.step,
            "rank": dist.get_rank(),
            "time": now,
            "step_time_s": step_time,
            "memory_gib": self.metrics_processor.device_memory_monitor.get_peak_stats().max_reserved_gib,
            **scalars,
        }
        if self.fsdp_traffic is not None:
            record.update(self.fsdp_traffic.take())
        correction = getattr(self.optimizers, "error_feedback_norm", lambda: None)()
        if correction is not None and self.metrics_processor.should_log(self.step):
            record["ef_correction_norm"] = float(correction)
        self.stage_records.write(record)

    def should_continue_training(self) -> bool:
        if self.step >= self.config.training.steps:
            return False
        reason = self.stop_request.agreed(self.device) if self.step > 0 else None
        if reason:
            self.stop_reason = reason
            logger.warning(f"Stopping at step {self.step} ({reason}); saving a checkpoint before exiting")
            self.steps.drain()
            self.checkpointer.save(self.step, last_step=True)
            return False
        return True

    def load_rank0s_choice(self) -> None:
        """Make every rank load the checkpoint step rank 0 chose (`checkpoint.load_step`, set by
        the worker from its scan of the run directory): on a shared file system, nodes may list
        different checkpoints, and ranks loading different steps would hang the pipeline."""
        if not (self.checkpointer.enable and dist.is_initialized() and dist.get_world_size() > 1):
            return
        choice = [self.config.checkpoint.load_step]
        dist.broadcast_object_list(choice, src=0)
        self.config.checkpoint.load_step = choice[0]

    def train(self) -> None:
        self.load_rank0s_choice()
        write_param_group_table(self.optimizers, self.config.dump_folder)
        self.metrics_processor.start_display(self.config.training.steps)
        try:
            super().train()
            if self.benchmarks is not None:
                self.benchmarks.finish()
        finally:
            self.metrics_processor.close_display(self.step, self.ntokens_seen)
            if self.stage_records is not None:
                self.stage_records.close()
            if self.steps.timeline is not None and self.config.metrics.pipeline_trace:
                folder = Path(self.config.dump_folder) / "pipeline"
                folder.mkdir(exist_ok=True)
                self.steps.timeline.write(folder / f"trace_rank{dist.get_rank()}.json")
