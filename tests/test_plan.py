"""`titan-async plan`: memory estimates, bubbles and the fake-process-group dry run, on CPU."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torchtitan.distributed.activation_checkpoint import FullAC

from conftest import CONFIGS, REPO, cli_in_process, fresh_environment, sets
from titan_async.config.run_config import build_run_config, load_run_config
from titan_async.model.meta import build_meta_model
from titan_async.cluster.memory import (
    MuonMatrix,
    Setup,
    StageShape,
    block_activation_bytes,
    bubble,
    compare_schedules,
    fsdp_traffic_bytes,
    held_microbatches,
    muon_step_bytes,
)
from titan_async.cluster.cluster import parse_size
from titan_async.optim.error_feedback import ErrorFeedback
from titan_async.optim.muon import Muon
from titan_async.optim.routing import route_parameters

_SPEC = importlib.util.spec_from_file_location("bench_plan_memory", REPO / "tools" / "bench_plan_memory.py")
bench_memory = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench_memory)

pytestmark = pytest.mark.filterwarnings("ignore:DTensor random operators")  # initializing meta DTensors
SHIPPED = sorted(CONFIGS.glob("*.toml"))
TEN_B = CONFIGS / "10b_2bw_muon.toml"
TEN_B_512 = CONFIGS / "10b_2bw_muon_512gpu.toml"
SEVENTY_B = CONFIGS / "70b_2bw_muon.toml"
_PLANS: dict[str, dict] = {}


def cluster_of(path: Path) -> tuple[int, int]:
    """(nodes, GPUs per node) a shipped config is written for: the 10B ones on nodes of 8 GPUs, one
    FSDP group per node (a node per stage and replica), the 70B on 16 nodes of 8 (a stage per pair
    of nodes, TP 8 inside each), the 1B on one node, the debug ones on one GPU per process."""
    p = load_run_config(path).parallelism
    if path.stem.startswith("70b_"):
        return 16, 8
    if path.stem.startswith("10b_"):
        return p.pipeline_parallel_degree * p.data_parallel_replicate_degree, 8
    if path.stem.startswith("1b_"):
        return 1, 8
    gpus = p.pipeline_parallel_degree * p.tensor_parallel_degree * p.context_parallel_degree
    return 1, gpus * p.data_parallel_replicate_degree * max(1, p.data_parallel_shard_degree)


def plan(capsys, *args: str) -> tuple[int, str, str]:
    return cli_in_process(capsys, "plan", *args)


def plan_json(capsys, path: Path) -> dict:
    """The --json plan of a shipped config on its cluster with 80 GiB GPUs, which it must fit
    (--strict; computed once)."""
    if path.stem not in _PLANS:
        nodes, gpus = cluster_of(path)
        code, out, err = plan(capsys, "--config", str(path), "--nodes", str(nodes), "--gpus-per-node", str(gpus),
                              "--gpu-memory", "80GiB", "--strict", "--json")
        assert code == 0, err
        _PLANS[path.stem] = json.loads(out)
    return _PLANS[path.stem]


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_every_shipped_config_plans_and_its_dry_run_matches_the_estimate(path, capsys):
    result = plan_json(capsys, path)
    nodes, gpus = cluster_of(path)
    assert result["world_size"] == nodes * gpus
    inspected = result["dry_run"]["ranks"]
    assert inspected[0]["rank"] == 0 and inspected[-1]["rank"] == nodes * gpus - 1
    for rank in inspected:
        assert 0.9 <= rank["ratio"] <= 1.1, rank
    if result["layout"]["pipeline_parallel"] > 1:
        assert all(rank["action_counts"]["F"] >= result["layout"]["microbatches"] for rank in inspected)


def test_ten_b_model_has_about_ten_billion_parameters(capsys):
    model = plan_json(capsys, TEN_B)["model"]
    assert 9.5e9 <= model["parameters"] <= 10.5e9
    assert (model["dim"], model["n_layers"], model["n_kv_heads"], model["vocab_size"]) == (5120, 40, 8, 128256)


def test_ten_b_fits_64_gpus_of_80gib_and_the_estimate_is_within_10_percent_of_the_dry_run(capsys):
    result = plan_json(capsys, TEN_B)
    assert result["world_size"] == 64 and result["gpu_memory_bytes"] == 80 * 2**30
    assert result["fits"] and result["peak_bytes"] <= 80 * 2**30
    assert [r["pp_rank"] for r in result["ranks"]] == list(range(8))
    inspected = {r["rank"]: r for r in result["dry_run"]["ranks"]}
    assert {0, 56, 63} <= set(inspected)
    for rank in inspected.values():
        assert rank["fsdp_wrapped"]
        stage_parameters = result["ranks"][rank["pp_rank"]]["parameters"]
        assert rank["local_parameters"] == pytest.approx(stage_parameters / 8, rel=0.01)
        allocated, estimate = sum(rank["allocated"].values()), sum(rank["estimate"].values())
        assert abs(allocated / estimate - 1) <= 0.10, rank
        assert rank["allocated"]["weight_versions"] > 0 and rank["allocated"]["error_feedback"] > 0
    assert "estimates only" in result["dry_run"]["note"]


def test_ten_b_dry_run_builds_each_ranks_streaming_action_list(capsys):
    result = plan_json(capsys, TEN_B)
    m = result["layout"]["microbatches"]
    inspected = {r["rank"]: r for r in result["dry_run"]["ranks"]}
    first, last = inspected[0], inspected[63]
    assert first["actions"][:9] == [f"0F{k}" for k in range(8)] + ["0B0"]
    assert last["actions"][:4] == ["7F0", "7B0", "7F1", "7B1"]
    assert first["action_counts"] == {"F": 2 * m, "B": 2 * m}


def test_ten_b_plan_predicts_fsdp_communication_per_step_for_every_schedule(capsys):
    """One gather of the stage (bfloat16) and one reduction (float32) per step for torch's schedules
    and the streaming ones alike; PACI's local steps (one per step at the default accumulation)."""
    result = plan_json(capsys, TEN_B)
    rows = {row["name"]: row for row in result["communication"]}
    assert set(rows) == {s["name"] for s in result["schedules"]}
    for row in rows.values():
        assert len(row["ranks"]) == 8
        for rank, moved in zip(result["ranks"], row["ranks"]):
            assert moved == {"all_gather": 2 * rank["parameters"], "reduce_scatter": 4 * rank["parameters"], "all_reduce": 0}
    assert rows["PipeDream2BW"]["selected"]


