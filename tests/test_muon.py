"""Muon: Newton-Schulz band, batched iteration, fused QKV blocks, FLOP-balanced owners, FSDP=2 equals
one process, routing on pipeline stages."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from titan_async.core import platform

platform.configure()

from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import Shard, distribute_tensor  # noqa: E402
from torch.distributed.tensor.placement_types import _StridedShard  # noqa: E402
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig  # noqa: E402
from torchtitan.distributed.pipeline_parallel import _split_module  # noqa: E402

from titan_async.model.llama import ModelSection, build_model_spec  # noqa: E402
from titan_async.optim import ErrorFeedback, Muon, RoutedOptimizersContainer  # noqa: E402
from titan_async.optim.blocks import ExpertBlocks, FusedQKVBlocks  # noqa: E402
from titan_async.optim import newton_schulz_batched  # noqa: E402
from titan_async.optim.full_matrix import assign_owners, create_exchange_groups, exchange_group, map_full_matrices  # noqa: E402
from titan_async.optim.newton_schulz import COEFFICIENTS, flops, gram_form, orthogonalize, resolve_dtype  # noqa: E402
from titan_async.optim.newton_schulz_batched import orthogonalize_all  # noqa: E402
from titan_async.optim.section import OptimizerSection  # noqa: E402

NS_BAND = (0.68, 1.135)
"""Where 5 quintic Newton-Schulz steps send every singular value that starts in [0.01, 1]:
measured on the scalar map, min 0.6818 and max 1.1344."""


def scalar_newton_schulz(x: torch.Tensor, steps: int = 5) -> torch.Tensor:
    a, b, c = COEFFICIENTS
    for _ in range(steps):
        x = a * x + b * x**3 + c * x**5
    return x


def muon_update(matrix: torch.Tensor, **muon_options) -> torch.Tensor:
    """The step Muon takes (weights before minus after) for gradient `matrix`, with lr 1."""
    param = nn.Parameter(torch.zeros_like(matrix))
    param.grad = matrix.clone()
    Muon([param], lr=1.0, momentum=0.0, nesterov=False, **muon_options).step()
    return -param.detach()


def test_band_of_the_quintic_iteration():
    x = torch.logspace(-2, 0, 100_001, dtype=torch.float64)
    y = scalar_newton_schulz(x)
    assert NS_BAND[0] <= y.min() < NS_BAND[0] + 0.005
    assert NS_BAND[1] - 0.005 < y.max() <= NS_BAND[1]


@pytest.mark.parametrize("shape", [(128, 512), (512, 128)], ids=["wide", "tall"])
def test_update_singular_values_lie_in_the_band(shape):
    torch.manual_seed(0)
    gradient = torch.randn(shape)
    update = muon_update(gradient, lr_scaling="original") / math.sqrt(max(1, shape[0] / shape[1]))
    singular = torch.linalg.svdvals(update.double())
    assert NS_BAND[0] <= singular.min() and singular.max() <= NS_BAND[1], (singular.min(), singular.max())
    expected = scalar_newton_schulz(torch.linalg.svdvals(gradient.double()) / gradient.double().norm())
    torch.testing.assert_close(singular.sort().values, expected.sort().values, atol=1e-4, rtol=0)


def reference_newton_schulz(matrix: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Keller Jordan's reference Muon iteration (`zeropower_via_newtonschulz5`), in float64."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = matrix.double()
    transposed = x.size(0) > x.size(1)
    if transposed:
        x = x.T
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if transposed else x


def relative(result: torch.Tensor, reference: torch.Tensor) -> float:
    return float((result.double() - reference.double()).norm() / reference.double().norm())


BATCH_SHAPES = [(48, 80), (80, 48), (48, 80), (64, 64), (16, 80), (80, 16), (40, 48)]
"""Wide, tall (stacked with the wide ones of the transposed shape), repeated, square, K/V-like, and
one only slightly wide: all but (64, 64) and (40, 48) take the Gram form in float32."""

FORMS = {"as-muon-runs-it": {}, "standard-form": {"gram": False}, "batched-gemm": {"batched_gemm": True}}


@pytest.mark.parametrize("symmetric_min_rows", [512, 16], ids=["whole-products", "half-block-products"])
@pytest.mark.parametrize("options", FORMS.values(), ids=FORMS.keys())
def test_batched_iteration_equals_one_at_a_time_and_the_reference(options, symmetric_min_rows, monkeypatch):
    monkeypatch.setattr(newton_schulz_batched, "SYMMETRIC_MIN_ROWS", symmetric_min_rows)
    torch.manual_seed(0)
    matrices = [torch.randn(shape) for shape in BATCH_SHAPES]
    for matrix, result in zip(matrices, orthogonalize_all(matrices, 5, torch.float32, **options)):
        assert result.shape == matrix.shape and result.dtype == torch.float32
        assert relative(result, orthogonalize(matrix)) < 1e-5
        assert relative(result, reference_newton_schulz(matrix)) < 1e-5


def test_gram_form_only_in_float32_where_it_saves_flops():
    assert [gram_form(shape, 5, torch.float32) for shape in BATCH_SHAPES] == [True] * 3 + [False] + [True] * 2 + [False]
    assert not gram_form((48, 80), 5, torch.bfloat16) and not gram_form((48, 80), 1, torch.float32)
    for shape in [(48, 80), (64, 64), (40, 48)]:
        standard = flops(shape, 5, torch.bfloat16)
        assert (flops(shape, 5, torch.float32) < standard) == gram_form(shape, 5, torch.float32)
    torch.manual_seed(0)
    matrices = [torch.randn(shape) for shape in BATCH_SHAPES]
    for matrix, result in zip(matrices, orthogonalize_all(matrices, 5, torch.bfloat16)):
        assert relative(result, orthogonalize(matrix, dtype=torch.bfloat16)) < 1e-3


def test_gram_form_accuracy_on_a_decaying_spectrum():
    """The documented cost of the Gram form: rounding amplified on ill-conditioned inputs."""
    torch.manual_seed(0)
    left, _ = torch.linalg.qr(torch.randn(64, 64, dtype=torch.float64))
    right, _ = torch.linalg.qr(torch.randn(256, 64, dtype=torch.float64))
    matrix = (left * torch.logspace(0, -4, 64, dtype=torch.float64)) @ right.T
    reference = reference_newton_schulz(matrix)
    gram, standard = (orthogonalize_all([matrix.float()], 5, torch.float32, gram=g)[0] for g in (True, False))
    assert relative(standard, reference) < 1e-5
    assert 1e-5 < relative(gram, reference) < 1e-3


def test_muon_runs_one_batched_iteration_per_block_shape(monkeypatch):
    """Same-shape matrices, tall ones and the Q/K/V blocks of a fused matrix share stacks."""
    stacks = []
    batched = newton_schulz_batched.orthogonalize_batched

    def recording(stack, *args, **kwargs):
        stacks.append(tuple(stack.shape))
        return batched(stack, *args, **kwargs)

    monkeypatch.setattr(newton_schulz_batched, "orthogonalize_batched", recording)
    shapes = {"wqkv": (24, 16), "wo": (8, 16), "w1": (16, 8), "w2": (8, 16), "w3": (16, 16)}
    params = {name: nn.Parameter(torch.zeros(shape)) for name, shape in shapes.items()}
    for param in params.values():
        param.grad = torch.randn(param.shape)
    qkv = FusedQKVBlocks(heads_per_kv=1, head_dim=4)
    Muon([{"params": list(params.values()), "param_names": list(params)}], lr=0.1, blocks={"wqkv": qkv}).step()
    assert sorted(stacks) == [(1, 16, 16), (6, 8, 16)]  # Q, K, V: 8 x 16 each


def test_owners_are_balanced_by_newton_schulz_flops():
    """A square matrix costs far more than a thin one of the same size: balancing by size would
    put it with a thin one; by FLOPs it is alone."""
    shapes = [(64, 64), (4, 1024), (4, 1024), (4, 1024)]
    assert len({rows * cols for rows, cols in shapes}) == 1
    costs = [flops(shape, 5, torch.bfloat16) for shape in shapes]
    assert costs[0] == 5 * 6 * 64**3 and costs[1] == 5 * (4 * 4 * 4 * 1024 + 2 * 4**3)
    assert flops((4, 1024), 5, torch.float32) == 4 * 4 * 4 * 1024 + 2 * 4**3 * 17
    assert assign_owners(costs, 2) == [0, 1, 1, 1]
    assert assign_owners([rows * cols for rows, cols in shapes], 2) == [0, 1, 0, 1]


def test_muon_costs_are_the_flops_of_its_blocks():
    param = nn.Parameter(torch.zeros(24, 16))
    muon = Muon([{"params": [param], "param_names": ["wqkv"]}], lr=0.1, ns_steps=3, blocks={"wqkv": FusedQKVBlocks(1, 4)})
    assert muon.newton_schulz_flops(param, muon.param_groups[0]) == flops((8, 16), 3, torch.float32) * 3


def test_auto_ns_dtype_is_bfloat16_on_cuda_and_float32_elsewhere():
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("float32", torch.device("cuda")) == torch.float32
    assert resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    torch.manual_seed(0)
    gradient = torch.randn(24, 40)
    assert torch.equal(muon_update(gradient), muon_update(gradient, ns_dtype="float32"))
    with pytest.raises(ValueError, match="ns_dtype must be one of auto, float32, bfloat16, got 'float16'"):
        Muon([nn.Parameter(gradient)], lr=0.1, ns_dtype="float16")


def test_bfloat16_iteration_stays_close_to_float32():
    torch.manual_seed(0)
    gradient = torch.randn(96, 160)
    exact = orthogonalize(gradient, dtype=torch.float32)
    rough = orthogonalize(gradient, dtype=torch.bfloat16)
    assert rough.dtype == torch.float32
    assert (rough - exact).norm() / exact.norm() < 0.05


def qkv_rows(n_kv: int, heads_per_kv: int, head_dim: int) -> dict[str, torch.Tensor]:
    """Row indices of Q, K and V in a fused wqkv weight, written out per KV group."""
    rows = {"q": [], "k": [], "v": []}
    group = (heads_per_kv + 2) * head_dim
    for g in range(n_kv):
        start = g * group
        rows["q"] += range(start, start + heads_per_kv * head_dim)
        rows["k"] += range(start + heads_per_kv * head_dim, start + (heads_per_kv + 1) * head_dim)
        rows["v"] += range(start + (heads_per_kv + 1) * head_dim, start + group)
    return {name: torch.tensor(index) for name, index in rows.items()}


def test_fused_qkv_blocks_are_orthogonalised_separately():
    n_kv, heads_per_kv, head_dim, dim = 3, 2, 4, 32
    blocks = FusedQKVBlocks(heads_per_kv=heads_per_kv, head_dim=head_dim)
    torch.manual_seed(0)
    gradient = torch.randn(n_kv * (heads_per_kv + 2) * head_dim, dim)
    assert torch.equal(blocks.merge(blocks.split(gradient)), gradient)

    param = nn.Parameter(torch.zeros_like(gradient))
    param.grad = gradient.clone()
    muon = Muon(
        [{"params": [param], "param_names": ["attention.wqkv.weight"]}],
        lr=1.0, momentum=0.0, nesterov=False, lr_scaling="match_rms_adamw",
        blocks={"attention.wqkv.weight": blocks},
    )
    muon.step()

    expected = torch.empty_like(gradient)
    for index in qkv_rows(n_kv, heads_per_kv, head_dim).values():
        block = gradient[index]
        expected[index] = orthogonalize(block) * 0.2 * math.sqrt(max(block.shape))
    torch.testing.assert_close(-param.detach(), expected, atol=1e-6, rtol=0)
    assert [shape for _, shape, _ in muon.lr_scales(param, muon.param_groups[0])] == [(24, 32), (12, 32), (12, 32)]


class ToyAttentionAndMlp(nn.Module):
    """Matrices of the shapes Muon meets: wide, tall (transposed inside Newton-Schulz), fused QKV,
    and row counts that do not split evenly over 2 ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.wqkv = nn.Linear(32, 48, bias=False)
        self.w1 = nn.Linear(32, 24, bias=False)
        self.w2 = nn.Linear(24, 7, bias=False)
        self.w3 = nn.Linear(7, 13, bias=False)
        self.w4 = nn.Linear(13, 20, bias=False)


