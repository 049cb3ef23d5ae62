"""The metrics of the streaming schedules that need every stage: the global gradient norm and
each stage's staleness, summed over the pipeline ranks off the critical path."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from titan_async.train.late_read import LateAllReduce


class StageGradNorms:
    """Each update's norm per stage and over the whole model, and per-stage values of a row.

    Every stage's u-th update applies the gradient of the same microbatches (2BW: batch u - 1;
    PACI: microbatches [(u - 1) a, u a)), so the global norm of update u is sqrt of the sum over
    stages of their squared norms. A row's squares and per-stage values are summed over the
    pipeline ranks (`group`; None: every stage is in this process) by an all-reduce started once
    every stage has made the update and read at a later step boundary (`LateAllReduce`): no
    compute stream waits. Each stage's values come from the one rank of `group` that holds it."""

    def __init__(self, stages: int, group: dist.ProcessGroup | None, device: torch.device) -> None:
        self.stages, self.group, self.device = stages, group, device
        self.squares: dict[int, dict[int, torch.Tensor]] = {}
        """update -> stage -> squared norm (a device scalar), for this process's stages."""
        self.started: dict[int, LateAllReduce | torch.Tensor] = {}

    def record(self, stage: int, update: int, norm: torch.Tensor | None) -> None:
        """Stage `stage` made update `update` with gradient norm `norm` (None: it skipped the update)."""
        square = norm.detach().float().square() if norm is not None else torch.tensor(math.nan, device=self.device)
        self.squares.setdefault(update, {})[stage] = square.reshape(()).to(self.device)

    def start(self, key: int, update: int, values: list[dict[int, float]]) -> None:
        """Start summing, as row `key`, update `update`'s squares (0: no update yet, all norms 0)
        and `values` (per-stage numbers of this process's stages); every rank of `group` calls
        this in the same order, once all its stages have made the update. Squares of earlier
        updates are dropped."""
        vector = torch.zeros((1 + len(values)) * self.stages, device=self.device)
        for stage, square in self.squares.get(update, {}).items():
            vector[stage] = square
        for i, per_stage in enumerate(values, start=1):
            for stage, value in per_stage.items():
                vector[i * self.stages + stage] = value
        self.started[key] = LateAllReduce(vector, dist.ReduceOp.SUM, self.group) if self.group is not None else vector
        for older in [u for u in self.squares if u < update]:
            del self.squares[older]

    def read(self, key: int) -> tuple[float, list[float], list[list[float]]]:
        """Row `key`'s global norm, each stage's norm, and its per-stage values (`start`)."""
        started = self.started.pop(key)
        summed = started.read() if isinstance(started, LateAllReduce) else started.tolist()
        squares, rest = summed[:self.stages], summed[self.stages:]
        values = [rest[i:i + self.stages] for i in range(0, len(rest), self.stages)]
        return math.sqrt(sum(squares)), [math.sqrt(s) for s in squares], values
