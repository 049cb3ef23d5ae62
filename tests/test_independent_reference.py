"""The pipelined PipeDream-2BW and PACI runs (CLI, PP 2 on 2 gloo processes, the tiniest model)
against `independent_reference.py`, which imports nothing from titan_async: torchtitan's Llama
modules, torch's AdamW and the rules written out. The run writes the batches it trains on
(`TITAN_ASYNC_BATCH_LOG`); the reference draws the initial weights itself. Per-step losses,
the logged global gradient norms and the final weights must agree to 1e-5 relative, and each
test's controls (a plausible wrong rule) must not.

`training.max_norm = 0.1` makes the last stage clip (its gradient norm is about 0.3) while the
first does not (about 0.05): a global clip would differ. The checkpoint at step 3 drains the
stream mid-run. PipeDream2BW and PACI also accumulate two local batches per step (the
reference trains on them as one batch). PipeDream2BW also runs on PP 2 x FSDP 2, on PP 2 x
2 DDP replicas (4 processes) and, with Muon, on PP 2 x 2 replicas x FSDP 2 (8 processes), the
reference joining every data rank's batches, and with torchtitan's Qwen3 MoE (expert biases
and their load balancing); PACI on PP 2 x FSDP 2, on PP 2 x 2 replicas x FSDP 2 and with the MoE.
test_tensor_parallel.py and test_moe.py compare the PP 2 x TP 2, PP 2 x FSDP 2 x TP 2,
MoE x FSDP and PP 2 x EP 2 runs with the reference through this module's `pipelined` and
`differences`. Both schedules also run with weight prediction on PP 2 x FSDP 2, and 2BW's on
PP 2 x 2 replicas with the MoE, across a resume; under `training.clipping =
"lagged_global"`; PACI on PP 2 x FSDP 2, 2BW, dense and MoE, with validation at every step
(which must not reach training), and a
non-finite gradient on one rank of a two-rank stage under FSDP, replicas and EP (`found_inf`)."""

from __future__ import annotations

import math

from pathlib import Path

import json

import pytest
import torch

import independent_reference as ref
import nccl_model
from conftest import CONFIGS, TINY, checkpoint_weights, cli_in_process, metrics, run_cli, sets

STEPS = 6
SETTINGS = (*TINY, "training.local_batch_size=8", f"training.steps={STEPS}", "checkpoint.interval=3",
            "validation.enable=false", "training.max_norm=0.1", "parallelism.pipeline_parallel_microbatch_size=1")


STREAM_MODEL = {"TITAN_ASYNC_STREAM_MODEL": "1"}
"""Every run checks its cross-stream order against the CPU stream model (test_stream_model.py):
a race fails the run, naming both sides."""


def pipelined(run_dir: Path, *assignments: str, config: str = "debug_cpu_pp2.toml", nproc: int = 2) -> Path:
    """Train, logging every rank's batches under run_dir/batches and communication under run_dir/comm."""
    run_cli("train", "--config", str(CONFIGS / config), "--nproc-per-node", str(nproc), "--run-dir", str(run_dir),
            *sets(*SETTINGS, *assignments),
            env={"TITAN_ASYNC_BATCH_LOG": str(run_dir / "batches"), "TITAN_ASYNC_COMM_LOG": str(run_dir / "comm"), **STREAM_MODEL})
    return run_dir


def reference_inputs(run: Path):
    weights = checkpoint_weights(run / "checkpoint" / f"step-{STEPS}")
    settings = ref.read_settings(run, vocab_size=weights["tok_embeddings.weight"].shape[0])
    return settings, ref.read_batches(run / "batches", settings), weights


