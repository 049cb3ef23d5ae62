"""FSDP2 driven as a streaming stage drives it (titan_async.parallel.fsdp_stage): units held
gathered, and `finalize_backward` called between the forwards and backwards of other
microbatches, where torch's docstring says not to call it. Two gloo ranks against plain
modules: if a torch upgrade changes the state this relies on (units staying gathered,
gradients of the microbatches reduced so far, later backwards still reduced), this fails."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

from titan_async.core import platform

platform.configure()

from titan_async.parallel.fsdp_stage import FsdpStage  # noqa: E402


def _inputs(rank: int, microbatch: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * rank + microbatch))


def _reference_grads(reference: nn.Module, microbatches: list[int]) -> dict[str, torch.Tensor]:
    """Gradients of the summed outputs of `microbatches`, averaged over both ranks' inputs (FSDP's reduction)."""
    reference.zero_grad()
    for rank in range(2):
        for microbatch in microbatches:
            (reference(_inputs(rank, microbatch)).sum() / 2).backward()
    return {name: p.grad.clone() for name, p in reference.named_parameters()}


def _worker(rank: int, init_file: str) -> None:
    platform.configure()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        reference = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        model = copy.deepcopy(reference)
        for layer in (model[0], model[2]):
            fully_shard(layer)
        fully_shard(model)
        stage = FsdpStage.of(model)
        stage.hold_gathered()
        sharded = dict(model.named_parameters())  # what the optimizer holds; gathered, the module shows the unsharded ones

        def reduced(microbatches: list[int]) -> None:
            stage.reduce()
            assert stage.gathered, "a reduce between microbatches resharded the stage"
            expected = _reference_grads(reference, microbatches)
            for name, param in sharded.items():
                got = param.grad.full_tensor()
                assert torch.allclose(got, expected[name], atol=1e-6), (rank, microbatches, name, (got - expected[name]).abs().max())
                param.grad = None

        # The streaming order of a stage with one microbatch in flight: F0 F1 B0 | F2 B1 | B2.
        first, second = model(_inputs(rank, 0)).sum(), model(_inputs(rank, 1)).sum()
        assert stage.gathered
        first.backward()
        reduced([0])  # microbatch 1's forward is outstanding
        third = model(_inputs(rank, 2)).sum()
        second.backward()
        reduced([1])  # microbatch 2's forward is outstanding
        third.backward()
        reduced([2])
    finally:
        dist.destroy_process_group()


def test_reduce_between_forwards_and_backwards_matches_plain_modules(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path / "init"),), nprocs=2)
