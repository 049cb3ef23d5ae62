"""Steps of torch's pipeline schedules and of training without a pipeline: torchtitan's own."""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist
from torchtitan.components.optimizer import register_moe_load_balancing_hook
from torchtitan.trainer import Trainer

from titan_async.pipeline.trace import Timeline, trace_torch_stages


class SynchronousSteps:
    """torchtitan's step, with the update skipped on every rank when any gradient is not finite
    and torchtitan's MoE load balancing. With `metrics.pipeline_trace` under one of torch's
    schedules: a timeline of this rank's stage actions and optimizer steps, one window per step
    (trace JSON, Gantt PNG, bubble)."""

    def __init__(self, trainer, balance_experts: bool = True) -> None:
        self.trainer = trainer
        self.policies: dict = {}
        self.balances: dict = {}
        self.timeline = None
        self.per_stage_records = trainer.parallel_dims.pp_enabled
        if trainer.config.metrics.pipeline_trace and trainer.parallel_dims.pp_enabled:
            self.timeline = Timeline(dist.get_rank(), True, trainer.device)
            trace_torch_stages(self._local_stages(), self.timeline)
        if balance_experts:
            register_moe_load_balancing_hook(trainer.optimizers, trainer.model_parts, trainer.parallel_dims)

    def run(self, data_iterator, update: Callable[[Callable[[], None]], None] | None = None) -> None:
        """torchtitan's step with `update(optimizer_step)` in place of the optimizer step."""
        if self.timeline is None:
            self._guarded_step(data_iterator, update or (lambda step_optimizer: step_optimizer()))
            return

        def traced(step_optimizer) -> None:
            with self.timeline.action(f"{self._first_local_stage()}O{self.trainer.step}"):
                step_optimizer()

        self.timeline.start_window()
        self._guarded_step(data_iterator, traced)
        self.timeline.end_window()

    def _guarded_step(self, data_iterator, update) -> None:
        trainer = self.trainer
        step_optimizer = trainer.optimizers.step
        # The optimizer's own parameters: FSDP may leave other (unsharded) ones registered on the modules.
        params = [p for optimizer in trainer.optimizers.optimizers for group in optimizer.param_groups for p in group["params"]]
        stage = self._first_local_stage() if trainer.parallel_dims.pp_enabled else 0
        skipped = trainer.health.skipped

        def guarded_update() -> None:
            if trainer.health.allow_update(trainer.step, stage, params, group=dist.group.WORLD):
                update(step_optimizer)

        trainer.optimizers.step = guarded_update
        try:
            Trainer.train_step(trainer, data_iterator)  # torchtitan's step
        except RuntimeError as err:
            if trainer.health.skipped == skipped or "Loss is not finite" not in str(err):
                raise
        finally:
            del trainer.optimizers.step

    def resize(self) -> None:
        """torchtitan's step reads the trainer's accumulation every step."""

    def drain(self) -> None:
        """Nothing is in flight between steps."""

    def rank_scalars(self) -> dict:
        return {"bubble": self.timeline.last_bubble} if self.timeline is not None else {}

    def _local_stages(self) -> list:
        """This rank's pipeline stages under torch's schedule: interleaved schedules hold several."""
        schedule = self.trainer.pp_schedule
        return schedule._stages if hasattr(schedule, "_stages") else [schedule._stage]

    def _first_local_stage(self) -> int:
        return self._local_stages()[0].stage_index