def differences(run: Path, weights: dict[str, torch.Tensor], result: ref.Result, update_of_step) -> dict[str, float]:
    """The largest relative difference of the per-step losses, logged global gradient norms and
    final weights (norm of the difference over the run's norm, per tensor) from `result`."""
    logged = metrics(run)
    assert sorted(logged) == sorted(result.losses) == list(range(1, STEPS + 1))
    assert result.weights.keys() == weights.keys() and len(weights) > 10
    return {
        "loss": max(abs(result.losses[s] / logged[s]["loss_metrics/global_avg_loss"] - 1) for s in logged),
        "grad_norm": max(relative_difference(result.global_norm(update_of_step(s)), logged[s]["grad_norm"]) for s in logged),
        "weights": max(float((result.weights[k] - weights[k]).norm() / weights[k].norm()) for k in weights),
    }


def relative_difference(expected: float, found: float) -> float:
    """|expected / found - 1|; 0 when both are NaN (an update skipped in both), inf when one is."""
    if math.isnan(expected) or math.isnan(found):
        return 0.0 if math.isnan(expected) and math.isnan(found) else math.inf
    return abs(expected / found - 1)


def assert_equal(found: dict[str, float]) -> None:
    print("reference:", found)
    assert max(found.values()) < 1e-5, found


def assert_equal_with_resharded_norms(found: dict[str, float]) -> None:
    """Losses and weights to 1e-5, gradient norms to 1e-4: the run sums a stage's float32 squares
    over shards (FSDP, TP), the reference over whole tensors, and torch's foreach norm of
    lm_head's 131k entries alone is 1e-5 relative from the float64 norm (each test gives its
    measurement)."""
    print("reference:", found)
    assert found["loss"] < 1e-5 and found["weights"] < 1e-5 and found["grad_norm"] < 1e-4, found


def assert_different(found: dict[str, float]) -> None:
    """A control: far from the run, not within rounding of it."""
    print("control:", found)
    assert found["loss"] > 1e-4 and found["weights"] > 1e-3, found


def test_2bw_equals_the_independent_reference(tmp_path):
    run = pipelined(tmp_path / "run", "parallelism.pipeline_parallel_schedule=PipeDream2BW")
    settings, batches, weights = reference_inputs(run)
    update_of_step = lambda step: step  # the row of step t waits for the update that applies batch t - 1
    assert_equal(differences(run, weights, ref.two_bw(settings, batches), update_of_step))
    assert_different(differences(run, weights, ref.two_bw(settings, batches, variant="stale"), update_of_step))
    assert_different(differences(run, weights, ref.two_bw(settings, batches, variant="no_delay"), update_of_step))


def test_2bw_with_muon_and_error_feedback_equals_the_independent_reference(tmp_path):
    """Muon (Q, K and V of the fused wqkv orthogonalised apart) and AdamW, both under error
    feedback with c = 1, as debug_cpu_pp2_2bw.toml configures them."""
    run = pipelined(tmp_path / "run", config="debug_cpu_pp2_2bw.toml")
    settings, batches, weights = reference_inputs(run)
    assert settings.optimizer == "muon" and settings.error_feedback == 1.0
    update_of_step = lambda step: step
    assert_equal(differences(run, weights, ref.two_bw(settings, batches), update_of_step))
    assert_different(differences(run, weights, ref.two_bw(settings, batches, error_feedback=False), update_of_step))
    assert_different(differences(run, weights, ref.two_bw(settings, batches, whole_qkv=True), update_of_step))


def resumed_at_step_3(run_dir: Path, *assignments: str, config: str = "debug_cpu_pp2.toml", nproc: int = 2) -> Path:
    """A pipelined run stopped at its step-3 checkpoint and resumed to STEPS (one lr schedule)."""
    run = pipelined(run_dir, *assignments, f"lr_scheduler.total_steps={STEPS}", "training.steps=3", config=config, nproc=nproc)
    run_cli("resume", "--run-dir", str(run), *sets(f"training.steps={STEPS}"), env={"TITAN_ASYNC_BATCH_LOG": str(run / "batches"), **STREAM_MODEL})
    return run