def test_ten_b_on_512_gpus_fits_strictly_with_replicas_holding_the_fsdp_groups_shards(capsys):
    """PP 8 x FSDP 8 x replicas 8: each GPU holds a stage's FSDP shard, as at 64 GPUs, and the first
    GPU of every pipeline rank and the last GPU (last replica) build their stage and action list."""
    result, alone = plan_json(capsys, TEN_B_512), plan_json(capsys, TEN_B)
    assert result["world_size"] == 512 and result["fits"] and result["peak_bytes"] <= 80 * 2**30
    layout = result["layout"]
    assert (layout["pipeline_parallel"], layout["data_parallel_shard"], layout["data_parallel_replicate"]) == (8, 8, 8)
    assert [r["memory"] for r in result["ranks"]] == [r["memory"] for r in alone["ranks"]]
    inspected = {r["rank"]: r for r in result["dry_run"]["ranks"]}
    assert sorted(inspected) == [64 * k for k in range(8)] + [511]
    m = layout["microbatches"]
    for rank in inspected.values():
        stage = rank["pp_rank"]
        warmup = 8 - stage  # forwards before the first backward
        assert rank["fsdp_wrapped"] and rank["ratio"] == pytest.approx(1, abs=0.01)
        assert rank["local_parameters"] == pytest.approx(result["ranks"][stage]["parameters"] / 8, rel=0.01)
        assert rank["actions"][:warmup + 1] == [f"{stage}F{k}" for k in range(warmup)] + [f"{stage}B0"]
        assert rank["action_counts"] == {"F": 2 * m, "B": 2 * m}
    assert inspected[511]["local_parameters"] == inspected[448]["local_parameters"]


