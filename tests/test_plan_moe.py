"""`titan-async plan` for mixture-of-experts models (model.family = "qwen3_moe"): the 10B MoE
config, the estimate against the dry run, active parameters, simulated costs and activations by
hand, refusals."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import CONFIGS, cli_in_process, sets
from test_plan import saved_block_bytes
from titan_async.cluster.memory import Setup, block_activation_bytes, expert_weight_copy_bytes
from titan_async.config.run_config import build_run_config
from titan_async.model.meta import build_meta_model

pytestmark = pytest.mark.filterwarnings("ignore:DTensor random operators", "ignore:In CPU autocast")
TEN_B_MOE = CONFIGS / "10b_moe_2bw_muon.toml"
MOE = ("model.family=qwen3_moe", "model.num_experts=8", "model.top_k=2", "model.moe_hidden_dim=64",
       "model.load_balance_coeff=0.01", "parallelism.pipeline_parallel_microbatch_size=2", "training.local_batch_size=8")
TWO_BW_MUON_EF = ("parallelism.pipeline_parallel_schedule=PipeDream2BW", "optimizer.name=muon",
                  "optimizer.error_feedback.enabled=true")
_PLANS: dict[str, dict] = {}


def plan(capsys, *args: str) -> tuple[int, str, str]:
    return cli_in_process(capsys, "plan", *args)


def ten_b_moe(capsys) -> dict:
    """The 10B MoE config's --strict --json plan on 8 nodes of 8 GPUs of 80 GiB (computed once)."""
    if "10b" not in _PLANS:
        code, out, err = plan(capsys, "--config", str(TEN_B_MOE), "--nodes", "8", "--gpus-per-node", "8",
                              "--gpu-memory", "80GiB", "--strict", "--json")
        assert code == 0, err
        _PLANS["10b"] = json.loads(out)
    return _PLANS["10b"]


def small_moe(capsys, config: str, gpus: int, *extra: str) -> dict:
    """debug `config` as a qwen3_moe model (8 experts, top-2) under PipeDream2BW with Muon + error
    feedback on `gpus` processes, with `extra` settings (computed once per layout)."""
    key = f"{config}-{gpus}-{extra}"
    if key not in _PLANS:
        code, out, err = plan(capsys, "--config", config, "--gpus-per-node", str(gpus), "--json", *sets(*MOE, *TWO_BW_MUON_EF, *extra))
        assert code == 0, err
        _PLANS[key] = json.loads(out)
    return _PLANS[key]


def test_ten_b_moe_fits_64_gpus_of_80gib_strictly(capsys):
    result = ten_b_moe(capsys)
    model, layout = result["model"], result["layout"]
    assert model["family"] == "qwen3_moe" and 9.5e9 <= model["parameters"] <= 10.5e9
    assert (layout["pipeline_parallel"], layout["data_parallel_shard"], layout["schedule"]) == (8, 8, "PipeDream2BW")
    assert layout["optimizer"] == "muon" and layout["error_feedback"] and layout["compute_dtype"] == "bfloat16"
    assert result["world_size"] == 64 and result["fits"] and result["peak_bytes"] <= 80 * 2**30
    assert result["warnings"] == []
    moe = result["mixture_of_experts"]
    assert (moe["num_experts"], moe["top_k"], moe["expert_parallel"], moe["all_to_all_bytes"]) == (64, 8, 1, 0)
    assert sum(r["memory"]["expert_weights"] for r in result["ranks"][:7]) > 0


def test_ten_b_moe_dry_run_allocates_what_the_estimate_says_experts_included(capsys):
    """Every inspected GPU builds its stage with FSDP2 on meta: weights, expert weights, the 2BW side
    shard with the expert biases and gradients to the byte; optimizer and error feedback up to
    their step counters; each GPU holds 1/8 of its stage."""
    result = ten_b_moe(capsys)
    inspected = {r["rank"]: r for r in result["dry_run"]["ranks"]}
    assert sorted(inspected) == [8 * k for k in range(8)] + [63]
    for rank in inspected.values():
        allocated, estimate = rank["allocated"], rank["estimate"]
        assert rank["fsdp_wrapped"]
        assert rank["local_parameters"] == pytest.approx(result["ranks"][rank["pp_rank"]]["parameters"] / 8, rel=0.01)
        for key in ("weights", "expert_weights", "weight_versions", "gradients"):
            assert allocated[key] == estimate[key], (rank["rank"], key)
        for key in ("optimizer", "error_feedback"):
            assert 0 <= allocated[key] - estimate[key] <= 1e-4 * estimate[key], (rank["rank"], key)
    assert inspected[8]["allocated"]["expert_weights"] > 20 * inspected[8]["allocated"]["weights"]


