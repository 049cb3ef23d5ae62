"""Mixture-of-experts models (model.family = "qwen3_moe") under PipeDream2BW and PACI.

The expert biases move where each stage steps, from the counts of exactly the microbatches
whose gradient that step applies, and 2BW keeps them in its weight versions. PipeDream2BW and
PACI on PP 2 (test_independent_reference.py), PipeDream2BW on PP 2 x FSDP 2, PipeDream2BW
(Muon, error feedback) and PACI (AdamW, clipping) on PP 2 x EP 2 (here) are compared with the
independent reference (independent_reference.py); this file also holds the runs' other
properties (resume, all-to-all bytes, export, layouts refused). The PP 2 runs here keep validation and clipping off
and a larger `load_balance_coeff`, so that the biases change routing within the run.
"""

from __future__ import annotations

import json
import math
import statistics

import pytest
import torch
import torch.nn.functional as F
import transformers
from torchtitan.models.common.moe import GroupedExperts

import independent_reference as ref
import nccl_model
from conftest import CONFIGS, TINY, cli_in_process, metrics, run_cli, sets
from test_fsdp_schedules import stage_records, train
from test_benchmark_eval import OFFLINE, TASK, reference, write_task
from test_hf_export import export_cli, hf_logits, loaders, titan_model
from test_independent_reference import MOE as REFERENCE_MOE, SETTINGS as REFERENCE_SETTINGS, STEPS as REFERENCE_STEPS
from test_independent_reference import (INJECTED, SKIPPED, assert_different, assert_equal_with_resharded_norms, differences,
                                        pipelined, reference_inputs)
from test_schedules import final_weights
from test_tensor_parallel import assert_resumes_exactly
from titan_async.model.qwen3_moe import FullPrecisionExperts

PP2 = ("--config", str(CONFIGS / "debug_cpu_pp2.toml"), "--nproc-per-node", "2")
MOE = ("model.family=qwen3_moe", "model.num_experts=8", "model.top_k=2", "model.moe_hidden_dim=64",
       "model.load_balance_coeff=0.01", "training.max_norm=1000", "parallelism.pipeline_parallel_microbatch_size=2",
       "validation.enable=false", "training.local_batch_size=8")
PACI = ("parallelism.pipeline_parallel_schedule=PACI", "parallelism.paci.accumulation=2")
FSDP2 = ("--config", str(CONFIGS / "debug_cpu_fsdp2.toml"), "--nproc-per-node", "2")
PP2_EP2 = ("--config", str(CONFIGS / "debug_cpu_pp2_fsdp2.toml"), "--nproc-per-node", "4")
EP2 = ("parallelism.data_parallel_shard_degree=2", "parallelism.expert_parallel_degree=2")
MUON_EF = ("optimizer.name=muon", "optimizer.lr=0.02", "optimizer.error_feedback.enabled=true")
EP_PACI = ("parallelism.pipeline_parallel_schedule=PACI", "parallelism.paci.accumulation=3", "model.expert_precision=full")
"""PACI a = 3 of m = 4 per data rank, experts in float32 (see test_paci_moe_with_expert_parallel_equals_the_independent_reference)."""


@pytest.fixture(scope="module")
def two_bw(tmp_path_factory):
    return train(tmp_path_factory.mktemp("moe_2bw") / "2bw", *MOE, "parallelism.pipeline_parallel_schedule=PipeDream2BW", layout=PP2)


@pytest.fixture(scope="module")
def paci(tmp_path_factory):
    return train(tmp_path_factory.mktemp("moe_paci") / "paci", *MOE, *PACI, layout=PP2)


@pytest.fixture(scope="module")
def ep_2bw(tmp_path_factory):
    """A PP 2 x EP 2 PipeDream2BW run, Muon + error feedback, experts in float32, with
    test_independent_reference.py's settings and logs (batches, communication), where rank 3
    alone (stage 1's second EP rank) finds a non-finite gradient at step 3 (`SKIPPED`)."""
    root = tmp_path_factory.mktemp("moe_ep_2bw")
    return pipelined(root / "2bw", *REFERENCE_MOE, *MUON_EF, *EP2, "model.expert_precision=full",
                     "parallelism.pipeline_parallel_schedule=PipeDream2BW", *INJECTED,
                     config="debug_cpu_pp2_fsdp2.toml", nproc=4)