def test_ten_b_on_512_gpus_adds_the_replica_all_reduce_of_the_reduced_shard(capsys):
    """One all-reduce of the float32 gradient shard (stage parameters / 8 x 4 bytes) per step, for
    every schedule: the tensor bytes all-reduced, as the runtime counts them."""
    result = plan_json(capsys, TEN_B_512)
    for row in result["communication"]:
        for rank, moved in zip(result["ranks"], row["ranks"]):
            assert moved == {"all_gather": 2 * rank["parameters"], "reduce_scatter": 4 * rank["parameters"],
                             "all_reduce": pytest.approx(rank["parameters"] / 8 * 4)}


def test_hsdp_with_accumulation_streams_k_x_m_microbatches_and_flushes_torch_schedules_k_times(capsys):
    """PP 2 x FSDP 2 x replicas 2 with K = 2 local batches of m = 4 per step: a rank's memory is its
    FSDP group's, 2BW's window holds 8 microbatches and its action list two such windows, and
    1F1B reduces twice per step where 2BW reduces once."""
    common = ("--config", "debug_cpu_pp2_2bw", *sets("parallelism.data_parallel_shard_degree=2"), "--json")
    code, out, err = plan(capsys, *common, "--gpus-per-node", "8", *sets("parallelism.data_parallel_replicate_degree=2",
                                                                          "training.global_batch_size=64"))
    assert code == 0, err
    result = json.loads(out)
    _, out, _ = plan(capsys, *common, "--gpus-per-node", "4")
    alone = json.loads(out)
    layout = result["layout"]
    assert (layout["accumulation_steps"], layout["window"], layout["windows_per_step"]) == (2, 8, 1)
    assert layout["tokens_per_step"] == 2 * alone["layout"]["tokens_per_step"] * 2
    assert [r["memory"] for r in result["ranks"]] == [r["memory"] for r in alone["ranks"]]
    inspected = {r["rank"]: r for r in result["dry_run"]["ranks"]}
    assert sorted(inspected) == [0, 4, 7]
    assert inspected[7]["allocated"] == inspected[4]["allocated"] == alone["dry_run"]["ranks"][1]["allocated"]
    for rank in inspected.values():
        assert rank["action_counts"] == {"F": 16, "B": 16} and rank["ratio"] == pytest.approx(1, abs=0.01)
    windows = {s["name"]: s["window"] for s in result["schedules"]}
    assert windows == {"GPipe": 4, "1F1B": 4, "Interleaved1F1B": 4, "PipeDream2BW": 8, "PACI": 8}
    rows = {row["name"]: row["ranks"] for row in result["communication"]}
    for rank, once, flushed in zip(result["ranks"], rows["PipeDream2BW"], rows["1F1B"]):
        params = rank["parameters"]
        assert once == {"all_gather": 4 * params, "reduce_scatter": 4 * params, "all_reduce": 4 * params / 2}
        assert flushed == {key: 2 * value for key, value in once.items()}


def test_seventy_b_fits_128_gpus_of_80gib_strictly_and_builds_every_pipeline_ranks_stage(capsys):
    """PP 8 x FSDP 2 x TP 8 on 16 nodes: Llama-3-70B's shape, every GPU below 80 GiB, and the first GPU
    of each pipeline rank and the last GPU build their TP + FSDP stage and 2BW action list, each
    holding 1/16 of its stage (TP 8 x FSDP 2) and allocating what the estimate says."""
    result = plan_json(capsys, SEVENTY_B)
    model, layout = result["model"], result["layout"]
    assert (model["dim"], model["n_layers"], model["n_heads"], model["n_kv_heads"], model["vocab_size"]) == (8192, 80, 64, 8, 128256)
    assert 70e9 <= model["parameters"] <= 71e9
    assert (layout["pipeline_parallel"], layout["data_parallel_shard"], layout["tensor_parallel"]) == (8, 2, 8)
    assert layout["sequence_parallel"] and layout["schedule"] == "PipeDream2BW" and layout["float8"] == "rowwise"
    assert result["world_size"] == 128 and result["fits"] and result["peak_bytes"] <= 80 * 2**30
    inspected = {r["rank"]: r for r in result["dry_run"]["ranks"]}
    assert sorted(inspected) == [16 * k for k in range(8)] + [127]
    m = layout["microbatches"]
    for rank in inspected.values():
        stage = rank["pp_rank"]
        warmup = 8 - stage
        assert rank["fsdp_wrapped"] and rank["ratio"] == pytest.approx(1, abs=0.01)
        assert rank["local_parameters"] == pytest.approx(result["ranks"][stage]["parameters"] / 16, rel=0.01)
        assert rank["actions"][:warmup + 1] == [f"{stage}F{k}" for k in range(warmup)] + [f"{stage}B0"]
        assert rank["action_counts"] == {"F": 2 * m, "B": 2 * m}
        assert rank["allocated"]["weight_versions"] == rank["allocated"]["weights"] > 0