def test_2bw_lagged_clipping_and_weight_prediction_and_their_resume_equal_the_independent_reference(tmp_path):
    """`training.clipping = "lagged_global"` with max_norm = 0.1 (the global norm is about 0.3, so
    every update from step 4 on is scaled, on both stages alike) and `training.weight_prediction
    = 1` (each delayed gradient taken at W[k-1] + (W[k-1] - W[k-2]), three weight copies per
    stage), in one run stopped at the step-3 checkpoint and resumed: the lagged norms and the
    predicted versions must come back from it. Stage 1's gradient is NaN at step 2: it skips
    update 2 on the device, whose logged norm is then NaN, so step 5's update, which would
    scale by it, clips per stage (the reference's `skipped`; a norm of stage 0's alone would
    let stage 1's gradient through nearly unscaled). Controls: per-stage clipping, the norm of
    one step later than the run may know, no prediction, horizon 2, and no skip."""
    skipped = frozenset({(1, 2)})
    run = resumed_at_step_3(tmp_path / "run", "parallelism.pipeline_parallel_schedule=PipeDream2BW",
                            "training.clipping=lagged_global", "training.weight_prediction=1",
                            "health.inject_nonfinite_steps=[2]", "health.inject_stage=1")
    assert "step 2: stage 1 (rank 1) has a non-finite gradient" in (run / "logs" / "rank1.log").read_text()
    assert math.isnan(metrics(run)[2]["grad_norm"])
    settings, batches, weights = reference_inputs(run)
    update_of_step = lambda step: step
    both = {"lagged_clip": 3, "prediction": 1.0, "skipped": skipped}
    assert_equal(differences(run, weights, ref.two_bw(settings, batches, **both), update_of_step))
    per_stage = differences(run, weights, ref.two_bw(settings, batches, prediction=1.0, skipped=skipped), update_of_step)
    print("control:", per_stage)  # AdamW hardly sees a gradient's scale: the losses of steps 4-6 move by ~1e-4
    assert per_stage["loss"] > 3e-5 and per_stage["grad_norm"] > 1e-4 and per_stage["weights"] > 1e-2, per_stage
    for control in ({**both, "lagged_clip": 2}, {**both, "prediction": 0.0}, {**both, "prediction": 2.0}, {**both, "skipped": frozenset()}):
        assert_different(differences(run, weights, ref.two_bw(settings, batches, **control), update_of_step))


def test_paci_lagged_clipping_and_weight_prediction_and_their_resume_equal_the_independent_reference(tmp_path):
    """PACI (a = 3 of m = 8) under lagged global clipping (an update is scaled by the norm logged
    three steps before the step that fed its last microbatch; stage 0's updates cross batches)
    and `training.weight_prediction = 2` (stage 0, whose microbatches cross 1/3 of its local
    steps on average, runs each forward at W + (2 / 3) (W - W_prev)), stopped at the step-3
    checkpoint (W_prev and the norms saved) and resumed. Controls: per-stage clipping, a lag of
    2, no prediction, and the prediction applied in the backward too (a stash of the predicted
    weights)."""
    a, m = 3, 8
    run = resumed_at_step_3(tmp_path / "run", "parallelism.pipeline_parallel_schedule=PACI", f"parallelism.paci.accumulation={a}",
                            "training.clipping=lagged_global", "training.weight_prediction=2")
    settings, batches, weights = reference_inputs(run)
    drains = ref.drain_steps(run)
    update_of_step = lambda step: step * m // a
    both = {"lagged_clip": 3, "prediction": 2.0}
    assert_equal(differences(run, weights, ref.paci(settings, batches, drains, **both), update_of_step))
    for control in ({"prediction": 2.0}, {**both, "lagged_clip": 2}, {"lagged_clip": 3}, {**both, "backward_weights": "forward"}):
        assert_different(differences(run, weights, ref.paci(settings, batches, drains, **control), update_of_step))


def test_the_independent_reference_imports_nothing_from_titan_async():
    assert "titan_async" not in Path(ref.__file__).read_text()


ACCUMULATION = ("training.local_batch_size=4", "training.global_batch_size=8")
"""Two local batches of 4 accumulated per step: the same 8 microbatches per step as SETTINGS."""


