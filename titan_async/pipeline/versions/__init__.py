"""Weight-version policies: when a stage's optimizer steps and which weights each microbatch sees.

- `TwoVersions` and `ShardedTwoVersions` (PipeDream-2BW, and `training.gradient_delay = 1`
  without PP; plain and FSDP2 parameters): batch t runs forward and backward on version
  U_t; once batch b's gradient g_b is complete the stage computes U_{b+2} = U_{b+1} - Opt(g_b)
  in place of U_b. Net effect on every stage: W[k+1] = W[k] - Opt(grad f_k(W[k-1])), W[-1] = W[0].
  At a delay of d steps (fewer microbatches than stages) `TwoVersions` and
  `ShardedDelayedVersions` keep d + 1 versions: W[k+1] = W[k] - Opt(grad f_k(W[k-d])).
- `PredictedVersions` and `ShardedPredictedVersions` (PipeDream-2BW with weight prediction;
  plain and FSDP2 parameters): batch t runs on the versions extrapolated along the last update,
  P_t = U_t + h (U_t - U_{t-1}).
- `PredictedAccumulation` (PACI with weight prediction; plain and FSDP2 parameters): forwards
  run at the weights extrapolated along the stage's last local step by its mean delay.
- `LocalAccumulation` (PACI): no stash; after every `a` local backwards the stage steps its
  optimizer in place, so a microbatch may see newer weights in its backward than in its forward
  (see its docstring for what activation checkpointing changes).

Under FSDP2 (torchtitan's replicas and TP stages included: FSDP2 wraps them too) the policies
keep and predict each rank's own shards: the extrapolation is elementwise, so the gathered
prediction is the prediction of the gathered weights.

Sync Start (`sync_start` = N > 0, `training.sync_start_steps`): batches 0..N-1 are synchronous,
W[k+1] = W[k] - Opt(grad f_k(W[k])): one in-place update per batch with the whole batch's
gradient, the trainer draining the stream after each of them so that no microbatch crosses an
update. From batch N on each policy runs its rule as a fresh policy would from W[N], numbers
shifted by N: 2BW's second version appears at the switch (U_N = U_{N+1} = W[N]), PACI counts
its `a` backwards from the switch.
"""


from __future__ import annotations

import torch

from titan_async.parallel.fsdp_stage import FsdpStage
from titan_async.pipeline.load_balance import versioned_tensors
from titan_async.pipeline.versions.common import preserved_versions
from titan_async.pipeline.versions.local_steps import LocalAccumulation, PredictedAccumulation
from titan_async.pipeline.versions.sharded import ShardedPredictedVersions, ShardedTwoVersions
from titan_async.pipeline.versions.sharded_delay import ShardedDelayedVersions
from titan_async.pipeline.versions.stashed import OneStepDelay, PredictedVersions, TwoVersions

__all__ = ["LocalAccumulation", "OneStepDelay", "PredictedAccumulation", "PredictedVersions", "ShardedDelayedVersions",
           "ShardedPredictedVersions", "ShardedTwoVersions", "TwoVersions", "make_policy", "preserved_versions", "two_versions"]


def two_versions(module: torch.nn.Module, microbatches: int, stage: FsdpStage | None = None, sync_start: int = 0,
                 prediction: float = 0.0, lag: int = 1):
    """PipeDream-2BW's versions of `module`'s parameters (and MoE expert biases,
    `load_balance.versioned_tensors`): sharded when `stage` (its FSDP units) is given;
    synchronous for the first `sync_start` batches; predicted with horizon `prediction` when
    it is not 0 (without Sync Start: the config refuses it); for a gradient delay of `lag`
    steps, `lag` + 1 versions (sharded: without prediction, Sync Start or versioned buffers)."""
    assert not (prediction and sync_start), "weight prediction runs without Sync Start"
    tensors = [tensor for _, tensor in versioned_tensors(module)]
    if stage:
        params = list(module.parameters())
        if lag > 1:
            assert not (prediction or sync_start or tensors[len(params):]), "the config refuses these at a delay of several steps"
            return ShardedDelayedVersions(params, microbatches, stage, lag)
        if prediction:
            return ShardedPredictedVersions(params, microbatches, stage, prediction, buffers=tensors[len(params):])
        return ShardedTwoVersions(params, microbatches, stage, buffers=tensors[len(params):], sync_start=sync_start)
    if prediction:
        return PredictedVersions(tensors, microbatches, prediction, lag)
    return TwoVersions(tensors, microbatches, sync_start, lag)


def make_policy(schedule: str, module: torch.nn.Module, microbatches: int, accumulation: int | None, hold_gathered: bool = False,
                sync_start: int = 0, prediction: float = 0.0, stages_after: int = 0, lag: int = 1):
    """The weight-version policy of streaming schedule `schedule` for one stage module,
    synchronous for the first `sync_start` batches (Sync Start, module docstring), its
    weights predicted with horizon `prediction` when it is not 0 (PACI's forwards by
    `prediction` x the stage's mean delay, `stages_after` / accumulation local steps). With
    `hold_gathered` (a pipeline stage of its own) its FSDP units gather and reduce once per
    update (`FsdpStage.hold_gathered`). `lag`: 2BW's gradient delay in steps
    (`actions.gradient_delay`)."""
    stage = FsdpStage.of(module)
    if stage and hold_gathered:
        stage.hold_gathered()
    if schedule == "PipeDream2BW":
        return two_versions(module, microbatches, stage, sync_start, prediction, lag)
    accumulation = accumulation or microbatches
    if prediction and stages_after:  # the last stage's microbatches cross no local step
        assert not sync_start, "weight prediction runs without Sync Start"
        return PredictedAccumulation(list(module.parameters()), accumulation, microbatches, prediction * stages_after / accumulation, stage)
    return LocalAccumulation(list(module.parameters()), accumulation, microbatches, stage, sync_start)