def test_seventy_b_block_holds_a_sixteenth_of_its_matrices_and_half_its_norms_per_gpu(capsys):
    """By hand from Llama-3-70B's shapes: TP 8 splits every matrix of a block and leaves its two norm
    weights whole, FSDP 2 halves both; pipeline rank 1 holds 11 blocks (L10-20)."""
    dim, kv_dim, ffn = 8192, 8 * 128, 28672
    matrices = 2 * dim * dim + 2 * kv_dim * dim + 3 * ffn * dim
    per_gpu = matrices // 16 + 2 * dim // 2
    result = plan_json(capsys, SEVENTY_B)
    (rank,) = [r for r in result["dry_run"]["ranks"] if r["rank"] == 16]
    assert result["ranks"][1]["stages"][0]["modules"] == [f"layers.{i}" for i in range(10, 21)]
    assert rank["local_parameters"] == 11 * per_gpu
    assert rank["allocated"]["weights"] == rank["estimate"]["weights"] == 11 * per_gpu * 4


def _tp_plan(capsys) -> dict:
    """debug_cpu_pp2_2bw (PipeDream2BW, Muon + error feedback, float32) as PP 2 x FSDP 2 x TP 2 on 8
    processes (computed once)."""
    if "tp" not in _PLANS:
        code, out, err = plan(capsys, "--config", "debug_cpu_pp2_2bw", "--gpus-per-node", "8", "--json",
                              *sets("parallelism.tensor_parallel_degree=2", "parallelism.data_parallel_shard_degree=2"))
        assert code == 0, err
        _PLANS["tp"] = json.loads(out)
    return _PLANS["tp"]


def test_tp_estimate_equals_the_dry_runs_allocation_per_component(capsys):
    """PP 2 x FSDP 2 x TP 2: weights, the 2BW side shard and gradients to the byte; Muon's momenta,
    AdamW's moments and error feedback's state up to their 0-dim step counters."""
    result = _tp_plan(capsys)
    assert result["warnings"] == [] and result["layout"]["tensor_parallel"] == 2
    inspected = result["dry_run"]["ranks"]
    assert [r["rank"] for r in inspected] == [0, 4, 7]
    for rank in inspected:
        allocated, estimate = rank["allocated"], rank["estimate"]
        assert rank["fsdp_wrapped"]
        for key in ("weights", "weight_versions", "gradients"):
            assert allocated[key] == estimate[key], (rank["rank"], key)
        for key in ("optimizer", "error_feedback"):
            assert 0 <= allocated[key] - estimate[key] <= 1e-4 * estimate[key], (rank["rank"], key)


def test_tp_parameters_per_gpu_by_hand(capsys):
    """debugmodel (dim 256, 8 heads = 8 KV heads, SwiGLU hidden 768, vocabulary 2048, 6 blocks) under
    TP 2 x FSDP 2: a block's 4 attention and 3 FFN matrices are split 4 ways, its 2 norm weights 2
    ways (FSDP only); the embedding and the output head 4 ways, the final norm 2 ways."""
    dim, ffn, vocab = 256, 768, 2048
    block = (4 * dim * dim + 3 * ffn * dim) // 4 + 2 * dim // 2
    first, last = 3 * block + vocab * dim // 4, 3 * block + dim // 2 + vocab * dim // 4
    inspected = {r["rank"]: r for r in _tp_plan(capsys)["dry_run"]["ranks"]}
    assert [inspected[k]["local_parameters"] for k in (0, 4, 7)] == [first, last, last]
    assert [inspected[k]["estimate"]["weights"] for k in (0, 4, 7)] == [4 * first, 4 * last, 4 * last]