def test_2bw_with_accumulation_equals_the_independent_reference(tmp_path):
    """PipeDream2BW accumulating two local batches per step, against `ref.two_bw` on the
    accumulated microbatches as one batch. Control: each local batch an update of its own."""
    run = pipelined(tmp_path / "run", *ACCUMULATION, "parallelism.pipeline_parallel_schedule=PipeDream2BW")
    settings, batches, weights = reference_inputs(run)
    assert settings.local_batches == 2 and len(batches[0]) == 8
    update_of_step = lambda step: step
    assert_equal(differences(run, weights, ref.two_bw(settings, batches), update_of_step))
    assert_different(differences(run, weights, ref.two_bw(settings, batches, variant="one_at_a_time"), update_of_step))


def test_paci_with_accumulation_equals_the_independent_reference(tmp_path):
    """`ref.paci`, a = 3 of m = 8 microbatches (two accumulated local batches of 4): each stage
    steps inside batches and across their local batches, at different moments on the two stages,
    and stage 0's microbatch in flight crosses a local step every third microbatch (not after the
    drain at step 3)."""
    a, m = 3, 8
    run = pipelined(tmp_path / "run", *ACCUMULATION, "parallelism.pipeline_parallel_schedule=PACI",
                    f"parallelism.paci.accumulation={a}")
    settings, batches, weights = reference_inputs(run)
    assert settings.local_batches == 2 and settings.microbatches == m
    drains = ref.drain_steps(run)
    assert drains == {3, STEPS}
    update_of_step = lambda step: step * m // a  # the last update whose microbatches all belong to batches up to t - 1
    assert_equal(differences(run, weights, ref.paci(settings, batches, drains), update_of_step))
    assert_different(differences(run, weights, ref.paci(settings, batches, drains, late=1), update_of_step))
    assert_different(differences(run, weights, ref.paci(settings, batches, drains, backward_weights="forward"), update_of_step))


MOE = ("model.family=qwen3_moe", "model.num_experts=8", "model.top_k=2", "model.moe_hidden_dim=64",
       "model.load_balance_coeff=0.01", "parallelism.pipeline_parallel_microbatch_size=2")
"""test_moe.py's tiny MoE (4 microbatches of 2), with the per-stage clipping of SETTINGS kept."""


def test_2bw_moe_equals_the_independent_reference(tmp_path):
    """torchtitan's Qwen3 MoE (bfloat16 experts as torchtitan runs them: the reference's forwards
    have the pipeline's microbatch shapes, so they round alike) under PipeDream2BW: the expert
    biases are part of each weight version and move by torchtitan's load-balancing rule from the
    counts of the delayed batch. The control moves them by the counts of the next batch (the one
    the pipeline forwards when it steps): the final biases differ by 60-90% and routing, hence
    the losses, follows."""
    run = pipelined(tmp_path / "run", *MOE, "parallelism.pipeline_parallel_schedule=PipeDream2BW")
    settings, batches, weights = reference_inputs(run)
    assert settings.family == "qwen3_moe"
    biases = [k for k in weights if k.endswith("expert_bias_E")]
    assert len(biases) == 4 and all(weights[k].abs().max() > 0 for k in biases)
    update_of_step = lambda step: step
    assert_equal(differences(run, weights, ref.two_bw(settings, batches), update_of_step))
    assert_different(differences(run, weights, ref.two_bw(settings, batches, bias_counts="next"), update_of_step))


@pytest.mark.parametrize("model", [(), MOE], ids=["dense", "moe"])
def test_validation_every_step_leaves_2bw_equal_to_the_independent_reference(tmp_path, model):
    """Validation at every step (each drains the stream and runs forwards at the latest weights,
    MoE routing included) must leave training as the reference, which never validates, has it:
    no RNG draw, expert count or weight version of validation may reach a training step."""
    run = pipelined(tmp_path / "run", *model, "parallelism.pipeline_parallel_schedule=PipeDream2BW",
                    "validation.enable=true", "validation.freq=1")
    assert sorted(metrics(run, "validation")) == list(range(1, STEPS + 1))
    settings, batches, weights = reference_inputs(run)
    update_of_step = lambda step: step
    assert_equal(differences(run, weights, ref.two_bw(settings, batches), update_of_step))
    assert_different(differences(run, weights, ref.two_bw(settings, batches, variant="stale"), update_of_step))


