"""FSDP2 driven as a streaming stage drives it (titan_async.parallel.fsdp_stage): units held
gathered, and `finalize_backward` called between the forwards and backwards of other
microbatches, where torch's docstring says not to call it. Two gloo ranks against plain
modules: if a torch upgrade changes the state this relies on (units staying gathered,
gradients of the microbatches reduced so far, later backwards still reduced), this fails.
Also on two ranks: 2BW's version switches (titan_async.pipeline.versions) copy at most one pass
over the switched bytes (counted by a dispatch mode here), and a backward whose forward ran on
another version than the one gathered meanwhile still computes with its own (input gradients
against plain modules holding each version's weights); an update steps the parameters' own
shard storage, where checkpointers may have cached them."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

from titan_async.core import platform

platform.configure()

from torch.distributed.tensor import DTensor  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from titan_async.parallel.fsdp_stage import FsdpStage  # noqa: E402
from titan_async.pipeline.versions import make_policy  # noqa: E402


def _inputs(rank: int, microbatch: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * rank + microbatch))


def _reference_grads(reference: nn.Module, microbatches: list[int]) -> dict[str, torch.Tensor]:
    """Gradients of the summed outputs of `microbatches`, averaged over both ranks' inputs (FSDP's reduction)."""
    reference.zero_grad()
    for rank in range(2):
        for microbatch in microbatches:
            (reference(_inputs(rank, microbatch)).sum() / 2).backward()
    return {name: p.grad.clone() for name, p in reference.named_parameters()}


def _join(rank: int, init_file: str) -> None:
    """A worker process's start: CPU, one thread, rank `rank` of a 2-rank gloo group."""
    platform.configure()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)


def _worker(rank: int, init_file: str) -> None:
    _join(rank, init_file)
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


class CopiedBytes(TorchDispatchMode):
    """Bytes that copy ops (copy_, clone, _to_copy) write while active."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in ("copy_", "clone", "_to_copy", "copy"):
            local = out.to_local() if isinstance(out, DTensor) else out
            self.bytes += local.numel() * local.element_size()
        return out


def _sharded_toy(reference: nn.Module) -> nn.Module:
    """`reference` under FSDP2, its 15-row layer split unevenly (8 + 7 rows: FSDP pads rank 1's shard)."""
    model = copy.deepcopy(reference)
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    return model


def _switch(policy, batch: int, switched: int) -> None:
    """Activate `batch`'s version, checking that it copies at most one pass over `switched` bytes."""
    with CopiedBytes() as counter:
        policy.activate(batch)
    assert counter.bytes <= switched, f"switching to version {batch} copied {counter.bytes} bytes of {switched}"


def _input_grad(model: nn.Module, x: torch.Tensor, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """d sum(model(x)) / dx for a plain copy of `model` holding `weights`."""
    plain = copy.deepcopy(model)
    plain.load_state_dict(weights)
    x = x.detach().clone().requires_grad_()
    plain(x).sum().backward()
    return x.grad


@torch.no_grad()
def step(params: list[torch.Tensor]) -> None:
    """The optimizer step of these tests: W <- W - 0.1."""
    for param in params:
        param.sub_(0.1)


def _version_worker(rank: int, init_file: str) -> None:
    _join(rank, init_file)
    try:
        torch.manual_seed(0)
        reference = nn.Sequential(nn.Linear(8, 15), nn.Tanh(), nn.Linear(15, 3))
        v1 = {name: t.clone() for name, t in reference.state_dict().items()}  # U_0 = U_1 = W[0]
        v2 = {name: t - 0.1 for name, t in v1.items()}  # U_2 = U_1 - Opt(g_0), with the step below

        # A pipeline stage (held gathered), 2BW's order with one microbatch per batch:
        # F0 F1 B0 (update 0) F2 B1 B2. B1 runs after F2 gathered U_2, on U_1 gathered by F1.
        model = _sharded_toy(reference)
        policy = make_policy("PipeDream2BW", model, microbatches=1, accumulation=None, hold_gathered=True)
        sharded = list(model.parameters())  # what the optimizer holds; gathered, the module shows the unsharded ones
        gathered = sum(p.numel() * p.element_size() for p in reference.parameters())
        inputs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * rank + b)).requires_grad_() for b in range(3)]
        outputs = {}
        for batch in (0, 1):
            policy.before_forward(batch)
            outputs[batch] = model(inputs[batch]).sum()
        _switch(policy, 0, gathered)
        outputs[0].backward()
        assert policy.after_backward(0) == 0
        policy.apply_update(0, lambda: step(sharded))
        policy.before_forward(2)
        outputs[2] = model(inputs[2]).sum()
        for batch, weights in ((1, v1), (2, v2)):
            _switch(policy, batch, gathered)
            outputs[batch].backward()
            assert torch.allclose(inputs[batch].grad, _input_grad(reference, inputs[batch], weights), atol=1e-6), (rank, batch)
        assert torch.allclose(inputs[0].grad, _input_grad(reference, inputs[0], v1), atol=1e-6), rank

        # FSDP resharding as configured (`training.gradient_delay = 1`): versions switch on the shards.
        model = _sharded_toy(reference)
        policy = make_policy("PipeDream2BW", model, microbatches=1, accumulation=None)
        sharded = list(model.parameters())
        own = [p.to_local().untyped_storage().data_ptr() for p in sharded]
        shards = sum(p.to_local().numel() * p.element_size() for p in sharded)
        for side in policy.copies():
            side.mul_(2)  # the side shard now holds another version
        for batch, factor in ((0, 2), (1, 1), (0, 2)):
            _switch(policy, batch, shards)
            for param, expected in zip(sharded, reference.parameters()):
                assert torch.equal(param.full_tensor(), factor * expected.detach()), (rank, batch)
        # An update steps U_1 (held by the parameters' own storage) into that storage, which a
        # checkpointer may have cached, while version 0 is active.
        policy.apply_update(0, lambda: step(sharded))
        for param, expected, pointer in zip(sharded, reference.parameters(), own):
            assert param.to_local().untyped_storage().data_ptr() == pointer, rank
            assert torch.equal(param.full_tensor(), expected.detach() - 0.1), rank
    finally:
        dist.destroy_process_group()