def test_tp_communication_is_four_gathers_and_scatters_per_block_each_way_by_hand(capsys):
    """Sequence parallelism moves a (B, L, D) float32 tensor 2 + 2 times per block in forward and 2 + 2
    in backward, once each at the embedding or the output head: 3 x 4 + 1 of each per microbatch
    on either stage, m = 4 microbatches of 2 x 256 tokens per step, for every schedule alike."""
    tensor = 2 * 256 * 256 * 4
    for row in _tp_plan(capsys)["communication"]:
        assert row["tensor_parallel"] == [{"all_gather": 13 * 4 * tensor, "reduce_scatter": 13 * 4 * tensor}] * 2
        assert row["busiest"]["tp_all_gather"] == 13 * 4 * tensor


def test_fsdp_traffic_formula_with_replicas_and_accumulation():
    """n reductions per step (K for torch's schedules, 1 for 2BW, K m / a for PACI), each an
    all-gather (P c), a reduce-scatter (P g) and an all-reduce of the shard (P / f g)."""
    stage = StageShape(index=0, modules=(), params=1000, matrix_params=0, layers=1, largest_unit=1000, last=False)
    hsdp = _setup(fsdp=True, fsdp_degree=2, replicas=2, compute_bytes=2, reduce_bytes=4)
    once = {"all_gather": 2000, "reduce_scatter": 4000, "all_reduce": 2000}
    for schedule, accumulation, n in (("1F1B", None, 3), ("GPipe", None, 3), ("PipeDream2BW", None, 1),
                                      ("PACI", None, 1), ("PACI", 4, 3)):
        moved = fsdp_traffic_bytes(schedule, [stage], hsdp, microbatches=4, accumulation_steps=3, accumulation=accumulation)
        assert moved == {key: n * value for key, value in once.items()}, schedule
    ddp = _setup(fsdp=True, fsdp_degree=1, replicas=2, compute_bytes=2, reduce_bytes=4)
    assert fsdp_traffic_bytes("PipeDream2BW", [stage], ddp, 4) == {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 4000}


def test_ten_b_streaming_schedules_have_no_bubble_and_beat_1f1b(capsys):
    schedules = {s["name"]: s for s in plan_json(capsys, TEN_B)["schedules"]}
    assert schedules["PipeDream2BW"]["selected"] and schedules["PipeDream2BW"]["bubble"] == 0
    assert schedules["1F1B"]["bubble"] == pytest.approx(7 / 39)
    assert schedules["PACI"]["relative_throughput"] == pytest.approx(39 / 32)


def test_uneven_fsdp_shards_are_measured_not_assumed(capsys):
    code, out, _ = plan(capsys, "--config", "debug_cpu", "--gpus-per-node", "3", "--json")
    ranks = json.loads(out)["dry_run"]["ranks"]
    assert code == 0 and [r["rank"] for r in ranks] == [0, 2]
    assert ranks[0]["estimate"] == ranks[1]["estimate"]
    assert ranks[0]["allocated"]["weights"] > ranks[1]["allocated"]["weights"]


def test_tied_weights_are_counted_once_as_training_ties_them(capsys):
    code, out, _ = plan(capsys, "--config", "debug_cpu", *sets("model.weight_tying=yes"), "--json")
    result = json.loads(out)
    (rank,) = result["dry_run"]["ranks"]
    assert code == 0 and rank["local_parameters"] == result["model"]["parameters"] and rank["ratio"] == pytest.approx(1, rel=1e-3)


def test_text_output_has_the_memory_schedule_communication_and_dry_run_tables(capsys):
    code, out, err = plan(capsys, "--config", "debug_cpu_pp2_2bw", "--gpus-per-node", "4", *sets("parallelism.data_parallel_shard_degree=2"))
    assert code == 0 and not err
    for text in ("Memory per GPU", "Schedules (p = 2 stages, m = 4 microbatches", "FSDP, replica and TP communication per step", "Dry run",
                 "estimates only", "rank 2 actions"):
        assert text in out