INJECTED = ("health.inject_nonfinite_steps=[3]", "health.inject_stage=1", "health.inject_rank=3")
SKIPPED = frozenset({(1, 3)})
"""Stage 1's update 3, which both ranks of the stage must skip when rank 3 alone poisons its
gradient at step 3 (on PP 2 with 2 data ranks, ranks 2 and 3 hold stage 1)."""

DATA_RANKS = {"fsdp": (), "replicas": ("parallelism.data_parallel_shard_degree=1", "parallelism.data_parallel_replicate_degree=2")}
"""Two data ranks per stage on debug_cpu_pp2_fsdp2.toml (4 processes): FSDP 2, or 2 DDP replicas."""


@pytest.mark.parametrize("layout", DATA_RANKS)
def test_2bw_with_data_ranks_equals_the_independent_reference(tmp_path, layout):
    """PP 2 x FSDP 2 or x 2 DDP replicas (4 processes), PipeDream2BW, AdamW: each data rank
    trains its own local batch and the reference trains on the global batch, both data ranks'
    batches under one loss normalisation (the sum over the global batch's valid tokens). At
    step 3 only rank 3 (stage 1's second data rank) finds a NaN in its gradient: both ranks of
    stage 1 must skip their update on the device (`found_inf` agreed over the stage's group),
    stage 0 must not, and training goes on; the reference skips stage 1's update 3 (weights and
    AdamW state kept, the lr schedule moving on). Controls: data rank 0's batches alone (the
    gradients not averaged), the update written into the stale version, and no update skipped.
    The run's communication also keeps NCCL's ordering rules (nccl_model).

    Under FSDP the gradient norms get 1e-4: stage 1's norm is a float32 sum of squares dominated
    by lm_head (131k entries), which torch's foreach norm over the whole tensor (the reference)
    and FSDP's two shards (the run) round differently: measured 1.0-1.4e-5 relative apart, each
    within 2e-5 of the float64 norm (stage 0's agree to 2e-7). Losses and weights keep 1e-5
    (measured 1.4e-7 and 2.5e-7); replicas keep 1e-5 throughout (1.4e-7)."""
    run = pipelined(tmp_path / "run", "parallelism.pipeline_parallel_schedule=PipeDream2BW", *DATA_RANKS[layout], *INJECTED,
                    config="debug_cpu_pp2_fsdp2.toml", nproc=4)
    logs = {rank: (run / "logs" / f"rank{rank}.log").read_text() for rank in range(4)}
    assert "step 3: stage 1 (rank 3) has a non-finite gradient" in logs[3]
    assert not any("non-finite" in logs[rank] for rank in (0, 1, 2))
    settings, batches, weights = reference_inputs(run)
    assert settings.data_ranks == 2 and len(batches[0]) == 2 * settings.microbatches
    update_of_step = lambda step: step
    found = differences(run, weights, ref.two_bw(settings, batches, skipped=SKIPPED), update_of_step)
    (assert_equal_with_resharded_norms if layout == "fsdp" else assert_equal)(found)
    one_rank = ref.read_batches(run / "batches", settings, data_ranks=[0])
    assert_different(differences(run, weights, ref.two_bw(settings, one_rank, skipped=SKIPPED), update_of_step))
    assert_different(differences(run, weights, ref.two_bw(settings, batches, variant="stale", skipped=SKIPPED), update_of_step))
    assert_different(differences(run, weights, ref.two_bw(settings, batches), update_of_step))
    nccl_model.assert_nccl_safe(run / "comm", stages=2, ranks_per_stage=2)


