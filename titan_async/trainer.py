"""torchtitan's Trainer with what a run directory needs: exact resume, graceful stop, progress."""

from __future__ import annotations

import random
import signal
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer


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
        if self.checkpointer.enable:
            self.checkpointer.states["rng"] = RNGState()
        if self.config.validator.enable:
            self.validator.last_step = self.config.training.steps
        self.stop_request = StopRequest()
        self.stopped_by_signal: int | None = None

    def should_continue_training(self) -> bool:
        if self.step >= self.config.training.steps:
            return False
        if self.step > 0 and self.stop_request.agreed():
            self.stopped_by_signal = self.stop_request.signal or signal.SIGTERM
            logger.warning(f"Stop requested at step {self.step}; saving a checkpoint before exiting")
            self.checkpointer.save(self.step, last_step=True)
            return False
        return True

    def train(self) -> None:
        self.metrics_processor.start_display(self.config.training.steps)
        try:
            super().train()
        finally:
            self.metrics_processor.close_display(self.step, self.ntokens_seen)