def test_ten_b_moe_newton_schulz_per_expert_matrix_batched_per_shape(capsys):
    """Pipeline rank 1 holds 4 blocks: 4 x 64 experts x (w1, w3: 768 x 2560; w2: 2560 x 768), one stack per shape."""
    rank = ten_b_moe(capsys)["mixture_of_experts"]["ranks"][1]
    stacks = {(s["rows"], s["cols"]): s["matrices"] for s in rank["newton_schulz"]["stacks"]}
    assert stacks == {(768, 2560): 4 * 64 * 2, (2560, 768): 4 * 64}
    per_matrix = {s["flops_each"] for s in rank["newton_schulz"]["stacks"]}
    assert len(per_matrix) == 1 and rank["newton_schulz"]["busiest_owner_flops"] >= 4 * 3 * 64 * per_matrix.pop() / 8


@pytest.mark.parametrize("config, gpus, extra", [("debug_cpu_pp2_fsdp2", 4, ()), ("debug_cpu_pp2", 2, ()),
                                                 ("debug_cpu_pp2_fsdp2", 4, ("parallelism.expert_parallel_degree=2",)),
                                                 ("debug_cpu_pp2_fsdp2", 8, ("parallelism.expert_parallel_degree=2",
                                                                             "parallelism.data_parallel_replicate_degree=2"))],
                         ids=["fsdp2", "plain", "fsdp2-ep2", "hsdp-ep2"])
def test_small_moe_estimate_equals_the_dry_runs_allocation_per_component(config, gpus, extra, capsys):
    """PP 2 x FSDP 2 (FSDP2's side shard), PP 2 alone (plain parameters, both versions whole),
    PP 2 x EP 2 (each rank 4 whole experts, the dense weights FSDP-sharded, built as the trainer
    builds it) and the same with 2 replicas of each stage (HSDP x EP, 8 GPUs): weights, expert
    weights, the second version with the expert biases and gradients to the byte; Muon's momenta,
    AdamW's moments and error feedback's state up to their 0-dim step counters."""
    result = small_moe(capsys, config, gpus, *extra)
    assert result["warnings"] == []
    inspected = result["dry_run"]["ranks"]
    assert [r["pp_rank"] for r in inspected][0] == 0 and inspected[-1]["pp_rank"] == 1
    biases = 3 * 8 * 4  # 3 blocks per stage, 8 float32 expert biases each
    for rank in inspected:
        allocated, estimate = rank["allocated"], rank["estimate"]
        assert rank["fsdp_wrapped"] == (config == "debug_cpu_pp2_fsdp2")
        for key in ("weights", "expert_weights", "weight_versions", "gradients"):
            assert allocated[key] == estimate[key], (rank["rank"], key)
        assert allocated["weight_versions"] == allocated["weights"] + allocated["expert_weights"] + biases
        for key in ("optimizer", "error_feedback"):
            assert 0 <= allocated[key] - estimate[key] <= 1e-4 * estimate[key], (rank["rank"], key)


def test_active_and_total_parameters_by_hand(capsys):
    """debug_cpu_pp2_fsdp2's sizes (dim 256, 6 blocks, 8 heads = 8 KV heads, vocabulary 2048) with 8
    experts of hidden 64, top-2: a block has its fused QKV and output projections, 2 norms, the
    QK norms (head dim), the router gate and 3 expert tensors; a token computes with 2 / 8 of them."""
    dim, layers, head_dim, vocab, experts, top_k, hidden = 256, 6, 32, 2048, 8, 2, 64
    expert_weights = 3 * experts * hidden * dim
    block = dim * 3 * dim + dim * dim + 2 * dim + 2 * head_dim + experts * dim + expert_weights
    total = 2 * vocab * dim + dim + layers * block
    active = total - layers * expert_weights * (1 - top_k / experts)
    result = small_moe(capsys, "debug_cpu_pp2_fsdp2", 4)
    model = result["model"]
    assert (model["parameters"], model["active_parameters"], model["expert_parameters"]) == (total, active, layers * expert_weights)
    assert model["active_parameters"] / model["parameters"] == pytest.approx(active / total)
    assert active < total
    ranks = result["mixture_of_experts"]["ranks"]
    assert sum(r["active_parameters"] for r in ranks) == active and sum(r["parameters"] for r in ranks) == total


def test_text_output_has_the_expert_column_the_moe_table_and_the_all_to_all_line(capsys):
    code, out, err = plan(capsys, "--config", "debug_cpu_pp2_fsdp2", "--gpus-per-node", "4", *sets(*MOE, *TWO_BW_MUON_EF))
    assert code == 0 and not err
    for text in ("active per token", "experts", "Mixture of experts (8 experts, top-2", "all-to-all: 0 bytes per step",
                 "expert_parallel_degree = 1"):
        assert text in out


def test_tensor_parallel_moe_is_refused_in_one_line_naming_the_key(capsys):
    """plan does not estimate TP with MoE yet: one line, status 2."""
    code, _, err = plan(capsys, "--config", "debug_cpu", "--gpus-per-node", "2", *sets(*MOE, "parallelism.tensor_parallel_degree=2"))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "parallelism.tensor_parallel_degree = 2" in err