def test_2bw_muon_with_hsdp_equals_the_independent_reference(tmp_path):
    """PP 2 x 2 replicas x FSDP 2 (8 processes), PipeDream2BW with Muon and error feedback,
    against `ref.two_bw` on the four data ranks' batches joined: Muon orthogonalises each full
    matrix, gathered over the shards. Controls: one replica's data ranks alone (the gradients not
    averaged over the replicas), and no error feedback. The run's communication also keeps
    NCCL's ordering rules (nccl_model).

    The gradient norms get 1e-4, as with FSDP alone: measured 9.8e-6 relative apart at most, the
    reference's (torch's foreach norm of stage 1, lm_head's float32 sum of squares) 0.9-1.4e-5
    from the float64 norm and the run's (sharded) within 4.3e-6 of it. Losses and weights keep
    1e-5 (measured 1.5e-8 and 1.6e-6)."""
    run = pipelined(tmp_path / "run", "parallelism.pipeline_parallel_schedule=PipeDream2BW", "training.local_batch_size=2",
                    "optimizer.name=muon", "optimizer.lr=0.02", "optimizer.error_feedback.enabled=true",
                    "parallelism.data_parallel_shard_degree=2", "parallelism.data_parallel_replicate_degree=2",
                    config="debug_cpu_pp2_fsdp2.toml", nproc=8)
    settings, batches, weights = reference_inputs(run)
    assert settings.optimizer == "muon" and settings.data_ranks == 4 and len(batches[0]) == 4 * settings.microbatches
    update_of_step = lambda step: step
    assert_equal_with_resharded_norms(differences(run, weights, ref.two_bw(settings, batches), update_of_step))
    one_replica = ref.read_batches(run / "batches", settings, data_ranks=[0, 1])
    assert_different(differences(run, weights, ref.two_bw(settings, one_replica), update_of_step))
    assert_different(differences(run, weights, ref.two_bw(settings, batches, error_feedback=False), update_of_step))
    nccl_model.assert_nccl_safe(run / "comm", stages=2, ranks_per_stage=4)


def test_paci_muon_with_hsdp_equals_the_independent_reference(tmp_path):
    """PP 2 x 2 replicas x FSDP 2 (8 processes), PACI (a = 3 of m = 4 per data rank) with Muon
    and error feedback, against `ref.paci` with the four data ranks' i-th microbatches side by
    side: a local step reduces over the FSDP shards and the replicas, and Muon orthogonalises
    each full matrix. Controls: one replica's data ranks alone, and one backward late. Gradient
    norms at 1e-4, as under FSDP above. NCCL's ordering rules hold (nccl_model). Measured:
    losses 8.9e-8, gradient norms 7.6e-6, weights 7.7e-6 (Newton-Schulz grows the rounding of
    sums over 4 data ranks; the run is deterministic)."""
    a, m = 3, 4
    run = pipelined(tmp_path / "run", "parallelism.pipeline_parallel_schedule=PACI", f"parallelism.paci.accumulation={a}",
                    "training.local_batch_size=4", "optimizer.name=muon", "optimizer.lr=0.02", "optimizer.error_feedback.enabled=true",
                    "parallelism.data_parallel_shard_degree=2", "parallelism.data_parallel_replicate_degree=2",
                    config="debug_cpu_pp2_fsdp2.toml", nproc=8)
    settings, batches, weights = reference_inputs(run)
    assert settings.optimizer == "muon" and settings.data_ranks == 4 and settings.microbatches == m
    drains, joined = ref.drain_steps(run), ref.side_by_side(batches, settings.data_ranks)
    update_of_step = lambda step: step * m // a
    assert_equal_with_resharded_norms(differences(run, weights, ref.paci(settings, joined, drains), update_of_step))
    one_replica = ref.side_by_side(ref.read_batches(run / "batches", settings, data_ranks=[0, 1]), 2)
    assert_different(differences(run, weights, ref.paci(settings, one_replica, drains), update_of_step))
    assert_different(differences(run, weights, ref.paci(settings, joined, drains, late=1), update_of_step))
    nccl_model.assert_nccl_safe(run / "comm", stages=2, ranks_per_stage=4)