def _muon_with_error_feedback(model: nn.Module) -> ErrorFeedback:
    names, params = zip(*model.named_parameters())
    muon = Muon(
        [{"params": list(params), "param_names": list(names)}],
        lr=0.05, weight_decay=0.1, ns_dtype="float32",
        blocks={"wqkv.weight": FusedQKVBlocks(heads_per_kv=2, head_dim=4)},
    )
    return ErrorFeedback(muon, coefficient=1.0)


def _check_flop_balanced_owners(rank: int) -> None:
    """map_full_matrices: owners by FLOPs, one function call per rank over its owned and its
    unsharded matrices, every rank's rows of the results back."""
    mesh = init_device_mesh("cpu", (2,))
    generator = torch.Generator().manual_seed(0)
    full = [torch.randn(shape, generator=generator) for shape in [(64, 64), (4, 1024), (5, 1024), (4, 1024), (3, 7)]]
    layouts = [distribute_tensor(m, mesh, [Shard(0)]) for m in full[:4]] + [full[4]]
    parts = [layout.to_local() if i < 4 else layout for i, layout in enumerate(layouts)]
    calls = []

    def fn(indices: list[int], matrices: list[torch.Tensor]) -> list[torch.Tensor]:
        calls.append(sorted(indices))
        return [m * (i + 1) for i, m in zip(indices, matrices)]

    local = map_full_matrices(parts, layouts, fn, costs=[flops(tuple(m.shape), 5, torch.bfloat16) for m in full])
    assert calls == ([[0, 4]] if rank == 0 else [[1, 2, 3, 4]]), calls
    for i, (matrix, rows) in enumerate(zip(full, local)):
        expected = distribute_tensor(matrix, mesh, [Shard(0)]).to_local() if i < 4 else matrix
        assert torch.equal(rows, expected * (i + 1)), i


