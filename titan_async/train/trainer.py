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
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful
from torchtitan.components.checkpointer.base import LR_SCHEDULER, MODEL, OPTIMIZER, ModelWrapper
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.optimizer import register_moe_load_balancing_hook
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.activation_checkpoint import FullAC
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from titan_async.model.init import canonical_name, reinitialize_by_name
from titan_async.optim import write_param_group_table
from titan_async.parallel.fsdp_stage import FsdpStage
from titan_async.parallel.fsdp_traffic import count_fsdp_traffic
from titan_async.pipeline.config import microbatches
from titan_async.pipeline.emulation import stage_modules, stage_view
from titan_async.pipeline.executor import Microbatch, StageExecutor
from titan_async.pipeline.load_balance import DelayedLoadBalance, StageLoadBalance, moe_blocks, versioned_tensors
from titan_async.pipeline.schedules import StreamingSchedule
from titan_async.pipeline.stream import StreamEngine
from titan_async.pipeline.trace import Timeline, trace_torch_stages
from titan_async.pipeline.transport import LocalTransport
from titan_async.pipeline.versions import LocalAccumulation, OneStepDelay, TwoVersions, make_policy, two_versions
from titan_async.run import comm_log
from titan_async.train.benchmarks import EvalSection, PeriodicBenchmarks
from titan_async.train.health import HealthGuard, HealthSection, skips_on_device
from titan_async.train.late_read import LateMax
from titan_async.train.wandb_runs import rank_run


def _names(model: torch.nn.Module, policy) -> list[str]:
    """The names of what `policy` keeps per stage: 2BW versions the MoE expert biases too."""
    named = versioned_tensors(model) if isinstance(policy, OneStepDelay) else model.named_parameters()
    return [canonical_name(name) for name, _ in named]


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
    """The weight policies' state (second 2BW versions, PACI's partial sums) of this process's
    stages, keyed by stage so that ranks never share a key."""

    def __init__(self, stages: dict[int, tuple[Any, list[str]]], balances: dict[int, StageLoadBalance], trainer: Trainer) -> None:
        self.stages, self.balances, self.trainer = stages, balances, trainer

    def state_dict(self) -> dict[str, Any]:
        state = {f"stage{stage}": policy.state_dict(names, self.trainer.step) for stage, (policy, names) in self.stages.items()}
        state.update({f"load_balance{stage}": balance.state_dict() for stage, balance in self.balances.items()})
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for stage, (policy, names) in self.stages.items():
            policy.load_state_dict(state_dict[f"stage{stage}"], names, self.trainer.step)
        for stage, balance in self.balances.items():
            balance.load_state_dict(state_dict[f"load_balance{stage}"])