def test_2bw_weight_prediction_with_fsdp_and_its_resume_equal_the_independent_reference(tmp_path):
    """PP 2 x FSDP 2, PipeDream2BW with `training.weight_prediction = 1`: each rank predicts its
    own shards (the latest weights in the parameters' shards, the two predictions in side
    shards), stopped at the step-3 checkpoint and resumed. Controls: no prediction, and horizon
    2. Gradient norms at 1e-4, as under FSDP above (measured: losses 9.6e-8, weights 2.3e-7,
    norms 1.4e-5)."""
    run = resumed_at_step_3(tmp_path / "run", "parallelism.pipeline_parallel_schedule=PipeDream2BW", "training.weight_prediction=1",
                            config="debug_cpu_pp2_fsdp2.toml", nproc=4)
    settings, batches, weights = reference_inputs(run)
    assert settings.data_ranks == 2 and len(batches[0]) == 2 * settings.microbatches
    update_of_step = lambda step: step
    assert_equal_with_resharded_norms(differences(run, weights, ref.two_bw(settings, batches, prediction=1.0), update_of_step))
    assert_different(differences(run, weights, ref.two_bw(settings, batches), update_of_step))
    assert_different(differences(run, weights, ref.two_bw(settings, batches, prediction=2.0), update_of_step))


def test_2bw_moe_weight_prediction_on_replicas_equals_the_independent_reference(tmp_path):
    """PP 2 x 2 DDP replicas (FSDP2 over a replicate mesh: the same predicted shards as FSDP),
    PipeDream2BW with `training.weight_prediction = 1` on the MoE (experts in float32, so that
    the predictions' float32 rounding is not amplified by bfloat16 experts): the expert biases,
    plain tensors beside the shards, are predicted as plain parameters are. The checkpoint at
    step 3 must leave the predicted biases alone: the latest biases live in another tensor than
    the one the model state held at the start (the model state is taken live, `LiveModelState`).
    Controls: no prediction, and the biases moved by the next batch's counts (measured: losses
    4.0e-8, weights 2.4e-7, norms 2.9e-7; 1.2 on the biases when the checkpoint overwrote them)."""
    run = pipelined(tmp_path / "run", *MOE, "model.expert_precision=full", "parallelism.pipeline_parallel_schedule=PipeDream2BW",
                    "training.weight_prediction=1", *DATA_RANKS["replicas"], config="debug_cpu_pp2_fsdp2.toml", nproc=4)
    settings, batches, weights = reference_inputs(run)
    assert settings.family == "qwen3_moe" and settings.data_ranks == 2
    update_of_step = lambda step: step
    assert_equal(differences(run, weights, ref.two_bw(settings, batches, prediction=1.0), update_of_step))
    assert_different(differences(run, weights, ref.two_bw(settings, batches), update_of_step))
    assert_different(differences(run, weights, ref.two_bw(settings, batches, prediction=1.0, bias_counts="next"), update_of_step))


