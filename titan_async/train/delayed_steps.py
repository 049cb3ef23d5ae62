"""Steps of the single-process delayed-gradient rule (`training.gradient_delay = 1`)."""

from __future__ import annotations

from titan_async.parallel.fsdp_stage import FsdpStage
from titan_async.pipeline.load_balance import DelayedLoadBalance, moe_blocks
from titan_async.pipeline.versions import two_versions
from titan_async.train.synchronous_steps import SynchronousSteps
from titan_async.train.checkpoint_state import policy_names


class DelayedSteps:
    """W[k+1] = W[k] - Opt(grad f_k(W[k-1])): torchtitan's step with the gradient taken at the
    previous version and the update applied to the latest one. Between steps the parameters
    hold the latest version, W[step], as a checkpoint expects. MoE biases move once per step,
    from the counts of the batch whose gradient the update applies. With
    `training.sync_start_steps` = N the first N steps take the gradient at W[k] (Sync Start)."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer
        model = trainer.model_parts[0]
        training = trainer.config.training
        self.delay = two_versions(model, 1, FsdpStage.of(model), training.sync_start_steps, training.weight_prediction,
                                  training.gradient_delay)
        self.policies = {0: (self.delay, policy_names(model, self.delay))}
        if trainer.config.lr_scheduler.delay_rescheduling_steps:  # the whole model is one stage at delay d
            schedulers = range(len(trainer.lr_schedulers.schedulers))
            trainer.lr_schedulers.reschedule(list(schedulers), training.gradient_delay, trainer.config.lr_scheduler.delay_rescheduling_steps)
        self.synchronous = SynchronousSteps(trainer, balance_experts=False)
        self.timeline = None
        self.balances: dict = {}
        self.per_stage_records = False
        blocks = moe_blocks(model)
        data_group = trainer.parallel_dims.get_mesh("batch").get_group() if trainer.parallel_dims.dp_enabled else None
        self.balance = DelayedLoadBalance(blocks, data_group) if blocks else None

    def run(self, data_iterator) -> None:
        batch = self.trainer.step - 1
        self.delay.activate(batch)

        def update(step_optimizer) -> None:
            def step() -> None:
                if self.balance:
                    self.balance.step()
                step_optimizer()

            self.delay.apply_update(batch, step)

        self.synchronous.run(data_iterator, update)
        self.delay.expose_latest(self.trainer.step)

    def resize(self) -> None:
        """torchtitan's step reads the trainer's accumulation every step; the versions count batches."""

    def drain(self) -> None:
        """Nothing is in flight between steps."""

    def rank_scalars(self) -> dict:
        return {}