def _check_fsdp2_equals_single_process(rank: int) -> None:
    torch.manual_seed(0)
    reference = ToyAttentionAndMlp()
    sharded = copy.deepcopy(reference)
    fully_shard(sharded)
    reference_opt, sharded_opt = _muon_with_error_feedback(reference), _muon_with_error_feedback(sharded)
    for step in range(4):
        torch.manual_seed(100 + step)
        for (name, ref_param), shard_param in zip(reference.named_parameters(), sharded.parameters()):
            gradient = torch.randn(ref_param.shape)
            ref_param.grad = gradient
            shard_param.grad = distribute_tensor(gradient, shard_param.device_mesh, shard_param.placements)
        reference_opt.step()
        sharded_opt.step()
        for (name, ref_param), shard_param in zip(reference.named_parameters(), sharded.parameters()):
            difference = (shard_param.full_tensor() - ref_param).abs().max().item()
            assert difference < 1e-5, f"rank {rank} step {step} {name}: FSDP differs by {difference}"


def _fsdp_worker(rank: int, init_file: str) -> None:
    platform.configure()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        _check_flop_balanced_owners(rank)
        _check_fsdp2_equals_single_process(rank)
    finally:
        dist.destroy_process_group()


def test_fsdp2_owners_by_flops_and_update_equals_single_process(tmp_path):
    """One pair of processes: `_check_flop_balanced_owners`, then Muon + EF under FSDP2 against one process."""
    mp.spawn(_fsdp_worker, args=(str(tmp_path / "init"),), nprocs=2)