@pytest.fixture(scope="module")
def ep_paci(tmp_path_factory):
    """A PP 2 x EP 2 PACI run, AdamW, every stage clipping its gradient, experts in float32, with
    test_independent_reference.py's settings and logs (batches, communication)."""
    root = tmp_path_factory.mktemp("moe_ep_paci")
    return pipelined(root / "paci", *REFERENCE_MOE, *EP2, *EP_PACI, config="debug_cpu_pp2_fsdp2.toml", nproc=4)


def test_full_precision_experts_run_each_experts_swiglu_in_the_models_dtype():
    """`model.expert_precision = "full"`: each expert's w2(silu(w1 x) * w3 x) on its own tokens,
    against a loop of float64 matmuls (an expert with no tokens included): within 1e-6 in float32,
    where torchtitan's bfloat16 experts are 1e-3 away."""
    torch.manual_seed(0)
    counts = torch.tensor([3, 0, 5, 2])
    full = FullPrecisionExperts.Config(dim=32, hidden_dim=16, num_experts=4).build()
    for weight in full.parameters():
        torch.nn.init.normal_(weight, std=0.3)
    tokens = torch.randn(int(counts.sum()), 32)
    expected = torch.cat([
        F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)
        for x, w1, w2, w3 in zip(tokens.double().split(counts.tolist()), full.w1_EFD.double(), full.w2_EDF.double(), full.w3_EFD.double())
    ])
    assert (full(tokens, counts).double() - expected).abs().max() < 1e-6 * expected.abs().max()
    bfloat16 = GroupedExperts.Config(dim=32, hidden_dim=16, num_experts=4).build()
    bfloat16.load_state_dict(full.state_dict())
    assert (bfloat16(tokens, counts).double() - expected).abs().max() > 1e-3 * expected.abs().max()


def expert_biases(run) -> dict:
    return {k: v for k, v in final_weights(run).items() if k.endswith("expert_bias_E")}


@pytest.mark.parametrize("runs", ["two_bw", "paci"])
def test_moe_streaming_runs_move_the_biases_and_keep_nccls_rules(runs, request):
    run = request.getfixturevalue(runs)
    biases = expert_biases(run)
    assert len(biases) == 4 and all(bias.abs().max() > 0 for bias in biases.values())
    nccl_model.assert_nccl_safe(run / "comm", stages=2)


def test_2bw_moe_with_fsdp_equals_the_independent_reference(tmp_path):
    """PP 2 x FSDP 2 (4 processes), PipeDream2BW, experts in float32 and sharded by FSDP, against
    `ref.two_bw` on both data ranks' batches joined: the biases are versioned beside 2BW's side
    shards, and each stage moves them by the counts summed over its data ranks. Checkpoints at
    steps 2 and 4, where the biases' live version is not the tensor the model state held at the
    start, must save without touching the other version. Controls: the biases moved by the next
    batch's counts, and data rank 0's batches alone. Gradient norms at 1e-4 as under FSDP
    (`assert_equal_with_resharded_norms`). Measured: losses 3.1e-8, gradient norms 4.9e-6,
    weights 8.5e-7."""
    run = pipelined(tmp_path / "2bw", *REFERENCE_MOE, "model.expert_precision=full", "parallelism.pipeline_parallel_schedule=PipeDream2BW",
                    "checkpoint.interval=2", config="debug_cpu_pp2_fsdp2.toml", nproc=4)
    settings, batches, weights = reference_inputs(run)
    assert settings.data_ranks == 2 and settings.expert_ranks == 1 and settings.family == "qwen3_moe"
    assert all(weights[k].abs().max() > 0 for k in weights if k.endswith("expert_bias_E"))
    update_of_step = lambda step: step
    assert_equal_with_resharded_norms(differences(run, weights, ref.two_bw(settings, batches), update_of_step))
    assert_different(differences(run, weights, ref.two_bw(settings, batches, bias_counts="next"), update_of_step))
    one_rank = ref.read_batches(run / "batches", settings, data_ranks=[0])
    assert_different(differences(run, weights, ref.two_bw(settings, one_rank), update_of_step))
    nccl_model.assert_nccl_safe(run / "comm", stages=2, ranks_per_stage=2)