def test_warns_when_a_rank_does_not_fit_and_strict_exits_1(capsys):
    code, _, err = plan(capsys, "--config", "debug_cpu_pp2", "--gpus-per-node", "2", "--gpu-memory", "1MiB")
    assert code == 0 and "will not fit" in err
    code, _, err = plan(capsys, "--config", str(CONFIGS / "1b_2bw_muon.toml"), "--gpus-per-node", "8", "--gpu-memory", "8GiB", "--strict")
    assert code == 1 and "pipeline rank 0 (GPUs 0-1) needs" in err


@pytest.mark.parametrize(
    "args, named",
    [
        (["--nodes", "0"], "--nodes 0"),
        (["--gpus-per-node", "-2"], "--gpus-per-node -2"),
        (["--gpu-memory", "lots"], "--gpu-memory 'lots'"),
        (["--gpu-memory", "80"], "--gpu-memory '80'"),
        (["--config", "debug_cpu_pp2", "--gpus-per-node", "3"], "parallelism.pipeline_parallel_degree (2)"),
        (["--config", "debug_cpu", *sets("data.tokenizer=/nonexistent")], "data.tokenizer = '/nonexistent'"),
        (["--config", "debug_cpu", *sets("parallelism.pipeline_parallel_schedule=2BW")], "parallelism.pipeline_parallel_schedule = '2BW'"),
    ],
)
def test_bad_input_is_one_line_naming_the_argument_with_status_2(args, named, capsys):
    code, _, err = plan(capsys, *args)
    assert code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("titan-async: ")
    assert named in err


def test_world_size_error_names_the_cluster_arguments(capsys):
    _, _, err = plan(capsys, "--config", "debug_cpu_pp2", "--nodes", "1", "--gpus-per-node", "3")
    assert "--nodes 1 x --gpus-per-node 3 = 3 GPUs" in err


def test_bubble_formulas():
    assert bubble("1F1B", 2, 4) == pytest.approx(0.2)
    assert bubble("GPipe", 4, 8) == pytest.approx(3 / 11)
    assert bubble("1F1B", 8, 8) == pytest.approx(7 / 15)
    assert bubble("Interleaved1F1B", 8, 8) == pytest.approx(7 / 23)
    assert bubble("PACI", 8, 8) == bubble("PipeDream2BW", 8, 8) == 0
    ratios = {s["name"]: s["relative_throughput"] for s in compare_schedules(8, 8)}
    assert ratios["1F1B"] == 1 and ratios["PipeDream2BW"] == pytest.approx(15 / 8)


def test_held_microbatches():
    assert [held_microbatches("1F1B", s, 4, 8, 1) for s in range(4)] == [4, 3, 2, 1]
    assert [held_microbatches("PipeDream2BW", s, 4, 2, 1) for s in range(4)] == [2, 2, 2, 1]
    assert held_microbatches("GPipe", 0, 4, 8, 1) == 8
    assert held_microbatches("Interleaved1F1B", 0, 4, 8, 2) == 11


def test_parse_size():
    assert parse_size("80GiB") == 80 * 2**30
    assert parse_size("141 GB") == 141 * 10**9
    assert parse_size("1.5tib") == int(1.5 * 2**40)
    for bad in ("80", "lots", "0GiB", "-1GiB", "80 GiBs"):
        with pytest.raises(ValueError):
            parse_size(bad)


def saved_block_bytes(model, seq: int, dim: int, dtype: torch.dtype) -> int:
    """Bytes of the tensors autograd saves in `model`'s first block for one sequence of `seq`
    tokens, weights and the dense CPU attention's seq x seq mask (GPUs keep none) left out."""
    positions = torch.arange(seq).unsqueeze(0)
    masks = model.get_attention_masks(positions)
    x = torch.randn(1, seq, dim, dtype=dtype, requires_grad=True)
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.shape[-3:] != (1, seq, seq):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.layers["0"](x, attention_masks=masks, positions=positions)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in saved.items() if ptr not in weights)