def hand_written_muon_update(gradient: torch.Tensor) -> torch.Tensor:
    """Muon's step for lr 1, no momentum, no weight decay, "match_rms_adamw" scaling: 5 quintic
    Newton-Schulz steps (Keller Jordan's coefficients) on the whole matrix, scaled by 0.2 sqrt(max side)."""
    x = gradient.T if gradient.shape[0] > gradient.shape[1] else gradient
    x = x / x.norm()
    for _ in range(5):
        gram = x @ x.T
        x = 3.4445 * x + (-4.7750 * gram + 2.0315 * gram @ gram) @ x
    x = x.T if gradient.shape[0] > gradient.shape[1] else x
    return x * 0.2 * math.sqrt(max(gradient.shape))


def test_muon_orthogonalises_each_expert_of_a_stack_on_its_own():
    torch.manual_seed(0)
    experts = torch.randn(4, 6, 10)
    param = nn.Parameter(torch.zeros_like(experts))
    param.grad = experts.clone()
    muon = Muon([{"params": [param], "param_names": ["layers.0.moe.routed_experts.inner_experts.w2_EDF"]}], lr=1.0, momentum=0.0,
                nesterov=False, ns_dtype="float32", blocks={"layers.0.moe.routed_experts.inner_experts.w2_EDF": ExpertBlocks(4)})
    muon.step()
    expected = torch.stack([hand_written_muon_update(matrix) for matrix in experts])
    torch.testing.assert_close(-param.detach(), expected, atol=2e-6, rtol=0)
    with pytest.raises(ValueError, match="3-D with ExpertBlocks"):
        Muon([nn.Parameter(torch.zeros(2, 3, 4))], lr=1.0)