def test_2bw_switches_copy_at_most_one_pass_and_backwards_keep_their_version(tmp_path):
    mp.spawn(_version_worker, args=(str(tmp_path / "init"),), nprocs=2)


def _delay_worker(rank: int, init_file: str) -> None:
    """Stage 0 of PP 4 with one microbatch per step (d = 3) held gathered, through its own
    action order (drains included): each backward computes with U_t = W[t - 3] and each update
    steps the latest version, W[k] = W[0] - 0.1 k, written out here, in the parameters' own
    storage; switches copy at most one pass; each version is all-gathered once (its backward finds it in a gathered side buffer,
    of which at most d are kept)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    from titan_async.pipeline.actions import drain_actions, gradient_delay, window_actions
    _join(rank, init_file)
    gathers, all_gather = [], _fsdp_param_group.foreach_all_gather
    _fsdp_param_group.foreach_all_gather = lambda *args, **kwargs: gathers.append(1) or all_gather(*args, **kwargs)
    try:
        torch.manual_seed(0)
        reference = nn.Sequential(nn.Linear(8, 15), nn.Tanh(), nn.Linear(15, 3))
        w0 = {name: t.clone() for name, t in reference.state_dict().items()}
        stages, delay, windows = 4, gradient_delay(4, 1), 7
        weights = lambda k: {name: t - 0.1 * max(k, 0) for name, t in w0.items()}  # W[k]
        model = _sharded_toy(reference)
        policy = make_policy("PipeDream2BW", model, microbatches=1, accumulation=None, hold_gathered=True, lag=delay)
        sharded = list(model.parameters())
        own = [p.to_local().untyped_storage().data_ptr() for p in sharded]
        gathered = sum(p.numel() * p.element_size() for p in reference.parameters())
        inputs, outputs, since, checked = {}, {}, 0, 0
        for window in range(windows):
            actions = window_actions(0, stages, 1, window, since)
            if window in (3, windows - 1):
                actions += drain_actions(0, stages, 1, window, since)
                since = window + 1
            for action in actions:
                k = action.microbatch_index
                if action.computation_type.value == "F":
                    policy.before_forward(k)
                    inputs[k] = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * rank + k)).requires_grad_()
                    outputs[k] = model(inputs[k]).sum()
                    continue
                _switch(policy, k, gathered)
                outputs.pop(k).backward()
                expected = _input_grad(reference, inputs[k], weights(k - delay))
                assert torch.allclose(inputs.pop(k).grad, expected, atol=1e-6), (rank, k)
                checked += 1
                assert policy.after_backward(k) == k
                policy.apply_update(k, lambda: step(sharded))
                assert len(policy.spares) + len(policy.free) <= delay
                assert [p.to_local().untyped_storage().data_ptr() for p in sharded] == own  # stepped in their own storage
            if since == window + 1:
                policy.expose_latest(window + 1)
                for param, name in zip(sharded, w0):
                    assert torch.allclose(param.full_tensor(), weights(window + 1)[name], atol=1e-6), (rank, window, name)
        assert checked == windows and policy.extra_bytes() == delay * sum(p.to_local().untyped_storage().nbytes() for p in sharded)
        assert len(gathers) == windows * len(FsdpStage.of(model).groups), (rank, len(gathers))
    finally:
        _fsdp_param_group.foreach_all_gather = all_gather
        dist.destroy_process_group()


def test_2bw_at_a_delay_of_three_steps_backwards_on_the_version_of_three_steps_before(tmp_path):
    mp.spawn(_delay_worker, args=(str(tmp_path / "init"),), nprocs=2)
