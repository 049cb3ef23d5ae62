"""The metrics of the streaming schedules that need every stage: the global gradient norm and
each stage's staleness, summed over the pipeline ranks off the critical path; and clipping by
a global norm known without waiting for it."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torchtitan.distributed import utils as dist_utils

from titan_async.core import streams
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

    def record(self, stage: int, update: int, norm: torch.Tensor | None, found_inf: torch.Tensor | None = None) -> None:
        """Stage `stage` made update `update` with gradient norm `norm` (None: the health check
        skipped it on the host; `found_inf` 1: on the device). A skipped update's square is NaN,
        so the global norm of its update is not finite (lagged clipping does not use it)."""
        if norm is None:
            square = torch.tensor(math.nan, device=self.device)
        else:
            square = norm.detach().float().square()
            if found_inf is not None:  # on the device: no host sync
                square = torch.where(found_inf.to(square.device) > 0, math.nan, square)
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
        summed = started.read() if isinstance(started, LateAllReduce) else streams.for_device(started.device).read_now(started)
        squares, rest = summed[:self.stages], summed[self.stages:]
        values = [rest[i:i + self.stages] for i in range(0, len(rest), self.stages)]
        return math.sqrt(sum(squares)), [math.sqrt(s) for s in squares], values


class LaggedGlobalClipping:
    """`training.clipping = "lagged_global"`: a global threshold with no barrier.

    The update applying the batch fed at step t is scaled on every stage by torch's clipping
    factor min(1, max_norm / (G + 1e-6)), G the global norm logged at step t - LAG: rows are
    read two steps after their own (`StreamingSteps._log_rows`), and a stage applies a batch
    at the latest one window after it was fed, so that row is known to every stage by then,
    and each stage's share of an update gets the same factor. Until a row exists (the first LAG steps)
    or while it is not finite (a skipped update), each stage clips its own gradient to
    max_norm / sqrt(stages), which holds the global norm under max_norm. The rows still needed
    after a drain are checkpointed (`state_dict`), so resume is exact.

    A spike is bounded when it happens: the factor is min(1, max_norm / (G + 1e-6),
    max_norm / (n + 1e-6)), n the stage's own norm of this update. A stage's norm is at most the
    global norm, so a stage whose own norm exceeds max_norm is certainly over the global bound:
    it is clipped to max_norm at once, whatever the lagged G says, and the update's global norm
    stays under sqrt(stages) x max_norm. The factor is torch's clipping factor for the norm
    max(G, n): n is computed anyway and the factor stays on the device, so no synchronisation is
    added. Without a spike (n <= G) the rule is the lagged one."""

    LAG = 3

    def __init__(self, max_norm: float, stages: int) -> None:
        self.max_norm, self.stages = max_norm, stages
        self.norms: dict[int, float] = {}
        """step -> the global norm logged at that step, for the last LAG + 1 steps."""

    def record(self, step: int, norm: float) -> None:
        """Step `step`'s global norm is known on every rank."""
        self.norms[step] = norm
        for older in [s for s in self.norms if s < step - self.LAG]:
            del self.norms[older]

    def clip(self, params: list[torch.Tensor], step: int, ep_enabled: bool) -> torch.Tensor:
        """Scale the gradients of `params`, one stage's share of the update applying the batch
        fed at `step`; returns their norm before scaling."""
        source = step - self.LAG
        if source >= 1 and source not in self.norms:
            raise RuntimeError(f"the global norm of step {source} is not known at step {step}'s update")
        known = self.norms.get(source, math.nan)
        if not math.isfinite(known):
            return dist_utils.clip_grad_norm_(params, self.max_norm / math.sqrt(self.stages), foreach=True, ep_enabled=ep_enabled)
        norm = dist_utils.clip_grad_norm_(params, math.inf, foreach=True, ep_enabled=ep_enabled)
        # min(1, max_norm / (max(G, n) + 1e-6)): the larger of the lagged and the stage's own norm, on the device;
        # tensor by tensor, as the parameters may lie on several meshes (experts), which one foreach call cannot mix
        torch.nn.utils.clip_grads_with_norm_(params, self.max_norm, torch.clamp(norm, min=known), foreach=False)
        return norm

    def state_dict(self) -> dict[str, torch.Tensor]:
        """[LAG + 1, 2]: (step, norm) rows, padded with step 0 (a fixed shape, as DCP loads in place)."""
        rows = sorted(self.norms.items()) + [(0, math.nan)] * (self.LAG + 1 - len(self.norms))
        return {"steps_and_norms": torch.tensor(rows, dtype=torch.float64)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.norms = {int(step): norm for step, norm in state["steps_and_norms"].tolist() if step >= 1}