TP_LAYOUTS = {
    "tp colwise": ((4,), ("tp",), [Shard(0)]),
    "tp rowwise": ((4,), ("tp",), [Shard(1)]),
    "fsdp x tp colwise": ((2, 2), ("dp_shard", "tp"), [_StridedShard(0, split_factor=2), Shard(0)]),
    "fsdp x tp rowwise": ((2, 2), ("dp_shard", "tp"), [Shard(0), Shard(1)]),
}


def _tensor_parallel_worker(rank: int, init_file: str) -> None:
    """Every layout FSDP2 and torchtitan's TP plan give a matrix (uneven shapes included): one
    Muon step equals the hand-written update of the full matrix, and each rank's part of the
    update sits where `distribute_tensor` puts that rank's part."""
    platform.configure()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
        param = nn.Parameter(distribute_tensor(torch.zeros(8, 8), mesh, [Shard(0), Shard(1)]))
        with pytest.raises(RuntimeError, match="create_exchange_groups"):
            Muon([param], lr=1.0)
        create_exchange_groups([param] if rank == 0 else [])  # ranks that name no matrix (a stage without one) make its group too
        assert dist.get_process_group_ranks(exchange_group(param)) == [0, 1, 2, 3]
        generator = torch.Generator().manual_seed(0)
        for name, (mesh_shape, dims, placements) in TP_LAYOUTS.items():
            mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=dims)
            uneven = [] if isinstance(placements[0], _StridedShard) else [(10, 36), (7, 5)]  # distribute_tensor needs even strides
            for shape in [(24, 16), (12, 36), *uneven]:
                full_gradient = torch.randn(shape, generator=generator)
                param = nn.Parameter(distribute_tensor(torch.zeros(shape), mesh, placements))
                param.grad = distribute_tensor(full_gradient, mesh, placements)
                create_exchange_groups([param])
                Muon([param], lr=1.0, momentum=0.0, nesterov=False, ns_dtype="float32").step()
                expected = distribute_tensor(hand_written_muon_update(full_gradient), mesh, placements).to_local()
                torch.testing.assert_close(-param.to_local(), expected, atol=2e-5, rtol=0, msg=f"{name} {shape} rank {rank}")
                assert torch.allclose(-param.full_tensor(), hand_written_muon_update(full_gradient), atol=2e-5), (name, shape)
        expert_layouts = {  # FSDP alone, and expert parallelism's (efsdp, ep) meshes (torchtitan's EP layout)
            "fsdp": ((4,), ("efsdp",), [Shard(0)]),
            "ep 4": ((1, 4), ("efsdp", "ep"), [Shard(0), Shard(0)]),
            "efsdp 2 x ep 2": ((2, 2), ("efsdp", "ep"), [_StridedShard(0, split_factor=2), Shard(0)]),
        }
        for name, (mesh_shape, dims, placements) in expert_layouts.items():
            mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=dims)
            experts = torch.randn((8, 12, 16), generator=generator)
            param = nn.Parameter(distribute_tensor(torch.zeros(experts.shape), mesh, placements))
            param.grad = distribute_tensor(experts, mesh, placements)
            create_exchange_groups([param])
            Muon([{"params": [param], "param_names": ["w1_EFD"]}], lr=1.0, momentum=0.0, nesterov=False, ns_dtype="float32",
                 blocks={"w1_EFD": ExpertBlocks(8)}).step()
            expected = torch.stack([hand_written_muon_update(matrix) for matrix in experts])
            torch.testing.assert_close(-param.full_tensor(), expected, atol=2e-5, rtol=0,
                                       msg=f"experts sharded by expert ({name}), rank {rank}")
    finally:
        dist.destroy_process_group()