class LiveModelState(ModelWrapper):
    """torchtitan's model state for checkpoints, without its cache of the parameters' tensors.

    The cache assumes each parameter keeps its storage and copies the live values into the
    cached tensor when it does not; `TwoVersions` switches parameters between two buffers, so
    that copy would overwrite the stashed weight version with the latest one at every save
    where the other buffer is live."""

    def state_dict(self) -> dict[str, Any]:
        return self._get_state_dict()


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
        self.pending: LateMax | None = None
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
        """The reason to stop that any rank had at its previous call, on every rank.

        Each call starts one all-reduce and reads the previous call's, which every rank started
        a step ago (`LateMax`): a step boundary is then no synchronisation point, on the host or
        on a device, so a streaming pipeline keeps flowing across it. A stop takes effect one
        step after the request."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return self.reason
        code = torch.full((1,), self.REASONS.index(self.reason), device=device)
        previous, self.pending = self.pending, LateMax(code)
        return None if previous is None else self.REASONS[int(previous.read()[0])]


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
            self.checkpointer.states["rng"] = RNGState()
        if config.validator.enable:
            self.validator.last_step = config.training.steps
        self.stop_request = StopRequest()
        self.stop_reason: str | None = None
        self.health = HealthGuard(config.health)
        self.stage_grad_norms: dict[int, torch.Tensor] = {}
        self.fsdp_traffic = count_fsdp_traffic(self.model_parts)
        self.stream: StreamEngine | None = None
        self.delay: OneStepDelay | None = None
        self.timeline = None
        self.stage_group = self._stage_group()
        self.balances: dict[int, StageLoadBalance] = {}
        self.delayed_balance: DelayedLoadBalance | None = None
        policies = self._attach_weight_policies()
        self._trace_torch_schedule()
        self._balance_expert_load(policies)
        paci = any(isinstance(policy, LocalAccumulation) for policy, _ in policies.values())
        if paci and isinstance(config.activation_checkpoint, FullAC.Config):
            logger.warning("PACI with activation_checkpoint.mode = 'full': each block's backward recomputes its forward with "
                           "the weights current at the backward (PACI's \"mem\" rule), not with the forward's")
        if self.stream is not None:
            self._drain_before_every_save()
        if policies and self.checkpointer.enable:
            self.checkpointer.states["weight_versions"] = WeightVersionState(policies, self.balances, self)
            if any(isinstance(policy, TwoVersions) for policy, _ in policies.values()):
                self.checkpointer.states[MODEL] = LiveModelState(self.model_parts)
        self.benchmarks = self._benchmark_after_saves(config)
        self.rank_wandb = None

    def _benchmark_after_saves(self, config: Config) -> PeriodicBenchmarks | None:
        """On the rank that writes metrics.jsonl, with `[eval] tasks`: evaluate the checkpoints
        of the benchmark steps once saved, and log finished evaluations at each step's save call
        (torchtitan calls `checkpointer.save` every step; it saves on the interval)."""
        if not config.eval.tasks or self.metrics_processor.tee is None:
            return None
        benchmarks = PeriodicBenchmarks(config.eval, config.checkpoint.interval, Path(config.dump_folder),
                                        self.metrics_processor.logger.log)
        save = self.checkpointer.save

        def save_then_benchmark(step: int, last_step: bool = False) -> bool:
            saved = save(step, last_step=last_step)
            if saved:
                benchmarks.after_save(step)
            benchmarks.log_finished()
            return saved

        self.checkpointer.save = save_then_benchmark
        return benchmarks

    def _stage_group(self) -> dist.ProcessGroup | None:
        """The ranks that decide a stage's update together: under a streaming schedule those that
        hold this rank's stage (its data-parallel and tensor-parallel ranks), else the data-parallel
        ranks; None for one rank. Collective over the world: pp is the outermost dimension of
        torchtitan's mesh, so stage s holds ranks [s * n, (s + 1) * n)."""
        dims = self.parallel_dims
        if dims.world_size == 1:
            return None
        if not isinstance(getattr(self, "pp_schedule", None), StreamingSchedule):
            return self.parallel_dims.get_mesh("batch").get_group() if dims.dp_enabled else None
        n = dims.world_size // dims.pp
        if n == 1:
            return None
        group, _ = dist.new_subgroups_by_enumeration([list(range(s * n, (s + 1) * n)) for s in range(dims.pp)])
        return group

    def _attach_weight_policies(self) -> dict[int, tuple[Any, list[str]]]:
        """Stage -> (weight policy, parameter names) of a streaming schedule, its emulation,
        or gradient_delay = 1 (stage 0); empty for synchronous training."""
        config = self.config
        if isinstance(getattr(self, "pp_schedule", None), StreamingSchedule):
            schedule, stage = self.pp_schedule, self.pp_schedule._stage.stage_index
            every_optimizer = list(range(len(self.optimizers.optimizers)))
            self.stream = schedule.attach(
                optimizer_step=lambda: self._stage_optimizer_step(stage, every_optimizer, schedule.policy, self.balances.get(stage)),
                microbatches=self.gradient_accumulation_steps * self.num_pipeline_parallel_microbatches,
                accumulation=config.parallelism.paci.accumulation,
                keep_trace=config.metrics.pipeline_trace,
            )
            self.timeline = schedule.timeline
            return {stage: (schedule.policy, _names(self.model_parts[0], schedule.policy))}
        if config.parallelism.emulated_stages:
            return self._emulate_stages()
        if config.training.gradient_delay:
            model = self.model_parts[0]
            self.delay = two_versions(model, 1, FsdpStage.of(model))
            return {0: (self.delay, _names(model, self.delay))}
        return {}

    def _trace_torch_schedule(self) -> None:
        """With `metrics.pipeline_trace` under one of torch's schedules: a timeline of this rank's
        stage actions and optimizer steps, one window per step (trace JSON, Gantt PNG, bubble)."""
        if self.timeline is not None or not self.config.metrics.pipeline_trace or not self.parallel_dims.pp_enabled:
            return
        self.timeline = Timeline(dist.get_rank(), True, self.device)
        trace_torch_stages(self._local_stages(), self.timeline)

    def _emulate_stages(self) -> dict[int, tuple[Any, list[str]]]:
        """Split the model into stage views in this process, each with its own optimizer,
        learning-rate schedule and weight policy (the single-process emulation)."""
        config = self.config
        model = self.model_parts[0]
        views = [stage_view(model, names) for names in stage_modules(config.parallelism, len(model.layers))]
        self.optimizers = config.optimizer.build(model_parts=views)
        self.lr_schedulers = config.lr_scheduler.build(optimizers=self.optimizers, training_steps=config.training.steps)
        self.metrics_processor.optimizers = self.optimizers
        if self.checkpointer.enable:
            self.checkpointer.states.update({OPTIMIZER: self.optimizers, LR_SCHEDULER: self.lr_schedulers})
        m = self.gradient_accumulation_steps * microbatches(config.training, config.parallelism)
        mailbox: dict = {}
        policies, executors, steps = {}, [], {}
        for stage, view in enumerate(views):
            policy = make_policy(config.parallelism.pipeline_parallel_schedule, view, m, config.parallelism.paci.accumulation)
            policies[stage] = (policy, _names(view, policy))
            executors.append(
                StageExecutor(view, stage, len(views), LocalTransport(mailbox, stage), policy, self._emulated_loss, Timeline(0, False))
            )
            owned = self._optimizers_of(view)
            steps[stage] = lambda stage=stage, owned=owned, policy=policy: self._stage_optimizer_step(
                stage, owned, policy, self.balances.get(stage))
        self.stream = StreamEngine(executors, len(views), m, steps)
        return policies

    def _balance_expert_load(self, policies: dict[int, tuple[Any, list[str]]]) -> None:
        """MoE load balancing where each stage steps (`pipeline.load_balance`): per stage for the
        streaming schedules and their emulation, once per step for the delayed reference, and
        torchtitan's optimizer hook for synchronous training."""
        data_group = self.parallel_dims.get_mesh("batch").get_group() if self.parallel_dims.dp_enabled else None
        if self.stream is not None:
            for executor in self.stream.executors:
                blocks = moe_blocks(executor.module)
                if blocks:
                    executor.balance = self.balances[executor.stage] = StageLoadBalance(blocks, data_group)
        elif self.delay is not None:
            blocks = moe_blocks(self.model_parts[0])
            self.delayed_balance = DelayedLoadBalance(blocks, data_group) if blocks else None
        elif not policies:
            register_moe_load_balancing_hook(self.optimizers, self.model_parts, self.parallel_dims)

    def _emulated_loss(self, pred, labels, **loss_kwargs):
        loss, _ = self.loss_fn(pred, labels, **loss_kwargs)
        return loss

    def _optimizers_of(self, stage: torch.nn.Module) -> list[int]:
        """Indices of the optimizers (and their lr schedulers) that update `stage`'s parameters."""
        owned = {id(p) for p in stage.parameters()}
        return [
            i for i, optimizer in enumerate(self.optimizers.optimizers)
            if all(id(p) in owned for group in optimizer.param_groups for p in group["params"])
        ]

    def _stage_optimizer_step(self, stage: int, indices: list[int], policy, balance: StageLoadBalance | None) -> None:
        """Move the stage's expert biases (MoE; also when the health check skips the update: the
        counts are finite), clip its gradient on its own, step and zero its optimizers, and
        advance their learning rates by the batches the stage has now completed (streaming
        schedules).

        The health check decides on the device when every optimizer can skip an update there
        (`skips_on_device`), so a stage stepping inside a window never waits for the device."""
        if balance:
            balance.step()
        optimizers = [self.optimizers.optimizers[i] for i in indices]
        params = [p for optimizer in optimizers for group in optimizer.param_groups for p in group["params"]]
        on_device = all(skips_on_device(optimizer) for optimizer in optimizers)
        found_inf = self.health.found_nonfinite(self.step, stage, params, group=self.stage_group) if on_device else None
        if on_device or self.health.allow_update(self.step, stage, params, group=self.stage_group):
            self.stage_grad_norms[stage] = dist_utils.clip_grad_norm_(
                params, self.config.training.max_norm, foreach=True, ep_enabled=self.parallel_dims.ep_enabled)
            for optimizer in optimizers:
                optimizer.found_inf = found_inf
                optimizer.step()
                del optimizer.found_inf
        for optimizer in optimizers:
            optimizer.zero_grad()
        for i in indices:
            scheduler = self.lr_schedulers.schedulers[i]
            while scheduler.last_epoch < policy.lr_steps_due():
                scheduler.step()

    def _must_drain(self) -> bool:
        """Whether the step just taken is followed by a checkpoint, validation or the end."""
        step, config = self.step, self.config
        checkpoint = config.checkpoint.enable and step % config.checkpoint.interval == 0
        validation = config.validator.enable and self.validator.should_validate(step)
        return step >= config.training.steps or checkpoint or validation

    def train_step(self, data_iterator) -> None:
        comm_log.note({"op": "step", "step": self.step})
        self.metrics_processor.start_training_step()
        if self.stream is not None:
            self._streaming_train_step(data_iterator)
        elif self.delay is not None:
            self._delayed_train_step(data_iterator)
        elif self.timeline is not None:
            self._traced_train_step(data_iterator)
        else:
            self._synchronous_train_step(data_iterator, lambda step_optimizer: step_optimizer())
        self.health.end_step()
        if self.health.exhausted():
            self.stop_request.request("nonfinite")
        if self.parallel_dims.pp_enabled or self.stream is not None:
            self._record_rank_step()
        self.metrics_processor.end_training_step()

    def _synchronous_train_step(self, data_iterator, update) -> None:
        """torchtitan's step, with `update(optimizer_step)` in place of the optimizer step and
        the update skipped on every rank when any gradient is not finite."""
        step_optimizer = self.optimizers.step
        # The optimizer's own parameters: FSDP may leave other (unsharded) ones registered on the modules.
        params = [p for optimizer in self.optimizers.optimizers for group in optimizer.param_groups for p in group["params"]]
        stage = self._first_local_stage() if self.parallel_dims.pp_enabled else 0
        skipped = self.health.skipped

        def guarded_update() -> None:
            if self.health.allow_update(self.step, stage, params, group=dist.group.WORLD):
                update(step_optimizer)

        self.optimizers.step = guarded_update
        try:
            super().train_step(data_iterator)
        except RuntimeError as err:
            if self.health.skipped == skipped or "Loss is not finite" not in str(err):
                raise
        finally:
            del self.optimizers.step

    def _traced_train_step(self, data_iterator) -> None:
        """torchtitan's step under a traced torch schedule: one timeline window, the optimizer
        step recorded as `<first local stage>O<step>`."""

        def update(step_optimizer) -> None:
            with self.timeline.action(f"{self._first_local_stage()}O{self.step}"):
                step_optimizer()

        self.timeline.start_window()
        self._synchronous_train_step(data_iterator, update)
        self.timeline.end_window()

    def _local_stages(self) -> list:
        """This rank's pipeline stages under torch's schedule: interleaved schedules hold several."""
        schedule = self.pp_schedule
        return schedule._stages if hasattr(schedule, "_stages") else [schedule._stage]

    def _first_local_stage(self) -> int:
        return self._local_stages()[0].stage_index

    def _delayed_train_step(self, data_iterator) -> None:
        """One step of W[k+1] = W[k] - Opt(grad f_k(W[k-1])): torchtitan's step with the
        gradient taken at the previous version and the update applied to the latest one.
        Afterwards the parameters hold the latest version, W[step], as a checkpoint expects."""
        batch = self.step - 1
        self.delay.activate(batch)

        def update(step_optimizer) -> None:
            def step() -> None:
                if self.delayed_balance:
                    self.delayed_balance.step()
                step_optimizer()

            self.delay.apply_update(batch, step)

        self._synchronous_train_step(data_iterator, update)
        self.delay.activate(self.step + 1)

    def _streaming_train_step(self, data_iterator) -> None:
        """Feed batch `step - 1` into the stream and report the loss of the batch it completed.

        Nothing here waits for the device except, on logging steps, the read of the loss: the
        batch is copied from pinned memory without blocking, so on a GPU the host loads the
        next batch while the device still runs this window."""
        lr_metrics = self.lr_schedulers.get_metrics()
        batches = [next(data_iterator) for _ in range(self.gradient_accumulation_steps * self.num_pipeline_parallel_microbatches)]
        microbatches = []
        for input_dict, labels in self._split_for_emulation(batches):
            input_dict = {k: self._to_device(v) for k, v in input_dict.items()}
            inputs, labels, extra_kwargs = self.post_dataloading_process(input_dict, self._to_device(labels))
            microbatches.append(Microbatch(args=(inputs,), kwargs=extra_kwargs, target=labels))
        global_valid_tokens = sum((m.target != IGNORE_INDEX).sum() for m in microbatches)
        if self.parallel_dims.dp_enabled:
            global_valid_tokens = dist_utils.dist_sum_tensor(global_valid_tokens, self.parallel_dims.get_mesh("batch"))
        loss_kwargs = {"global_valid_tokens": global_valid_tokens}
        with self.train_context():
            if self.timeline:
                self.timeline.start_window()
            losses = self.stream.run_window(self.step - 1, microbatches, loss_kwargs)
            bubble = self.timeline.end_window() if self.timeline else None
            if self._must_drain():
                self._drain()
        extra = {"n_tokens_seen": self.ntokens_seen, **lr_metrics}
        if bubble is not None:
            extra["pipeline/bubble"] = bubble
        if self.metrics_processor.should_log(self.step):
            loss, grad_norm = self._loss_and_grad_norm(losses)
            self.metrics_processor.log(self.step, loss, loss, grad_norm, extra_metrics=extra)

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` on the training device; to a GPU through pinned memory, without a host sync."""
        if self.device.type != "cuda":
            return tensor.to(self.device)
        return tensor.pin_memory().to(self.device, non_blocking=True)

    def _loss_and_grad_norm(self, losses: list[torch.Tensor]) -> tuple[float, float]:
        """The step's loss summed over the data ranks (-1 on stages without a loss) and the
        last local stage's gradient norm, read from the device in one transfer."""
        if losses:
            loss = torch.stack(losses).sum()
            if self.parallel_dims.dp_enabled:
                loss = dist_utils.dist_sum_tensor(loss, self.parallel_dims.get_optional_mesh("loss"))
        else:
            loss = torch.full((), -1.0, device=self.device)
        norm = self.stage_grad_norms[max(self.stage_grad_norms)] if self.stage_grad_norms else torch.zeros((), device=self.device)
        loss, grad_norm = torch.stack([loss.float().reshape(()), norm.float().reshape(()).to(loss.device)]).tolist()
        return loss, grad_norm

    def _split_for_emulation(self, batches: list) -> list:
        """The emulation loads whole batches (no PP): cut each into its pipeline microbatches."""
        if not self.config.parallelism.emulated_stages:
            return batches
        count = microbatches(self.config.training, self.config.parallelism)
        split = []
        for input_dict, labels in batches:
            parts = {k: v.chunk(count) for k, v in input_dict.items()}
            split += [({k: v[i] for k, v in parts.items()}, labels.chunk(count)[i]) for i in range(count)]
        return split

    def _drain(self) -> None:
        """Empty the stream; with two versions, expose the latest (W[step]) for saving and validation."""
        self.stream.drain()
        self.health.settle()
        if self.timeline:
            self.timeline.restart()
        for executor in self.stream.executors:
            if isinstance(executor.policy, OneStepDelay):
                executor.policy.activate(self.step + 1)

    def _drain_before_every_save(self) -> None:
        """Drain the stream wherever the checkpointer saves, on every save it decides on (the
        first-step checkpoint and any save torchtitan adds included), so that no checkpoint holds
        microbatches in flight. `_must_drain` drains the saves it foresees inside the step."""
        checkpointer, save = self.checkpointer, self.checkpointer.save

        def drained_save(step: int, last_step: bool = False) -> bool:
            if checkpointer._should_save(step, last_step) and not self.stream.drained:
                with self.train_context():
                    self._drain()
            return save(step, last_step=last_step)

        checkpointer.save = drained_save

    def _record_rank_step(self) -> None:
        """This rank's pipeline scalars for the step (end time, step time, peak memory; with a
        streaming schedule the bubble, the staleness of the applied gradient and the memory of
        weight versions beyond the live weights (shards, and gathered under FSDP); with FSDP the
        bytes all-gathered and reduce-scattered; on logging steps, which read the device anyway,
        the error-feedback correction norm): appended to <run-dir>/pipeline/rank<R>.jsonl and
        written to TensorBoard under tb/pipeline/rank<R> and to the rank's W&B run, since
        metrics.jsonl only holds the reporting rank's view."""
        now, rank = time.time(), dist.get_rank()
        record = {
            "step": self.step,
            "time": now,
            "step_time_s": now - getattr(self, "_last_step_end", now),
            "memory_gib": self.metrics_processor.device_memory_monitor.get_peak_stats().max_reserved_gib,
        }
        self._last_step_end = now
        if self.timeline is not None:
            record["bubble"] = self.timeline.last_bubble
        if self.stream is not None:
            record["staleness"] = self._staleness()
            record["weight_versions_gib"] = sum(e.policy.extra_bytes() for e in self.stream.executors) / 2**30
            record["gathered_versions_gib"] = sum(e.policy.gathered_copy_bytes() for e in self.stream.executors) / 2**30
        if self.fsdp_traffic is not None:
            record.update(self.fsdp_traffic.take())
        correction = getattr(self.optimizers, "error_feedback_norm", lambda: None)()
        if correction is not None and self.metrics_processor.should_log(self.step):
            record["ef_correction_norm"] = float(correction)
        folder = Path(self.config.dump_folder) / "pipeline"
        folder.mkdir(exist_ok=True)
        with open(folder / f"rank{rank}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        scalars = {f"pipeline/{key}": value for key, value in record.items() if key not in ("step", "time") and value is not None}
        tb_folder = Path(self.config.dump_folder) / "tb" / "pipeline" / f"rank{rank}"
        metrics = self.config.metrics
        if metrics.enable_tensorboard:
            if not hasattr(self, "_rank_writer"):
                from torch.utils.tensorboard import SummaryWriter

                self._rank_writer = SummaryWriter(tb_folder)
            for key, value in scalars.items():
                self._rank_writer.add_scalar(key, value, self.step)
        if metrics.enable_wandb and metrics.wandb_rank_runs:
            if self.rank_wandb is None:
                self.rank_wandb = rank_run(Path(self.config.dump_folder), rank, metrics, tb_folder)
            self.rank_wandb.log(scalars, step=self.step)

    def _staleness(self) -> float:
        """Optimizer steps between the weights a gradient was computed at and those it updates:
        1 for PipeDream2BW; for PACI, the mean number of local updates a microbatch crossed
        between its forward and backward since the last record."""
        crossed = [n for e in self.stream.executors for n in e.crossed]
        for executor in self.stream.executors:
            executor.crossed.clear()
        if isinstance(self.stream.executors[0].policy, OneStepDelay):
            return 1.0
        return sum(crossed) / len(crossed) if crossed else 0.0

    def should_continue_training(self) -> bool:
        if self.step >= self.config.training.steps:
            return False
        reason = self.stop_request.agreed(self.device) if self.step > 0 else None
        if reason:
            self.stop_reason = reason
            logger.warning(f"Stopping at step {self.step} ({reason}); saving a checkpoint before exiting")
            if self.stream is not None:
                self._drain()
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
            if self.rank_wandb is not None:
                self.rank_wandb.finish()
            if self.timeline is not None and self.config.metrics.pipeline_trace:
                folder = Path(self.config.dump_folder) / "pipeline"
                folder.mkdir(exist_ok=True)
                self.timeline.write(folder / f"trace_rank{dist.get_rank()}.json")
