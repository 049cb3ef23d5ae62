"""Steps of the streaming schedules (PipeDream2BW, PACI): one stage per process, or every stage
in this process (the single-process emulation)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torchtitan.components.checkpointer.base import LR_SCHEDULER, OPTIMIZER
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.activation_checkpoint import FullAC
from torchtitan.tools.logging import logger

from titan_async.core import streams
from titan_async.pipeline.actions import gradient_delay
from titan_async.pipeline.config import microbatches, stage_delay
from titan_async.pipeline.emulation import stage_modules, stage_view
from titan_async.pipeline.executor import Microbatch, StageExecutor
from titan_async.pipeline.load_balance import StageLoadBalance, moe_blocks
from titan_async.pipeline.stream import StreamEngine
from titan_async.pipeline.trace import Timeline
from titan_async.pipeline.transport import LocalTransport
from titan_async.pipeline.versions import LocalAccumulation, OneStepDelay, make_policy
from titan_async.train.checkpoint_state import policy_names
from titan_async.train.grad_norms import LaggedGlobalClipping, StageGradNorms
from titan_async.train.health import skips_on_device


class StreamingSteps:
    """One window per step, drained before checkpoints, validation and the end, and after each
    synchronous step of a Sync Start (`training.sync_start_steps`, `versions` module docstring).

    Each stage steps on its own when its policy completes an update: it moves its MoE biases,
    clips its gradient (there is no global synchronisation point: to `training.max_norm` on its
    own, or by a global norm logged three steps earlier, `LaggedGlobalClipping`) and steps its
    optimizers, the health check deciding on the device where it can. The synchronous steps of a
    Sync Start are drained, so they clip as torch's synchronous schedules do: every stage's update
    waits for the drain and is clipped by the global norm of the batch (`_synchronous_norms`).
    `policies` and `balances` hold each local stage's weight policy and load balance.

    A logging step's metrics row waits for the global gradient norm of the update that applied
    its batch (`StageGradNorms`): summed d steps after its batch, once every stage made that
    update, and read d steps later (d = `windows_behind`, 1 unless m < p - 1), so the row of
    step t is logged at step t + 2d, or at the next drain (with lagged
    global clipping every step has a row, logged or not, for its norm). The row also
    holds each stage's norm and its delays since the previous row (`_take_staleness`): their mean
    (staleness/stage<s>) and largest (staleness_max/stage<s>)."""

    def __init__(self, trainer, emulated: bool) -> None:
        self.trainer = trainer
        self.per_stage_records = True
        self.rows: list[_Row] = []
        self.stage_group = self._stage_group(emulated)
        self.balances: dict[int, StageLoadBalance] = {}
        self.timeline = None
        self.stage_optimizers: dict[int, list[int]] = {}
        """Each local stage's optimizers (indices into `trainer.optimizers`)."""
        self.synchronous_norms: tuple[int, dict[int, torch.Tensor], torch.Tensor] | None = None
        """(update, each local stage's norm, the global norm) of the last synchronous update."""
        self.policies = self._emulate_stages() if emulated else self._attach_to_schedule()
        self._reschedule_lrs()
        self._balance_expert_load()
        self.grad_norms = self._grad_norms(emulated)
        config = trainer.config
        self.lagged_clipping = None
        if config.training.clipping == "lagged_global":
            self.lagged_clipping = LaggedGlobalClipping(config.training.max_norm, self.grad_norms.stages)
            if trainer.checkpointer.enable:
                trainer.checkpointer.states["lagged_global_norms"] = self.lagged_clipping
        self.delays_since_record = {executor.stage: [] for executor in self.stream.executors}
        self.delays_since_row = {executor.stage: [] for executor in self.stream.executors}
        notice = clipping_notice(config.training.max_norm, self.grad_norms.stages, config.training.clipping)
        logger.info(notice)
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(notice, flush=True)
        paci = any(isinstance(policy, LocalAccumulation) for policy, _ in self.policies.values())
        if paci and isinstance(config.activation_checkpoint, FullAC.Config):
            logger.warning("PACI with activation_checkpoint.mode = 'full': each block's backward recomputes its forward with "
                           "the weights current at the backward (PACI's \"mem\" rule), not with the forward's")
        trainer.save_hooks.before.append(self._drain_before_save)

    def _stage_group(self, emulated: bool) -> dist.ProcessGroup | None:
        """The ranks that hold this rank's stage and decide its updates together; None for one
        rank. Emulated, every rank holds every stage: its data-parallel ranks. Pipelined, its
        data-parallel and tensor-parallel ranks, in a group created collectively over the world:
        pp is the outermost dimension of torchtitan's mesh, so stage s holds ranks [s * n, (s + 1) * n)."""
        dims = self.trainer.parallel_dims
        if emulated:
            return dims.get_mesh("batch").get_group() if dims.dp_enabled else None
        n = dims.world_size // dims.pp
        if n == 1:
            return None
        group, _ = dist.new_subgroups_by_enumeration([list(range(s * n, (s + 1) * n)) for s in range(dims.pp)])
        return group

    def _grad_norms(self, emulated: bool) -> StageGradNorms:
        """Norms over every stage: here (emulated) or over the pipeline ranks."""
        dims = self.trainer.parallel_dims
        if emulated:
            return StageGradNorms(len(self.stream.executors), None, self.trainer.device)
        return StageGradNorms(dims.pp, dims.get_mesh("pp").get_group(), self.trainer.device)

    def _attach_to_schedule(self) -> dict:
        """The stream of this rank's stage under the pipeline schedule."""
        trainer = self.trainer
        schedule, stage = trainer.pp_schedule, trainer.pp_schedule._stage.stage_index
        self.stage_optimizers[stage] = list(range(len(trainer.optimizers.optimizers)))
        self.stream = schedule.attach(
            optimizer_step=lambda: self._stage_optimizer_step(stage, schedule.policy, self.balances.get(stage)),
            microbatches=trainer.gradient_accumulation_steps * trainer.num_pipeline_parallel_microbatches,
            accumulation=trainer.config.parallelism.paci.accumulation,
            keep_trace=trainer.config.metrics.pipeline_trace,
            sync_start=trainer.config.training.sync_start_steps,
            prediction=trainer.config.training.weight_prediction,
        )
        self.timeline = schedule.timeline
        return {stage: (schedule.policy, policy_names(trainer.model_parts[0], schedule.policy))}

    def _emulate_stages(self) -> dict:
        """Split the model into stage views in this process, each with its own optimizer,
        learning-rate schedule and weight policy."""
        trainer = self.trainer
        config = trainer.config
        model = trainer.model_parts[0]
        views = [stage_view(model, names) for names in stage_modules(config.parallelism, len(model.layers))]
        trainer.optimizers = config.optimizer.build(model_parts=views)
        trainer.lr_schedulers = config.lr_scheduler.build(optimizers=trainer.optimizers, training_steps=config.training.steps)
        trainer.metrics_processor.optimizers = trainer.optimizers
        if trainer.checkpointer.enable:
            trainer.checkpointer.states.update({OPTIMIZER: trainer.optimizers, LR_SCHEDULER: trainer.lr_schedulers})
        m = trainer.gradient_accumulation_steps * microbatches(config.training, config.parallelism)
        mailbox: dict = {}
        policies, executors, steps = {}, [], {}
        for stage, view in enumerate(views):
            policy = make_policy(config.parallelism.pipeline_parallel_schedule, view, m, config.parallelism.paci.accumulation,
                                 sync_start=config.training.sync_start_steps, prediction=config.training.weight_prediction,
                                 stages_after=len(views) - 1 - stage, lag=gradient_delay(len(views), m))
            policies[stage] = (policy, policy_names(view, policy))
            executors.append(
                StageExecutor(view, stage, len(views), LocalTransport(mailbox, stage), policy, self._loss, Timeline(0, False))
            )
            self.stage_optimizers[stage] = self._optimizers_of(view)
            steps[stage] = lambda stage=stage, policy=policy: self._stage_optimizer_step(stage, policy, self.balances.get(stage))
        self.stream = StreamEngine(executors, len(views), m, steps)
        return policies

    def resize(self) -> None:
        """Windows of the trainer's current accumulation (`training.batch_ramp_sizes`), from the next
        step on; called drained (`_must_drain`), so no microbatch of the previous size is in flight.
        PipeDream2BW's delay stays what it was (`check_batch_ramp`)."""
        config = self.trainer.config
        m = self.trainer.gradient_accumulation_steps * microbatches(config.training, config.parallelism)
        assert self.stream.drained and gradient_delay(self.stream.num_stages, m) == self.windows_behind
        self.stream.microbatches = m
        for policy, _ in self.policies.values():
            policy.resize(m)

    def _reschedule_lrs(self) -> None:
        """`lr_scheduler.delay_rescheduling_steps`: each local stage's lrs divided by its own delay
        (`stage_delay`), fading out."""
        config = self.trainer.config
        steps = config.lr_scheduler.delay_rescheduling_steps
        if not steps:
            return
        for stage, indices in self.stage_optimizers.items():
            delay = stage_delay(config.training, config.parallelism.pipeline_parallel_schedule, stage, self.stream.num_stages,
                                self.stream.microbatches, config.parallelism.paci.accumulation)
            self.trainer.lr_schedulers.reschedule(indices, delay, steps)

    def _balance_expert_load(self) -> None:
        """MoE load balancing per stage, where each stage steps (`pipeline.load_balance`)."""
        dims = self.trainer.parallel_dims
        data_group = dims.get_mesh("batch").get_group() if dims.dp_enabled else None
        for executor in self.stream.executors:
            blocks = moe_blocks(executor.module)
            if blocks:
                executor.balance = self.balances[executor.stage] = StageLoadBalance(blocks, data_group)

    def _loss(self, pred, labels, **loss_kwargs):
        loss, _ = self.trainer.loss_fn(pred, labels, **loss_kwargs)
        return loss

    def _optimizers_of(self, stage: torch.nn.Module) -> list[int]:
        """Indices of the optimizers (and their lr schedulers) that update `stage`'s parameters."""
        owned = {id(p) for p in stage.parameters()}
        return [
            i for i, optimizer in enumerate(self.trainer.optimizers.optimizers)
            if all(id(p) in owned for group in optimizer.param_groups for p in group["params"])
        ]

    def _params(self, stage: int) -> list[torch.Tensor]:
        """The parameters local stage `stage`'s optimizers update."""
        optimizers = [self.trainer.optimizers.optimizers[i] for i in self.stage_optimizers[stage]]
        return [p for optimizer in optimizers for group in optimizer.param_groups for p in group["params"]]

    def _stage_optimizer_step(self, stage: int, policy, balance: StageLoadBalance | None) -> None:
        """Move the stage's expert biases (MoE; also when the health check skips the update: the
        counts are finite), clip its gradient (`training.clipping`; by the global norm in the
        synchronous steps of a Sync Start), step and zero its optimizers, and advance their
        learning rates by the batches the stage has now completed. A skipped update records a
        norm that is not finite.

        The health check decides on the device when every optimizer can skip an update there
        (`skips_on_device`), so a stage stepping inside a window never waits for the device."""
        trainer = self.trainer
        if balance:
            balance.step()
        indices = self.stage_optimizers[stage]
        optimizers = [trainer.optimizers.optimizers[i] for i in indices]
        params = self._params(stage)
        synchronous = policy.updates <= trainer.config.training.sync_start_steps
        stage_norms, global_norm = self._synchronous_norms(policy.updates) if synchronous else (None, None)
        on_device = all(skips_on_device(optimizer) for optimizer in optimizers)
        found_inf = trainer.health.found_nonfinite(trainer.step, stage, params, group=self.stage_group) if on_device else None
        norm, ep_enabled = None, trainer.parallel_dims.ep_enabled
        if on_device or trainer.health.allow_update(trainer.step, stage, params, group=self.stage_group):
            if synchronous:
                norm = stage_norms[stage]
                torch.nn.utils.clip_grads_with_norm_(params, trainer.config.training.max_norm, global_norm, foreach=False)
            elif self.lagged_clipping:
                norm = self.lagged_clipping.clip(params, policy.step_of_update(policy.updates), ep_enabled)
            else:
                norm = dist_utils.clip_grad_norm_(params, trainer.config.training.max_norm, foreach=True, ep_enabled=ep_enabled)
            for optimizer in optimizers:
                optimizer.found_inf = found_inf
                optimizer.step()
                del optimizer.found_inf
        self.grad_norms.record(stage, policy.updates, norm, found_inf)
        for optimizer in optimizers:
            optimizer.zero_grad()
        for i in indices:
            scheduler = trainer.lr_schedulers.schedulers[i]
            while scheduler.last_epoch < policy.lr_steps_due():
                scheduler.step()

    def _synchronous_norms(self, update: int) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
        """Each local stage's gradient norm and the global norm of synchronous update `update`, as
        torchtitan's `clip_grad_norm_` with the pp mesh sums them (the squares over the stages,
        then the square root), the first local stage to step computing them for every local
        stage: the updates wait for the drain (`StreamEngine.run_window`), where every stage's
        gradient of the batch is complete and no message is in flight, so the all-reduce over the
        pipeline ranks waits for no compute. Taken before the health checks, as torchtitan clips
        before its update is skipped; a stage whose norm is not finite (it skips the update)
        counts 0, so the other stages' clip stays finite."""
        if self.synchronous_norms is None or self.synchronous_norms[0] != update:
            ep_enabled = self.trainer.parallel_dims.ep_enabled
            norms = {stage: dist_utils.clip_grad_norm_(self._params(stage), math.inf, foreach=True, ep_enabled=ep_enabled)
                     for stage in self.stage_optimizers}
            squares = sum(torch.where(norm.isfinite(), norm, 0.0) ** 2.0 for norm in norms.values())
            if self.grad_norms.group is not None:
                dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=self.grad_norms.group)
            self.synchronous_norms = (update, norms, squares ** (1.0 / 2.0))
        _, norms, global_norm = self.synchronous_norms
        return norms, global_norm

    def _must_drain(self) -> bool:
        """Whether the step just taken is followed by a checkpoint, validation, the end or a new
        batch size (`training.batch_ramp_sizes`), or is one of the synchronous steps of a Sync
        Start (no microbatch may cross their updates)."""
        trainer = self.trainer
        step, config = trainer.step, trainer.config
        checkpoint = config.checkpoint.enable and step % config.checkpoint.interval == 0
        validation = config.validator.enable and trainer.validator.should_validate(step)
        ramp = trainer.batch_ramp
        resized = ramp is not None and ramp.size_at(step) != ramp.size_at(step - 1)
        return step >= config.training.steps or checkpoint or validation or resized or step <= config.training.sync_start_steps

    def run(self, data_iterator) -> None:
        """Feed batch `step - 1` into the stream and report the loss of the batch it completed.

        Nothing here waits for the device except, on logging steps, the read of the loss: the
        batch is copied from pinned memory without blocking, so on a GPU the host loads the
        next batch while the device still runs this window."""
        trainer = self.trainer
        lr_metrics = trainer.lr_schedulers.get_metrics()
        batches = [next(data_iterator) for _ in range(trainer.gradient_accumulation_steps * trainer.num_pipeline_parallel_microbatches)]
        fed = []
        for input_dict, labels in self._split_for_emulation(batches):
            input_dict = {k: self._to_device(v) for k, v in input_dict.items()}
            inputs, labels, extra_kwargs = trainer.post_dataloading_process(input_dict, self._to_device(labels))
            fed.append(Microbatch(args=(inputs,), kwargs=extra_kwargs, target=labels))
        local_valid_tokens = sum((m.target != IGNORE_INDEX).sum() for m in fed)
        global_valid_tokens = local_valid_tokens
        if trainer.parallel_dims.dp_enabled:
            global_valid_tokens = dist_utils.dist_sum_tensor(local_valid_tokens, trainer.parallel_dims.get_mesh("batch"))
        with trainer.train_context():
            if self.timeline:
                self.timeline.start_window()
            synchronous = trainer.step <= trainer.config.training.sync_start_steps
            losses = self.stream.run_window(trainer.step - 1, fed, {"global_valid_tokens": global_valid_tokens}, synchronous)
            bubble = self.timeline.end_window() if self.timeline else None
            self._take_staleness()
            if trainer.metrics_processor.should_log(trainer.step):
                extra = {**lr_metrics, **({"pipeline/bubble": bubble} if bubble is not None else {})}
                self.rows.append(self._row(losses, local_valid_tokens, global_valid_tokens, extra))
            elif self.lagged_clipping:
                self.rows.append(_Row(trainer.step, self._policy().update_of_batch(trainer.step - 1), None, [{}, {}]))
            if self._must_drain():
                self.drain()
            else:
                self._log_rows(drained=False)

    def _row(self, losses: list[torch.Tensor], local_valid_tokens: torch.Tensor, global_valid_tokens: torch.Tensor,
             extra: dict) -> _Row:
        """This step's metrics, waiting for the global norm of the update that applies its batch."""
        loss, max_loss, tokens = self._step_metrics(losses, local_valid_tokens, global_valid_tokens)
        step = self.trainer.step
        row = self.trainer.metrics_processor.hold(step, loss, max_loss, {"n_tokens_seen": int(tokens), **extra})
        delays = self.delays_since_row
        self.delays_since_row = {stage: [] for stage in delays}
        staleness = [{s: sum(d) / len(d) for s, d in delays.items() if d}, {s: max(d) for s, d in delays.items() if d}]
        return _Row(step, self._policy().update_of_batch(step - 1), row, staleness)

    def _policy(self):
        """A local stage's weight policy (every stage numbers updates and batches alike)."""
        return next(iter(self.policies.values()))[0]

    def _log_rows(self, drained: bool) -> None:
        """Log each waiting row whose norm was started d steps ago; start the norms of rows d
        steps old, d = `windows_behind`: every stage has made their updates by then, stage 0
        making the update of batch t - 1 in window t - 1 + d, and every rank has started the sum
        by the time it is read. Drained, every update is made: start and log them all."""
        step, logged, behind = self.trainer.step, 0, self.windows_behind
        for row in self.rows:
            if row.started_at is not None and (row.started_at + behind <= step or drained):
                norm, stage_norms, (mean, worst) = self.grad_norms.read(row.step)
                if self.lagged_clipping:
                    self.lagged_clipping.record(row.step, norm)
                logged += 1
                if row.metrics is None:
                    continue
                stages = {}
                for s in range(self.grad_norms.stages):
                    stages.update({f"grad_norm/stage{s}": stage_norms[s], f"staleness/stage{s}": mean[s],
                                   f"staleness_max/stage{s}": worst[s]})
                self.trainer.metrics_processor.write_held(row.step, row.metrics, norm, stages)
            elif row.started_at is None and (row.step + behind <= step or drained):
                self.grad_norms.start(row.step, row.update, row.staleness)
                row.started_at = step
        del self.rows[:logged]
        if drained and self.rows:
            self._log_rows(drained)

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` on the training device; to a GPU through pinned memory, without a host sync."""
        device = self.trainer.device
        return streams.for_device(device).to_device(tensor, device)

    def _step_metrics(self, losses: list[torch.Tensor], local_valid_tokens: torch.Tensor,
                      global_valid_tokens: torch.Tensor) -> tuple[float, float, float]:
        """What torchtitan logs of a step, over this stage's data ranks: the loss (the mean over
        every token of the batch), the largest data rank's own mean loss and the tokens seen;
        read from the device in one transfer. Stages without a loss report -1 for both losses."""
        trainer = self.trainer
        device = trainer.device
        mesh = trainer.parallel_dims.get_optional_mesh("loss") if trainer.parallel_dims.dp_enabled else None
        tokens = torch.tensor(float(trainer.ntokens_seen), dtype=torch.float64, device=device)
        if losses:
            accumulated = torch.stack(losses).sum().float()
            local_mean = accumulated * global_valid_tokens / local_valid_tokens
            loss, tokens = dist_utils.dist_sum_tensor(torch.stack([accumulated.double(), tokens]), mesh).unbind()
            max_loss = _dist_max_tensor(local_mean.reshape(1), mesh).reshape(()).double()
        else:
            loss = max_loss = torch.full((), -1.0, dtype=torch.float64, device=device)
            tokens = dist_utils.dist_sum_tensor(tokens.reshape(1), mesh).reshape(())
        return tuple(streams.for_device(device).read_now(torch.stack([loss, max_loss, tokens])))

    def _split_for_emulation(self, batches: list) -> list:
        """The emulation loads whole batches (no PP): cut each into its pipeline microbatches."""
        config = self.trainer.config
        if not config.parallelism.emulated_stages:
            return batches
        count = microbatches(config.training, config.parallelism)
        split = []
        for input_dict, labels in batches:
            parts = {k: v.chunk(count) for k, v in input_dict.items()}
            split += [({k: v[i] for k, v in parts.items()}, labels.chunk(count)[i]) for i in range(count)]
        return split

    @property
    def windows_behind(self) -> int:
        """The windows by which the first stage's backwards trail the last stage's, and so the
        steps a stage's all-reduce waits before it is read: ceil((p - 1) / m), at least 1
        (`actions.gradient_delay`)."""
        return gradient_delay(self.stream.num_stages, self.stream.microbatches)

    def drain(self) -> None:
        """Empty the stream; with two versions, expose the latest (W[step]) for saving and validation."""
        self.stream.drain()
        self.trainer.health.settle()
        self._log_rows(drained=True)
        if self.timeline:
            self.timeline.restart()
        for executor in self.stream.executors:
            if isinstance(executor.policy, OneStepDelay):
                executor.policy.expose_latest(self.trainer.step)

    def _drain_before_save(self, step: int, last_step: bool) -> None:
        """Drain wherever the checkpointer saves (the first-step checkpoint and any save torchtitan
        adds included), so that no checkpoint holds microbatches in flight. `_must_drain` drains
        the saves it foresees inside the step."""
        if not self.stream.drained:
            with self.trainer.train_context():
                self.drain()

    def rank_scalars(self) -> dict:
        """The bubble, the staleness of the applied gradients and the memory of weight versions
        beyond the live weights (shards, and gathered under FSDP)."""
        executors = self.stream.executors
        scalars = {"bubble": self.timeline.last_bubble} if self.timeline is not None else {}
        scalars["staleness"] = self._staleness()
        scalars["weight_versions_gib"] = sum(e.policy.extra_bytes() for e in executors) / 2**30
        scalars["gathered_versions_gib"] = sum(e.policy.gathered_copy_bytes() for e in executors) / 2**30
        return scalars

    def _take_staleness(self) -> None:
        """Each local stage's delays of the step just run, in optimizer steps between the weights a
        gradient was computed at and those it updates (the policy's `delay`): 1 for PipeDream2BW;
        for PACI, the local updates each microbatch crossed between its forward and backward;
        0 in the synchronous steps of a Sync Start."""
        for executor in self.stream.executors:
            delays = list(executor.crossed)
            executor.crossed.clear()
            self.delays_since_record[executor.stage] += delays
            self.delays_since_row[executor.stage] += delays

    def _staleness(self) -> float:
        """The mean delay (`_take_staleness`) of this rank's stages since the last record."""
        delays = [d for stage in self.delays_since_record.values() for d in stage]
        self.delays_since_record = {stage: [] for stage in self.delays_since_record}
        return sum(delays) / len(delays) if delays else 0.0


def clipping_notice(max_norm: float, stages: int, mode: str) -> str:
    """What clipping and loss normalisation a streaming run has, in one line."""
    if mode == "lagged_global":
        clipping = (f"gradient clipping (training.clipping = 'lagged_global'): every stage scales the update applying "
                    f"step t's batch by min(1, training.max_norm / max(G, n)) with max_norm = {max_norm:g}, G the global norm "
                    f"logged at step t - {LaggedGlobalClipping.LAG} (no stage waits for the current one) and n the stage's own "
                    f"norm (a spike is clipped at once); until then, or where G is not finite (a skipped update), each "
                    f"of the {stages} stages clips its own gradient to max_norm / sqrt({stages}) = {max_norm / stages ** 0.5:.4g}")
    else:
        clipping = (f"gradient clipping (training.clipping = 'per_stage'): each of the {stages} stages clips its own gradient "
                    f"to training.max_norm = {max_norm:g} when it steps (no global norm exists at that moment): the whole "
                    f"model's gradient is held under sqrt({stages}) x {max_norm:g} = {max_norm * stages ** 0.5:.4g} "
                    f"(training.clipping = 'lagged_global' clips by a global norm three steps old)")
    return (f"{clipping}; the logged grad_norm is the global norm of the update before clipping. Loss: the mean over every "
            f"token of the batch, each microbatch's sum divided by the batch's valid tokens over all data ranks (as torchtitan's)")


@dataclass
class _Row:
    """A logging step's metrics, waiting for the global norm of update `update`."""

    step: int
    update: int
    metrics: dict | None
    """The row as `RunMetrics.hold` measured it; None for a step that is not logged."""
    staleness: list[dict[int, float]]
    """Each local stage's mean and largest delay since the previous row."""
    started_at: int | None = None
    """The step at which the norm's sum was started."""


def _dist_max_tensor(x: torch.Tensor, mesh) -> torch.Tensor:
    """The element-wise maximum of `x` over `mesh` (None: `x`), left on the device."""
    return x if mesh is None else funcol.wait_tensor(funcol.all_reduce(x, reduceOp="MAX", group=mesh))
