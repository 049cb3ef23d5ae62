"""The global gradient norm of the streaming schedules, where each stage steps on its own."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from titan_async.train.late_read import LateAllReduce


class StageGradNorms:
    """Each update's norm per stage and over the whole model.

    Every stage's u-th update applies the gradient of the same microbatches (2BW: batch u - 1;
    PACI: microbatches [(u - 1) a, u a)), so the global norm of update u is sqrt of the sum over
    stages of their squared norms. The squares are summed over the pipeline ranks (`group`;
    None: every stage is in this process) by an all-reduce started once every stage has made
    the update and read at a later step boundary (`LateAllReduce`): no compute stream waits."""

    def __init__(self, stages: int, group: dist.ProcessGroup | None, device: torch.device) -> None:
        self.stages, self.group, self.device = stages, group, device
        self.squares: dict[int, dict[int, torch.Tensor]] = {}
        """update -> stage -> squared norm (a device scalar), for this process's stages."""
        self.started: dict[int, LateAllReduce | torch.Tensor] = {}
        self.results: dict[int, list[float]] = {}

    def record(self, stage: int, update: int, norm: torch.Tensor | None) -> None:
        """Stage `stage` made update `update` with gradient norm `norm` (None: it skipped the update)."""
        square = norm.detach().float().square() if norm is not None else torch.tensor(math.nan, device=self.device)
        self.squares.setdefault(update, {})[stage] = square.reshape(()).to(self.device)

    def start(self, update: int) -> None:
        """Start summing update `update`'s squares; every rank of `group` calls this in the same
        order, once all its stages have made the update (0: no update yet, all norms 0)."""
        if update in self.started or update in self.results:
            return
        squares = torch.zeros(self.stages, device=self.device)
        for stage, square in self.squares.pop(update, {}).items():
            squares[stage] = square
        self.started[update] = LateAllReduce(squares, dist.ReduceOp.SUM, self.group) if self.group is not None else squares
        for older in [u for u in self.squares if u < update]:
            del self.squares[older]

    def read(self, update: int) -> tuple[float, list[float]]:
        """The global norm of update `update` and each stage's (started with `start`); reading
        an update forgets the results of earlier ones."""
        if update not in self.results:
            started = self.started.pop(update)
            self.results = {update: started.read() if isinstance(started, LateAllReduce) else started.tolist()}
        squares = self.results[update]
        return math.sqrt(sum(squares)), [math.sqrt(s) for s in squares]