def assert_all_to_all_in_the_log(run) -> None:
    """Every rank issued the token all-to-alls (counts, dispatch, combine, forward and backward)
    on a group of its stage's two ranks, and the NCCL model completes the whole log."""
    logs = nccl_model.read_logs(run / "comm")
    for rank, records in logs.items():
        groups = {r["group"]: r["ranks"] for r in records if r["op"] == "group"}
        pair = [rank - rank % 2, rank - rank % 2 + 1]
        exchanges = [r for r in records if r.get("kind") == "all_to_all_single"]
        assert exchanges and all(sorted(groups[r["group"]]) == pair for r in exchanges), rank
    nccl_model.assert_nccl_safe(run / "comm", stages=2, ranks_per_stage=2)


def test_2bw_moe_with_expert_parallel_and_muon_equals_the_independent_reference(ep_2bw):
    """PP 2 x EP 2 (4 processes; each stage's 2 data ranks hold 4 of the 8 experts and exchange
    tokens by all-to-all), PipeDream2BW with Muon (each expert's matrix orthogonalised on its
    own) and error feedback, against `ref.two_bw` (independent_reference.py) on both data ranks'
    batches joined, the biases moved by the counts summed over them. Controls: data rank 0's
    batches alone, the biases moved by the next batch's counts, and no update skipped: at step 3
    only rank 3 poisons its gradient, and both EP ranks of stage 1 must skip the update on the
    device (experts sharded by EP, dense weights by FSDP). Every rank's all-to-alls are in the
    log, which the NCCL model completes.

    The experts multiply in float32 (`model.expert_precision = "full"`, `ref.Float32Experts`):
    in torchtitan's bfloat16 an EP rank rounds an expert's weight gradient once over both data
    ranks' tokens, and float32 rounding differences elsewhere (each data rank's dense gradient
    apart, then summed under FSDP) move values across bfloat16 rounding boundaries, which the
    optimizer's normalisation grows: measured with AdamW, 1.6e-4 apart on an expert stack after
    6 steps even with the data ranks' i-th microbatches forwarded together as EP does (4.1e-3
    forwarded apart), losses within 1.1e-7. In float32: losses 3.2e-8 and weights 2.1e-6
    apart; gradient norms 4.9e-6, given 1e-4 as under FSDP (`assert_equal_with_resharded_norms`)."""
    settings, batches, weights = reference_inputs(ep_2bw)
    assert settings.expert_ranks == settings.data_ranks == 2 and settings.expert_precision == "full"
    assert settings.optimizer == "muon" and settings.error_feedback == 1.0
    update_of_step = lambda step: step
    assert_equal_with_resharded_norms(differences(ep_2bw, weights, ref.two_bw(settings, batches, skipped=SKIPPED), update_of_step))
    one_rank = ref.read_batches(ep_2bw / "batches", settings, data_ranks=[0])
    assert_different(differences(ep_2bw, weights, ref.two_bw(settings, one_rank, skipped=SKIPPED), update_of_step))
    assert_different(differences(ep_2bw, weights, ref.two_bw(settings, batches, bias_counts="next", skipped=SKIPPED), update_of_step))
    assert_different(differences(ep_2bw, weights, ref.two_bw(settings, batches), update_of_step))
    assert_all_to_all_in_the_log(ep_2bw)