def test_expert_parallel_moe_reports_its_all_to_all_bytes(capsys):
    """EP 2 on PP 2 x FSDP 2: dim 256, microbatches of 2 x 256 tokens, top-2, 3 blocks per rank,
    float32, 4 microbatches: 3 x 4 x 4 passes x (512 x 2 x 256 x 4 bytes) x 1/2 (the text output's line and column too)."""
    code, out, err = plan(capsys, "--config", "debug_cpu_pp2_fsdp2", "--gpus-per-node", "4", "--json",
                          *sets(*MOE, *TWO_BW_MUON_EF, "parallelism.expert_parallel_degree=2"))
    assert code == 0, err
    moe = json.loads(out)["mixture_of_experts"]
    expected = 3 * 4 * 4 * (512 * 2 * 256 * 4) // 2
    assert moe["expert_parallel"] == 2 and moe["all_to_all_bytes"] == expected
    assert [r["all_to_all_bytes"] for r in moe["ranks"]] == [expected, expected]
    code, out, err = plan(capsys, "--config", "debug_cpu_pp2_fsdp2", "--gpus-per-node", "4",
                          *sets(*MOE, *TWO_BW_MUON_EF, "parallelism.expert_parallel_degree=2"))
    assert code == 0 and "all-to-all/step" in out and f"all-to-all: {expected / 1e9:.3f} GB per step" in out


def test_simulate_costs_count_the_active_experts_by_hand(capsys):
    """plan --simulate on a qwen3_moe PP 2 (3 blocks per rank, microbatches of 2 x 256 tokens):
    each rank's forward is 2 x its active matmul weights x tokens plus causal attention,
    2 x blocks x tokens x seq_len x dim, at the default MFU 0.4 of 989 TFLOP/s. Active weights
    by hand, per block: wqkv 256 x 768, wo 256 x 256, the router 8 x 256, and 2 of the 8 experts'
    3 x 64 x 256; the last rank adds the 2048 x 256 output head (the embedding is a lookup)."""
    code, out, err = plan(capsys, "--config", "debug_cpu_pp2", "--gpus-per-node", "2", "--simulate", "--json",
                          *sets(*MOE, "training.seq_len=256"))
    assert code == 0, err
    simulation = json.loads(out)["simulation"]
    tokens, seq, dim, blocks = 2 * 256, 256, 256, 3
    block = 256 * 768 + 256 * 256 + 8 * 256 + 2 * 3 * 64 * 256
    active = [blocks * block, blocks * block + 2048 * 256]
    expected = [(2 * a * tokens + 2 * blocks * tokens * seq * dim) / (0.4 * 989e12) for a in active]
    assert simulation["costs"]["forward"] == pytest.approx(expected, rel=1e-9)
    ratios = {row["name"]: row["vs_1f1b"] for row in simulation["schedules"]}
    assert ratios["PipeDream2BW"] > 1.0 and ratios["1F1B"] == 1.0


@pytest.mark.parametrize("dtype, precision", [(torch.bfloat16, "bfloat16"), (torch.float32, "bfloat16"), (torch.float32, "full")],
                         ids=["bfloat16", "float32", "float32-full-precision-experts"])
def test_moe_block_activation_formula_matches_what_autograd_saves(dtype, precision):
    """One qwen3_moe block (4 heads of 2 KV heads, 16 experts of hidden 128, top-4) on CPU: the tensors
    autograd saves, besides the dense CPU attention's seq x seq mask, against the formula for CPU
    processes (no autocast), with float32's bfloat16 copies of the expert weights per microbatch
    unless the experts multiply in float32 too (`model.expert_precision = "full"`)."""
    dim, heads, kv_heads, experts, top_k, hidden, seq = 256, 8, 4, 16, 4, 128, 96
    sizes = {"family": "qwen3_moe", "dim": dim, "n_layers": 1, "n_heads": heads, "n_kv_heads": kv_heads,
             "num_experts": experts, "top_k": top_k, "moe_hidden_dim": hidden, "vocab_size": 512,
             "expert_precision": precision}
    run = build_run_config({"model": sizes}, "test")
    model = build_meta_model(run, 512, fsdp=False).spec.model.build()
    model.to_empty(device="cpu")
    model.init_weights(buffer_device=None)
    model = model.to(dtype)
    measured = saved_block_bytes(model, seq, dim, dtype)
    c = dtype.itemsize
    setup = Setup(dim=dim, kv_dim=kv_heads * dim // heads, ffn_dim=0, vocab_size=512, tokens=seq, param_bytes=c,
                  compute_bytes=c, reduce_bytes=c, weight_shards=1, fsdp=False, fsdp_degree=1, unsharded_for_step=False,
                  version_copies=0, gathered_versions=0, optimizer="muon", error_feedback=False,
                  activation_checkpoint="none", gpu=False, num_experts=experts, top_k=top_k, moe_hidden_dim=hidden,
                  expert_bytes=2 if precision == "bfloat16" else c)
    predicted = seq * block_activation_bytes(setup) + expert_weight_copy_bytes(setup)
    assert predicted == pytest.approx(measured, rel=0.03)