def test_muon_updates_tensor_parallel_weights_from_their_full_matrix(tmp_path):
    """4 processes: the FSDP x TP group made on every rank though only one names the matrix (and
    Muon refusing the matrix before it exists); TP 4 (column- and row-sharded weights), FSDP 2 x
    TP 2 (the _StridedShard layout FSDP2 gives a column-parallel weight) and a stack of expert
    matrices sharded by expert (FSDP, and expert parallelism's efsdp x ep layouts), against a
    Newton-Schulz written here (per expert for the stack)."""
    mp.spawn(_tensor_parallel_worker, args=(str(tmp_path / "init"),), nprocs=4)


def debug_model_stages() -> list[nn.Module]:
    """Three pipeline stages of the debug model, one of them with activation-checkpoint wrappers."""
    with torch.device("meta"):
        model = build_model_spec(ModelSection(), 2048).model.build()
    stages = [
        _split_module(model, ["tok_embeddings", "layers.0", "layers.1"]),
        _split_module(model, ["layers.2", "layers.3"]),
        _split_module(model, ["layers.4", "layers.5", "norm", "lm_head"]),
    ]
    for name, block in list(stages[1].layers.items()):
        stages[1].layers[name] = checkpoint_wrapper(block)
    return stages


def expected_optimizer(name: str, param: nn.Parameter) -> str:
    if param.ndim != 2 or name.startswith(("tok_embeddings.", "lm_head.")):
        return "AdamW"
    return "Muon"


@pytest.mark.parametrize("stage_index", [0, 1, 2], ids=["embeddings+layers", "layers-only", "layers+norm+head"])
def test_routing_builds_on_every_pipeline_stage(stage_index):
    stage = debug_model_stages()[stage_index]
    config = OptimizerSection(name="muon").container_config()
    container = config.build(model_parts=[stage])
    assert isinstance(container, RoutedOptimizersContainer)

    owner: dict[int, str] = {}
    names: dict[int, str] = {}
    for optimizer in container:
        for group in optimizer.param_groups:
            for name, param in zip(group["param_names"], group["params"]):
                assert id(param) not in owner, f"{name} is in two groups"
                owner[id(param)] = type(optimizer).__name__
                names[id(param)] = name
    params = dict(stage.named_parameters())
    assert len(owner) == len(params)
    for raw_name, param in params.items():
        name = raw_name.replace("_checkpoint_wrapped_module.", "")
        assert names[id(param)] == name
        assert owner[id(param)] == expected_optimizer(name, param), name
    kinds = set(owner.values())
    assert kinds == {"Muon", "AdamW"}


def test_torchtitan_regex_groups_fail_on_a_stage_without_the_head():
    """Why routing is per parameter: torchtitan requires every pattern to match on every stage."""
    stage = debug_model_stages()[1]
    config = OptimizersContainer.Config(
        param_groups=[
            ParamGroupConfig(pattern=r"^(tok_embeddings|lm_head)\.", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3}),
            ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3}),
        ]
    )
    with pytest.raises(ValueError, match="matched no parameters"):
        config.build(model_parts=[stage])