def test_paci_moe_with_expert_parallel_equals_the_independent_reference(ep_paci):
    """PP 2 x EP 2 (4 processes) PACI, a = 3 of m = 4 microbatches per data rank, AdamW, each
    stage clipping its gradient (max_norm 0.1), against `ref.paci` with the data ranks' i-th
    microbatches side by side (a local step reduces over both data ranks; their tokens meet in
    the experts), the biases moved by the counts of exactly the applied microbatches summed over
    the data ranks. Controls: one backward late, data rank 0's batches alone, and the biases
    moved by the routing at the backward's weights. Every rank's all-to-alls are in the log,
    which the NCCL model completes.

    The experts multiply in float32 (`model.expert_precision = "full"`): torchtitan's bfloat16
    experts save bfloat16 copies of their weights in the forward, so a backward that crossed a
    local step would read the forward's experts, not PACI's current weights, and EP rounds an
    expert's gradient once over both data ranks' tokens. Gradient norms get 1e-4 as under FSDP
    (`assert_equal_with_resharded_norms`). Measured: losses 6.5e-8, gradient norms 4.4e-6,
    weights 1.5e-6."""
    a, m = 3, 4
    settings, batches, weights = reference_inputs(ep_paci)
    assert settings.expert_ranks == settings.data_ranks == 2 and settings.expert_precision == "full"
    assert settings.optimizer == "adamw" and settings.microbatches == m and settings.accumulation == a
    drains, joined = ref.drain_steps(ep_paci), ref.side_by_side(batches, settings.data_ranks)
    update_of_step = lambda step: step * m // a
    assert_equal_with_resharded_norms(differences(ep_paci, weights, ref.paci(settings, joined, drains), update_of_step))
    assert_different(differences(ep_paci, weights, ref.paci(settings, joined, drains, late=1), update_of_step))
    one_rank = ref.read_batches(ep_paci / "batches", settings, data_ranks=[0])
    assert_different(differences(ep_paci, weights, ref.paci(settings, one_rank, drains), update_of_step))
    recounted = differences(ep_paci, weights, ref.paci(settings, joined, drains, bias_counts="backward"), update_of_step)
    print("control:", recounted)  # measured: losses 1.4e-4, biases and weights 0.55 apart
    assert recounted["weights"] > 1e-2, recounted
    assert_all_to_all_in_the_log(ep_paci)


