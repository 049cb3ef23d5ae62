"""`training.clipping = "lagged_global"` on hand-made gradients (one process, no run): the factor
min(1, max_norm / (max(G, n) + 1e-6)), G the global norm of LAG steps earlier and n the stage's
own; the per-stage fallback where G is unknown or not finite; a skipped update's norm is NaN."""

from __future__ import annotations

import math

import pytest
import torch

from titan_async.train.grad_norms import LaggedGlobalClipping, StageGradNorms

MAX_NORM = 1.0


def gradient(*values: float) -> list[torch.nn.Parameter]:
    """One parameter whose gradient holds `values`."""
    param = torch.nn.Parameter(torch.zeros(len(values)))
    param.grad = torch.tensor(values)
    return [param]


def clipped(lagged_norm: float, *values: float) -> tuple[float, torch.Tensor]:
    """(the norm `clip` returns, the gradient after it) of the update applying step 4's batch,
    with step 1's global norm `lagged_norm` (LAG = 3) on 2 stages."""
    clipping = LaggedGlobalClipping(MAX_NORM, stages=2)
    clipping.record(1, lagged_norm)
    params = gradient(*values)
    norm = clipping.clip(params, step=4, ep_enabled=False)
    return float(norm), params[0].grad


def test_a_spike_is_clipped_when_it_happens():
    """Step 1's norm 0.5 would let a gradient of norm 100 through unscaled; the stage's own norm
    clips it to max_norm at once."""
    norm, grad = clipped(0.5, 60.0, 80.0)
    assert norm == pytest.approx(100.0)
    assert grad.tolist() == pytest.approx([60.0 / (100.0 + 1e-6), 80.0 / (100.0 + 1e-6)], rel=1e-6)
    assert grad.norm().item() <= MAX_NORM


def test_without_a_spike_the_lagged_norm_scales():
    """n = 0.5 is under G = 2: the factor is max_norm / G, the stage's own norm does not bind."""
    norm, grad = clipped(2.0, 0.3, 0.4)
    assert norm == pytest.approx(0.5)
    assert grad.tolist() == pytest.approx([0.3 / (2.0 + 1e-6), 0.4 / (2.0 + 1e-6)], rel=1e-6)


def test_under_both_norms_nothing_is_scaled():
    assert clipped(0.5, 0.3, 0.4)[1].tolist() == pytest.approx([0.3, 0.4], rel=1e-6)


def test_a_skipped_update_makes_each_stage_clip_on_its_own():
    """A NaN norm at step 1 (a skipped update) is not used: each of the 2 stages clips its own
    gradient to max_norm / sqrt(2), here the norm 5 of (3, 4)."""
    _, grad = clipped(math.nan, 3.0, 4.0)
    scale = MAX_NORM / math.sqrt(2) / (5.0 + 1e-6)
    assert grad.tolist() == pytest.approx([3.0 * scale, 4.0 * scale], rel=1e-6)


def test_a_skipped_update_records_a_norm_that_is_not_finite():
    """Stage 1 skipped update 1 on the device (`found_inf` 1, its gradient zeroed, norm 0): the
    update's global norm is NaN, not stage 0's norm alone; update 2, made by both, is finite."""
    norms = StageGradNorms(stages=2, group=None, device=torch.device("cpu"))
    for update, skipped in ((1, 1.0), (2, 0.0)):
        norms.record(0, update, torch.tensor(3.0), torch.tensor(0.0))
        norms.record(1, update, torch.tensor(0.0 if skipped else 4.0), torch.tensor(skipped))
        norms.start(update, update, [])
    first, second = norms.read(1), norms.read(2)
    assert math.isnan(first[0]) and first[1][0] == pytest.approx(3.0) and math.isnan(first[1][1])
    assert second[0] == pytest.approx(5.0)
