"""torchtitan's Trainer with what titan-async runs need.

- exact resume (RNG state, weight versions), a graceful stop on SIGINT/SIGTERM, progress;
- initial weights that depend only on the seed, whatever the parallel layout;
- the streaming schedules (PipeDream2BW, PACI): one window per step, drained before
  checkpoints, validation and the end; and the single-process delayed-gradient rule
  (`training.gradient_delay = 1`).

Gradient clipping: synchronous schedules clip the global norm (torchtitan). Streaming
schedules have no global synchronisation point, so each stage clips its own gradient
to `training.max_norm` when it steps; the logged norm is the last stage's.
"""

from __future__ import annotations

import json
import random
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from titan_async.init import canonical_name, reinitialize_by_name
from titan_async.pipeline.schedules import StreamingSchedule
from titan_async.pipeline.versions import TwoVersions


class RNGState(Stateful):
    """This rank's torch (CPU and CUDA) and Python RNG states, keyed by rank in checkpoints."""

    def __init__(self) -> None:
        self.key = f"rank{dist.get_rank()}"

    def state_dict(self) -> dict[str, Any]:
        state = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state()
        return {self.key: state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = state_dict[self.key]
        torch.set_rng_state(state["torch"])
        random.setstate(state["python"])
        if "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"])


class WeightVersionState(Stateful):
    """A weight-version policy's state (the second 2BW version, PACI's partial sums) for checkpoints."""

    def __init__(self, policy, names: list[str], trainer: Trainer) -> None:
        self.policy, self.names, self.trainer = policy, names, trainer

    def state_dict(self) -> dict[str, Any]:
        return self.policy.state_dict(self.names, self.trainer.step)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.policy.load_state_dict(state_dict, self.names, self.trainer.step)


class StopRequest:
    """Turns SIGINT/SIGTERM into a request that all ranks see at the same step.

    Launchers forward a Ctrl-C that the terminal already delivered, so a repeat
    within `patience` seconds is the same request; a later one aborts at once.
    """

    def __init__(self, patience: float = 3.0) -> None:
        self.signal: int | None = None
        self.received_at = 0.0
        self.patience = patience
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame) -> None:
        now = time.monotonic()
        if self.signal is not None and now - self.received_at > self.patience:
            raise KeyboardInterrupt
        if self.signal is None:
            self.signal, self.received_at = signum, now

    def agreed(self) -> bool:
        """True on every rank once any rank was signalled (one all-reduce per call)."""
        flag = torch.tensor([0 if self.signal is None else 1])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