def hsdp_ep_all_reduce_bytes(stage: int) -> int:
    """The float32 gradient bytes one rank of pipeline rank `stage` all-reduces across the replicas
    per update under PP 2 x replicas 2 x FSDP 2 x EP 2 with TINY's sizes (dim 64, 4 blocks, 4
    heads = 4 KV heads), vocabulary 2048 and 8 experts of hidden 64: half its stage's dense weights
    (FSDP 2; every dim-0 is even, so nothing is padded) and, whole, the 4 experts of each of its 2
    blocks that it holds (EP 2 leaves one expert-FSDP rank). A block's dense weights are its fused
    QKV and output projections, 2 norms, the QK norms (head dim) and the router gate; stage 0
    adds the embedding, stage 1 the final norm and the output head."""
    dim, head_dim, vocab, experts, hidden, blocks = 64, 16, 2048, 8, 64, 2
    block = dim * 3 * dim + dim * dim + 2 * dim + 2 * head_dim + experts * dim
    dense = blocks * block + vocab * dim + (dim if stage == 1 else 0)
    held_experts = blocks * (experts // 2) * 3 * hidden * dim
    return 4 * (dense // 2 + held_experts)


def test_2bw_moe_with_hsdp_and_expert_parallel_all_reduces_dense_and_expert_shards_across_replicas(tmp_path):
    """PP 2 x replicas 2 x FSDP 2 x EP 2 (8 processes): an MoE block is one FSDP unit with two
    parameter groups (the dense weights on the replicate x shard mesh, the experts on the
    replicate x expert-FSDP mesh), each all-reducing its reduced shard across the replicas. The
    run trains 3 steps with finite losses, and each stage's first rank (0 and 4, which write the
    stages' scalars) counts the bytes of both groups' all-reduces once per update (under 2BW stage 0
    reduces its last update in the drain, so the steps' sum is compared)."""
    steps = 3
    run_dir = tmp_path / "run"
    run_cli("train", *PP2_EP2[:2], "--nproc-per-node", "8", "--run-dir", str(run_dir),
            *sets(*TINY, *MOE, "parallelism.pipeline_parallel_schedule=PipeDream2BW", *EP2,
                  "parallelism.data_parallel_replicate_degree=2", f"training.steps={steps}", "checkpoint.enable=false"))
    losses = {step: row["loss_metrics/global_avg_loss"] for step, row in metrics(run_dir).items()}
    assert sorted(losses) == list(range(1, steps + 1)) and all(math.isfinite(loss) for loss in losses.values()), losses
    records = stage_records(run_dir)
    assert sorted(records) == [0, 1]
    for stage, rows in records.items():
        assert [r["step"] for r in rows] == list(range(1, steps + 1)) and {r["rank"] for r in rows} == {4 * stage}
        assert sum(r["replica_all_reduce_bytes"] for r in rows) == steps * hsdp_ep_all_reduce_bytes(stage), stage


def test_plan_predicts_the_all_to_all_bytes_the_expert_parallel_run_sent(ep_paci, capsys):
    """plan's all-to-all bytes per step and rank (the routed copies sent to the other EP rank,
    (ep - 1) / ep of them under balanced routing) against the run's communication log: over a
    stage's two ranks the dispatches and combines carry every routed copy once each way in the
    forward and the backward, whatever the routing, so their logged inputs sum to exactly
    ep / (ep - 1) x 2 ranks x steps x the predicted bytes (the token-count exchanges left out).
    The AdamW run: Muon exchanges its matrix pieces by all-to-all too."""
    status, out, err = cli_in_process(capsys, "plan", *PP2_EP2[:2], "--gpus-per-node", "4", "--json",
                                      *sets(*REFERENCE_SETTINGS, *REFERENCE_MOE, *EP_PACI, *EP2))
    assert status == 0, err
    plan = json.loads(out)
    moe = plan["mixture_of_experts"]
    assert moe["expert_parallel"] == 2 and "expert_parallel_degree = 2" in moe["note"]
    logs = nccl_model.read_logs(ep_paci / "comm")
    counts_bytes = 8 * 8  # num_experts int64 counts
    for stage, rank in enumerate(moe["ranks"]):
        logged = sum(r["bytes"] for rank_id in (2 * stage, 2 * stage + 1) for r in logs[rank_id]
                     if r.get("kind") == "all_to_all_single" and r["bytes"] != counts_bytes)
        assert rank["all_to_all_bytes"] > 0 and logged == 2 * 2 * REFERENCE_STEPS * rank["all_to_all_bytes"], (stage, logged, rank)
    # FSDP moves the dense weights only: each rank holds its 4 experts whole (FSDP 2 / EP 2 = a
    # one-rank expert group), so counting every expert gathered would predict 1.9x the bytes.
    # A stage steps 4 / 3 times per step (a = 3 of m = 4), so the run is compared on its mean step.
    predicted = next(row["ranks"] for row in plan["communication"] if row["name"] == "PACI")
    records = stage_records(ep_paci)
    assert sorted(records) == [0, 1]
    for stage, rows in records.items():
        moved = statistics.fmean(r["fsdp_all_gather_bytes"] + r["fsdp_reduce_scatter_bytes"] for r in rows)
        expected = predicted[stage]["all_gather"] + predicted[stage]["reduce_scatter"]
        assert moved > 0 and abs(moved / expected - 1) <= 0.1, (stage, moved, expected)


@pytest.mark.parametrize("runs", ["ep_2bw", "ep_paci"])
def test_expert_parallel_streaming_run_resumes_exactly(runs, request, tmp_path):
    """Both 2BW versions of the EP-sharded experts and of the biases, Muon's momenta and error
    feedback (2BW), PACI's pending counts and AdamW state."""
    assert_resumes_exactly(request.getfixturevalue(runs), tmp_path / "resumed")


@pytest.mark.parametrize("runs", ["two_bw", "paci"])
def test_moe_streaming_run_resumes_exactly(runs, request, tmp_path):
    """Both 2BW versions of the weights and biases, PACI's pending counts, optimizer state."""
    assert_resumes_exactly(request.getfixturevalue(runs), tmp_path / "resumed")


@pytest.mark.parametrize("processes, assignments, named", [
    ("4", ["parallelism.data_parallel_shard_degree=2", "parallelism.expert_parallel_degree=3"],
     "parallelism.expert_parallel_degree (3) must divide model.num_experts (8)"),
    ("4", ["parallelism.data_parallel_shard_degree=2", "parallelism.expert_parallel_degree=4"],
     "parallelism.expert_parallel_degree (4) must divide the data ranks of a stage"),
    ("4", ["parallelism.data_parallel_shard_degree=2", "parallelism.expert_parallel_degree=2", "model.family=llama3",
           "model.num_experts=-1", "model.top_k=-1", "model.moe_hidden_dim=-1"],
     "parallelism.expert_parallel_degree (2) applies to model.family = \"qwen3_moe\" only"),
    ("4", ["parallelism.tensor_parallel_degree=2"], "parallelism.tensor_parallel_degree is 2, set it to 1"),
    ("2", ["model.top_k=9"], "model.top_k (9) must be between 1 and model.num_experts (8)"),
    ("2", ["model.expert_precision=half"], "model.expert_precision"),
    ("2", ["model.family=llama3", "model.num_experts=-1", "model.top_k=-1", "model.moe_hidden_dim=-1", "model.expert_precision=full"],
     "model.expert_precision applies to model.family = \"qwen3_moe\" only"),
])
def test_a_moe_layout_the_schedules_do_not_run_yet_is_one_line(tmp_path, capsys, processes, assignments, named):
    status, out, err = cli_in_process(capsys, "train", "--config", str(CONFIGS / "debug_cpu_pp2.toml"), "--nproc-per-node", processes,
                                      "--run-dir", str(tmp_path / "run"),
                                      *sets(*MOE, "parallelism.pipeline_parallel_schedule=PipeDream2BW", *assignments))
    assert status == 2 and named in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


def test_export_of_a_load_balanced_moe_checkpoint_is_refused_in_one_line(two_bw, tmp_path, capsys):
    """transformers' Qwen3-MoE chooses experts without biases, so moved biases cannot be exported."""
    status, out, err = cli_in_process(capsys, "export", "--checkpoint", str(two_bw / "checkpoint" / "step-6"),
                                      "--out", str(tmp_path / "hf"))
    assert status == 2 and "routes without them; train with model.load_balance_coeff = 0" in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "hf").exists()


def test_moe_export_gives_transformers_qwen3_moe_the_logits_of_our_forward(tmp_path):
    """Without load balancing (biases stay zero) the export is transformers' Qwen3MoeForCausalLM:
    its logits on a batch equal titan-async's forward of the checkpoint (PP 2, 2BW)."""
    run_dir = train(tmp_path / "run", *MOE, "model.load_balance_coeff=0", "training.steps=3",
                    "parallelism.pipeline_parallel_schedule=PipeDream2BW", layout=PP2)
    checkpoint = run_dir / "checkpoint" / "step-3"
    export_cli(checkpoint, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["architectures"], config["num_experts"], config["num_experts_per_tok"]) == (["Qwen3MoeForCausalLM"], 8, 2)
    input_dict, _ = next(iter(loaders(run_dir, "train")[0]))
    model = titan_model(run_dir, checkpoint)
    with torch.no_grad():
        positions = input_dict["positions"]
        ours = model(input_dict["input"], attention_masks=model.get_attention_masks(positions=positions), positions=positions)
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    difference = (hf_logits(hf, input_dict) - ours).abs()
    # torchtitan's experts multiply in bfloat16, transformers' in float32: measured mean 2e-5 and
    # max 5.4e-3 (of logits up to 0.97); with norm_topk_prob wrong, mean 3.9e-3 and max 0.17.
    assert float(difference.mean()) < 1e-4 and float(difference.max()) < 1e-2 * float(ours.abs().max())

    yaml = write_task(tmp_path / "task")  # eval --tasks builds the same model in memory
    result = run_cli("eval", "--checkpoint", str(checkpoint), "--tasks", str(yaml), "--limit", "20", "--json", env=OFFLINE)
    theirs = reference(tmp_path / "hf", yaml, limit=20, num_fewshot=None)
    assert json.loads(result.stdout)["tasks"][TASK]["metrics"]["acc"] == theirs["acc,none"]