def fsdp_gather_bytes(run: Path, rank: int, step: int) -> int:
    """Bytes FSDP2 all-gathered on `rank` during `step`, read from the run's comm log (FSDP2
    gathers through `all_gather_single`, which nothing else of the run issues)."""
    current, gathered = None, 0
    for line in (run / "comm" / f"rank{rank}.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["op"] == "step":
            current = record["step"]
        elif current == step and record["op"] == "coll" and record["kind"] == "all_gather_single":
            gathered += record["bytes"]
    return gathered


def test_paci_with_fsdp_equals_the_independent_reference(tmp_path, capsys):
    """PP 2 x FSDP 2, PACI (a = 3 of m = 8 per data rank): a local step
    reduces the stage's gradients over both data ranks, so the reference's microbatch i is both
    data ranks' i-th microbatch side by side (`side_by_side`). With `training.weight_prediction =
    2` (stage 0's forwards at W + (2 / 3) (W - W_prev), each rank predicting its own shards),
    stopped at the step-3 checkpoint (W_prev saved) and resumed. Gradient norms at 1e-4, as
    under FSDP above (measured: losses 4.7e-8, weights 6.7e-7, norms 1.1e-5; PACI on replicas is
    the HSDP test's). Controls: one backward late, data rank 0's batches alone, no prediction, and the
    prediction applied in the backward too."""
    a, m = 3, 8
    run = resumed_at_step_3(tmp_path / "run", "parallelism.pipeline_parallel_schedule=PACI", f"parallelism.paci.accumulation={a}",
                            "training.weight_prediction=2", config="debug_cpu_pp2_fsdp2.toml", nproc=4)
    settings, batches, weights = reference_inputs(run)
    assert settings.data_ranks == 2 and settings.microbatches == m
    drains, joined = ref.drain_steps(run), ref.side_by_side(batches, settings.data_ranks)
    update_of_step = lambda step: step * m // a
    predicted = {"prediction": 2.0}
    assert_equal_with_resharded_norms(differences(run, weights, ref.paci(settings, joined, drains, **predicted), update_of_step))
    for control in ({**predicted, "late": 1}, {}, {**predicted, "backward_weights": "forward"}):
        assert_different(differences(run, weights, ref.paci(settings, joined, drains, **control), update_of_step))
    one_rank = ref.read_batches(run / "batches", settings, data_ranks=[0])
    assert_different(differences(run, weights, ref.paci(settings, one_rank, drains, **predicted), update_of_step))
    nccl_model.assert_nccl_safe(run / "comm", stages=2, ranks_per_stage=2)

    # Stage 0 predicts: it gathers twice per forward (the prediction, then the current weights), 16
    # times in step 2 (steady: past the first local step, before the step-3 checkpoint's drain),
    # as `plan` counts; 8 / 3 gathers, one per local step, without the prediction's.
    capsys.readouterr()  # the comparisons' prints
    code, out, _ = cli_in_process(capsys, "plan", "--config", str(CONFIGS / "debug_cpu_pp2_fsdp2.toml"), "--gpus-per-node", "4",
                                  *sets(*SETTINGS, "parallelism.pipeline_parallel_schedule=PACI", f"parallelism.paci.accumulation={a}",
                                        "training.weight_prediction=2"), "--json")
    assert code == 0
    planned = next(row for row in json.loads(out)["communication"] if row["name"] == "PACI")["ranks"][0]["all_gather"]
    assert fsdp_gather_bytes(run, rank=0, step=2) == planned


def test_paci_moe_equals_the_independent_reference(tmp_path):
    """torchtitan's Qwen3 MoE under PACI (a = 3 of m = 4), experts in float32
    (`model.expert_precision = "full"`: torchtitan's bfloat16 experts save bfloat16 copies of
    their weights in the forward, so a backward that crossed a step would read the forward's
    experts, not PACI's current weights). Each stage's step moves its blocks' biases by the
    counts of exactly the microbatches whose backward it applies, routed at their forwards, and a
    backward that crossed a step routes as its forward did. Controls: the counts of the routing
    at the backward's weights and biases, and one backward late."""
    a, m = 3, 4
    run = pipelined(tmp_path / "run", *MOE, "model.expert_precision=full", "parallelism.pipeline_parallel_schedule=PACI",
                    f"parallelism.paci.accumulation={a}")
    settings, batches, weights = reference_inputs(run)
    assert settings.family == "qwen3_moe" and settings.expert_precision == "full" and settings.microbatches == m
    drains = ref.drain_steps(run)
    update_of_step = lambda step: step * m // a
    assert_equal(differences(run, weights, ref.paci(settings, batches, drains), update_of_step))
    recounted = differences(run, weights, ref.paci(settings, batches, drains, bias_counts="backward"), update_of_step)
    print("control:", recounted)  # biases move by 1e-2 steps: the losses by ~1e-4, the biases by half their size
    assert recounted["loss"] > 3e-5 and recounted["grad_norm"] > 1e-2 and recounted["weights"] > 0.1, recounted
    assert_different(differences(run, weights, ref.paci(settings, batches, drains, late=1), update_of_step))