class AsyncTrainer(Trainer):
    """Trainer for titan-async runs; see the module docstring."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        pass

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        if config.debug.seed is not None:
            reinitialize_by_name(self.model_parts, config.debug.seed)
        if self.checkpointer.enable:
            self.checkpointer.states["rng"] = RNGState()
        if config.validator.enable:
            self.validator.last_step = config.training.steps
        self.stop_request = StopRequest()
        self.stopped_by_signal: int | None = None
        self.stage_grad_norm = torch.tensor(0.0)
        self.weight_policy = self._attach_weight_policy()

    @property
    def streaming(self) -> bool:
        return isinstance(getattr(self, "pp_schedule", None), StreamingSchedule)

    def _attach_weight_policy(self):
        """The weight-version policy of a streaming schedule or of gradient_delay = 1, if any."""
        model = self.model_parts[0]
        names = [canonical_name(n) for n, _ in model.named_parameters()]
        if self.streaming:
            self.pp_schedule.attach(
                optimizer_step=self._stage_optimizer_step,
                accumulation=self.config.parallelism.paci.accumulation,
                keep_trace=self.config.metrics.pipeline_trace,
                param_names=names,
            )
            policy = self.pp_schedule.policy
        elif self.config.training.gradient_delay:
            policy = TwoVersions(list(model.parameters()), microbatches=1)
        else:
            return None
        if self.checkpointer.enable:
            self.checkpointer.states["weight_versions"] = WeightVersionState(policy, names, self)
        return policy

    def _stage_optimizer_step(self) -> None:
        """Clip this stage's gradient on its own, step, zero it, and advance the learning rate
        by the batches this stage has now completed (streaming schedules)."""
        params = [p for m in self.model_parts for p in m.parameters()]
        self.stage_grad_norm = torch.nn.utils.clip_grad_norm_(params, self.config.training.max_norm, foreach=True)
        self.optimizers.step()
        self.optimizers.zero_grad()
        while self.lr_schedulers.schedulers[0].last_epoch < self.weight_policy.lr_steps_due():
            self.lr_schedulers.step()

    def _must_drain(self) -> bool:
        """Whether the step just taken is followed by a checkpoint, validation or the end."""
        step, config = self.step, self.config
        checkpoint = config.checkpoint.enable and step % config.checkpoint.interval == 0
        validation = config.validator.enable and self.validator.should_validate(step)
        return step >= config.training.steps or checkpoint or validation

    def train_step(self, data_iterator) -> None:
        if self.streaming:
            self._streaming_train_step(data_iterator)
        elif self.weight_policy is not None:
            self._delayed_train_step(data_iterator)
        else:
            super().train_step(data_iterator)

    def _delayed_train_step(self, data_iterator) -> None:
        """One step of W[k+1] = W[k] - Opt(grad f_k(W[k-1])): torchtitan's step with the
        gradient taken at the previous version and the update applied to the latest one.
        Afterwards the parameters hold the latest version, W[step], as a checkpoint expects."""
        batch = self.step - 1
        self.weight_policy.activate(batch)
        step_optimizer = self.optimizers.step
        self.optimizers.step = lambda: self.weight_policy.apply_update(batch, step_optimizer)
        try:
            super().train_step(data_iterator)
        finally:
            del self.optimizers.step
        self.weight_policy.activate(self.step + 1)

    def _streaming_train_step(self, data_iterator) -> None:
        """Feed batch `step - 1` into the stream and report the loss of the batch it completed."""
        lr_metrics = self.lr_schedulers.get_metrics()
        microbatches = [next(data_iterator) for _ in range(self.num_pipeline_parallel_microbatches)]
        valid_tokens = sum(int((labels != IGNORE_INDEX).sum()) for _, labels in microbatches)
        global_valid_tokens = torch.tensor(valid_tokens, device=self.device)
        arg_mbs, kwarg_mbs, target_mbs = [], [], []
        for input_dict, labels in microbatches:
            input_dict = {k: v.to(self.device) for k, v in input_dict.items()}
            inputs, labels, extra_kwargs = self.post_dataloading_process(input_dict, labels.to(self.device))
            arg_mbs.append((inputs,))
            kwarg_mbs.append(extra_kwargs)
            target_mbs.append(labels)
        schedule = self.pp_schedule
        with self.train_context():
            losses = schedule.run_window(
                arg_mbs if self.pp_has_first_stage else None,
                kwarg_mbs,
                target_mbs if self.pp_has_last_stage else None,
                {"global_valid_tokens": global_valid_tokens},
            )
            bubble = schedule.bubble()
            if self._must_drain():
                self._drain()
        self._record_window(bubble)
        if not self.metrics_processor.should_log(self.step):
            return
        loss = float(torch.stack(losses).sum()) if losses else -1.0
        extra = {"n_tokens_seen": self.ntokens_seen, "pipeline/bubble": bubble, **lr_metrics}
        self.metrics_processor.log(self.step, loss, loss, float(self.stage_grad_norm), extra_metrics=extra)

    def _drain(self) -> None:
        """Empty the stream; with two versions, expose the latest (W[step]) for saving and validation."""
        self.pp_schedule.drain()
        if isinstance(self.weight_policy, TwoVersions):
            self.weight_policy.activate(self.step + 1)

    def _record_window(self, bubble: float) -> None:
        """Append this rank's bubble of the window to <run-dir>/pipeline/rank<R>.jsonl."""
        folder = Path(self.config.dump_folder) / "pipeline"
        folder.mkdir(exist_ok=True)
        memory = self.metrics_processor.device_memory_monitor.get_peak_stats().max_reserved_gib
        with open(folder / f"rank{dist.get_rank()}.jsonl", "a") as f:
            f.write(json.dumps({"step": self.step, "bubble": bubble, "memory_gib": memory, "time": time.time()}) + "\n")

    def should_continue_training(self) -> bool:
        if self.step >= self.config.training.steps:
            return False
        if self.step > 0 and self.stop_request.agreed():
            self.stopped_by_signal = self.stop_request.signal or signal.SIGTERM
            logger.warning(f"Stop requested at step {self.step}; saving a checkpoint before exiting")
            if self.streaming:
                self._drain()
            self.checkpointer.save(self.step, last_step=True)
            return False
        return True

    def train(self) -> None:
        self.metrics_processor.start_display(self.config.training.steps)
        try:
            super().train()
        finally:
            self.metrics_processor.close_display(self.step, self.ntokens_seen)
            if self.streaming and self.config.metrics.pipeline_trace:
                folder = Path(self.config.dump_folder) / "pipeline"
                folder.mkdir(exist_ok=True)
                self.pp_schedule.write_trace(folder / f"trace_rank{dist.get_rank()}.json")
