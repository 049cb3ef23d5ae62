"""Weight-version policies on plain tensors: what each version holds and the memory it costs."""

from __future__ import annotations

import torch

from titan_async.pipeline.versions import LocalAccumulation, TwoVersions


def parameters() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(4))]


def test_two_versions_cost_one_copy_of_the_weights_and_switch_without_copying():
    params = parameters()
    policy = TwoVersions(params, microbatches=2)
    assert policy.extra_bytes() == 0  # both versions are the live weights until they differ
    first = [p.data_ptr() for p in params]
    policy.activate(1)
    assert [p.data_ptr() for p in params] != first
    assert policy.extra_bytes() == (8 * 4 + 4) * 4


def test_weights_loaded_after_construction_are_both_versions():
    params = parameters()
    policy = TwoVersions(params, microbatches=1)
    loaded = [torch.randn_like(p) for p in params]
    for param, value in zip(params, loaded):
        param.data.copy_(value)  # an initial checkpoint load writes into the parameters
    for batch in (0, 1):
        policy.activate(batch)
        assert all(torch.equal(p, value) for p, value in zip(params, loaded)), batch


def test_paci_keeps_no_weight_copy():
    assert LocalAccumulation(parameters(), accumulation=2, microbatches=4).extra_bytes() == 0
