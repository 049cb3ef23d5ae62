"""What checkpoints keep besides torchtitan's model, optimizer and schedulers: each rank's RNG
states, the weight policies' state, and the model state without torchtitan's parameter cache;
and what they do not decide: the optimizer's hyperparameters."""

from __future__ import annotations

import random
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful
from torchtitan.components.checkpointer.base import MODEL, ModelWrapper
from torchtitan.trainer import Trainer

from titan_async.model.init import canonical_name
from titan_async.pipeline.load_balance import StageLoadBalance, versioned_tensors
from titan_async.pipeline.versions import OneStepDelay


def policy_names(model: torch.nn.Module, policy) -> list[str]:
    """The names of what `policy` keeps per stage: 2BW versions the MoE expert biases too."""
    named = versioned_tensors(model) if isinstance(policy, OneStepDelay) else model.named_parameters()
    return [canonical_name(name) for name, _ in named]


RNG = "rng"
"""The checkpointer's name for `RNGState`."""


class RNGState(Stateful):
    """This rank's torch (CPU and CUDA) and Python RNG states, keyed by rank in checkpoints."""

    def __init__(self) -> None:
        self.key = f"rank{dist.get_rank()}"

    def saved_in(self, saved_keys, name: str) -> bool:
        """Whether a checkpoint whose flattened keys are `saved_keys` holds this rank's states (as
        state `name`): not when it was saved by fewer processes than this rank's number."""
        prefix = f"{name}.{self.key}."
        return any(key.startswith(prefix) for key in saved_keys)

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


def keep_weight_versions(trainer: Trainer, steps) -> None:
    """Have the checkpointer save and load the step runner's weight policies and load balances
    (nothing without policies), and, where a policy switches the model's tensors (plain
    parameters, or the expert biases beside sharded versions), the live model state
    (`LiveModelState`)."""
    if not steps.policies or not trainer.checkpointer.enable:
        return
    trainer.checkpointer.states["weight_versions"] = WeightVersionState(steps.policies, steps.balances, trainer)
    if any(policy.switches_tensors for policy, _ in steps.policies.values()):
        trainer.checkpointer.states[MODEL] = LiveModelState(trainer.model_parts)


def configured_over_loaded(trainer: Trainer) -> None:
    """Make the run's config, not the checkpoint, decide the optimizer's hyperparameters: after
    every `trainer.checkpointer.load`, each param group gets back the values it was built with
    (betas, eps, weight decay, kernel flags, Muon's settings, `initial_lr`: every key but the
    parameters; see `titan_async.optim.section.ON_RESUME`), and `lr` is the rebuilt schedule's at
    the loaded step, so the first resumed step uses it. State tensors stay as loaded."""
    load = trainer.checkpointer.load

    def load_keeping_config(step: int = -1) -> bool:
        schedulers = trainer.lr_schedulers.schedulers  # one per optimizer, each over its param groups
        built = [[{k: v for k, v in group.items() if k not in ("params", "param_names")}
                  for group in scheduler.optimizer.param_groups] for scheduler in schedulers]
        loaded = load(step)
        for scheduler, settings in zip(schedulers, built):
            for group, configured, lr in zip(scheduler.optimizer.param_groups, settings, scheduler.get_last_lr()):
                group.update(configured, lr=lr)
        return loaded

    trainer.checkpointer.load = load_keeping_config