@pytest.mark.filterwarnings("ignore:Casting complex values")
@pytest.mark.parametrize("mode", ["none", "full"])
def test_block_activation_formula_matches_what_autograd_saves(mode):
    """Selective checkpointing keeps its saves out of saved-tensor hooks, so only none and full."""
    dim, kv_dim, ffn_dim, seq = 256, 128, 512, 96
    sizes = {"dim": dim, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2, "multiple_of": 256, "ffn_dim_multiplier": 0.75}
    run = build_run_config({"model": {**sizes, "vocab_size": 512}}, "test")
    model = build_meta_model(run, 512, fsdp=False).spec.model.build()
    model.init_weights(buffer_device=None)
    model = model.to(torch.bfloat16)
    if mode == "full":
        FullAC.Config().build().apply(model)
    measured = saved_block_bytes(model, seq, dim, torch.bfloat16)
    setup = _setup(mode, dim=dim, kv_dim=kv_dim, ffn_dim=ffn_dim, tokens=seq, param_bytes=2, compute_bytes=2,
                   optimizer="adamw", error_feedback=False)
    assert measured == pytest.approx(seq * block_activation_bytes(setup), rel=0.03)


def _setup(mode: str = "none", **sizes) -> Setup:
    """A float32 setup without FSDP, for the formulas that a single process can check."""
    fields = dict(dim=256, kv_dim=128, ffn_dim=512, vocab_size=512, tokens=96, param_bytes=4, compute_bytes=4,
                  reduce_bytes=4, weight_shards=1, fsdp=False, fsdp_degree=1, unsharded_for_step=False, version_copies=0,
                  gathered_versions=0, optimizer="muon", error_feedback=True, activation_checkpoint=mode, ns_dtype="float32")
    return Setup(**{**fields, **sizes})


def test_muon_step_scratch_formula_matches_the_tensor_bytes_a_step_allocates():
    """Nesterov momenta, the Q, K and V blocks copied out of each fused matrix, the Newton-Schulz
    stacks (standard form for the square blocks, Gram form for the wide ones) and the updates."""
    run = build_run_config({"model": {"dim": 128, "n_layers": 2, "n_heads": 4, "vocab_size": 512}}, "test")
    tracker = bench_memory.live_tensor_tracker()
    with tracker:
        model = build_meta_model(run, 512, fsdp=False).spec.model.build()
        model.to_empty(device="cpu")
        routes = [r for r in route_parameters(model) if r.optimizer == "muon"]
        group = {"params": [r.param for r in routes], "param_names": [r.name for r in routes]}
        optimizer = ErrorFeedback(Muon([group], lr=0.02, ns_dtype="float32", blocks={r.name: r.blocks for r in routes}))
        for _ in range(2):  # the second step finds every buffer of the state in place
            for route in routes:
                route.param.grad = torch.randn_like(route.param)
            before = tracker.current
            tracker.peak = before
            optimizer.step()
    matrices = tuple(MuonMatrix(tuple(r.param.shape), tuple(r.blocks.shapes(tuple(r.param.shape)))) for r in routes)
    predicted = muon_step_bytes(matrices, sum(m.elements for m in matrices), _setup())
    assert predicted == pytest.approx(tracker.peak - before, rel=0.01)


def test_plan_memory_is_within_10_percent_of_the_peak_a_2bw_muon_run_keeps_alive():
    """Two processes train PipeDream2BW with Muon and error feedback (tools/bench_plan_memory.py), on a
    model whose optimizer step is the peak: plan's peak per pipeline rank, as CPU processes, against
    the bytes of the tensors each process keeps alive at its peak."""
    settings = sets("model.dim=256", "model.n_layers=4", "model.n_heads=4", "training.seq_len=32",
                    "training.local_batch_size=2", "parallelism.pipeline_parallel_microbatch_size=1", "training.steps=3")
    command = [sys.executable, "tools/bench_plan_memory.py", "--config", "debug_cpu_pp2_2bw", "--nproc", "2", *settings, "--json"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600, env=fresh_environment())
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = json.loads(result.stdout)["ranks"]
    assert [r["pp_rank"] for r in ranks] == [0, 1]
    for rank in ranks:
        assert rank["components"]["optimizer_step"] > rank["components"]["activations"]
        assert abs(rank["predicted_bytes"] / rank["measured_bytes"] - 1) <= 0.10, rank
