"""Tensor parallelism (torchtitan's llama3 plan, with sequence parallel) inside PipeDream2BW and
PACI stages.

TP ranks read the same sequences, so a PP 2 x TP 2 run sees the batches of one process without
a pipeline: 2BW (AdamW) and PACI (Muon + error feedback) equal the independent reference
(independent_reference.py) on the batches the run logs (TP only reorders sums: the bounds each
test states). With Muon the reference orthogonalises each whole matrix in one process, so
equality also checks that a TP-sharded weight is updated from its full logical matrix; so does
PP 2 x FSDP 2 x TP 2 with Muon (2BW, a custom stage split the reference reads from the run).
Both schedules also run with weight prediction on PP 2 x TP 2, across a resume.
"""

from __future__ import annotations

import json
import shutil

import pytest

import independent_reference as ref
import nccl_model
from conftest import CONFIGS, cli_in_process, metrics, run_cli, sets
from titan_async.config.run_config import load_run_config
from titan_async.core.errors import UserError
from test_independent_reference import (assert_different, assert_equal_with_resharded_norms, differences, pipelined,
                                        reference_inputs, resumed_at_step_3)
from test_schedules import EXACT, STEPS, assert_close_weights, assert_same_run, final_weights

TP2 = "parallelism.tensor_parallel_degree=2"
MICROBATCH = 2
TRAIN = (f"parallelism.pipeline_parallel_microbatch_size={MICROBATCH}",)
MUON_EF = ("optimizer.name=muon", "optimizer.lr=0.02", "optimizer.error_feedback.enabled=true")
PACI = ("parallelism.pipeline_parallel_schedule=PACI", "parallelism.paci.accumulation=2")


def setting(key: str) -> str:
    """The value `EXACT` gives `key`."""
    return next(a.partition("=")[2] for a in EXACT if a.startswith(f"{key}="))


@pytest.fixture(scope="module")
def two_bw(tmp_path_factory):
    """A PP 2 x TP 2 PipeDream2BW run, AdamW, with test_independent_reference.py's settings and
    logs (batches, communication)."""
    root = tmp_path_factory.mktemp("tp_2bw")
    return pipelined(root / "2bw", *TRAIN, "parallelism.pipeline_parallel_schedule=PipeDream2BW", TP2, nproc=4)


@pytest.fixture(scope="module")
def paci(tmp_path_factory):
    """A PP 2 x TP 2 PACI run, Muon + error feedback, with test_independent_reference.py's
    settings and logs (batches, communication)."""
    root = tmp_path_factory.mktemp("tp_paci")
    return pipelined(root / "paci", *TRAIN, *PACI, *MUON_EF, TP2, nproc=4)


def test_2bw_with_tensor_parallel_equals_the_independent_reference(two_bw):
    """PP 2 x TP 2 with sequence parallel (4 processes), PipeDream2BW, AdamW, against `ref.two_bw`
    (independent_reference.py) on the batches both TP ranks log. Control: the update written into
    the stale version. The run's communication also keeps NCCL's ordering rules (nccl_model).

    The gradient norms get 1e-4, as with FSDP: measured 9.9e-6 relative apart at most, the
    reference's (torch's foreach norm of stage 1, lm_head's float32 sum of squares) 1.2-1.6e-5
    from the float64 norm and the run's (TP shards) within 6.7e-6 of it. Losses and weights keep
    1e-5 (measured 1.3e-7 and 1.1e-6)."""
    settings, batches, weights = reference_inputs(two_bw)
    assert settings.tensor_ranks == 2 and settings.data_ranks == 1
    update_of_step = lambda step: step
    assert_equal_with_resharded_norms(differences(two_bw, weights, ref.two_bw(settings, batches), update_of_step))
    assert_different(differences(two_bw, weights, ref.two_bw(settings, batches, variant="stale"), update_of_step))
    nccl_model.assert_nccl_safe(two_bw / "comm", stages=2, ranks_per_stage=2)


def test_paci_with_tensor_parallel_and_muon_equals_the_independent_reference(paci):
    """PP 2 x TP 2 with sequence parallel, PACI (a = 2 of m = 4), Muon (each whole matrix
    orthogonalised in the reference, TP shards in the run) and error feedback, against
    `ref.paci` on the batches both TP ranks log. Losses to 1e-5 (measured 5.9e-8); gradient
    norms to 1e-4 as for 2BW above (1.3e-5); weights to 1e-4 (4.8e-5): Newton-Schulz's five
    iterations on a matrix gathered from TP shards, whose gradient TP summed in another order,
    grow float32 rounding by the largest factor of these comparisons. Control: one backward late."""
    settings, batches, weights = reference_inputs(paci)
    assert settings.tensor_ranks == 2 and settings.optimizer == "muon" and settings.microbatches == 4
    drains = ref.drain_steps(paci)
    update_of_step = lambda step: step * 4 // 2
    found = differences(paci, weights, ref.paci(settings, batches, drains), update_of_step)
    print("reference:", found)
    assert found["loss"] < 1e-5 and found["grad_norm"] < 1e-4 and found["weights"] < 1e-4, found
    assert_different(differences(paci, weights, ref.paci(settings, batches, drains, late=1), update_of_step))
    nccl_model.assert_nccl_safe(paci / "comm", stages=2, ranks_per_stage=2)


@pytest.mark.parametrize("schedule", ["PipeDream2BW", "PACI"])
def test_weight_prediction_with_tensor_parallel_and_its_resume_equal_the_independent_reference(tmp_path, schedule):
    """PP 2 x TP 2, AdamW, `training.weight_prediction` (2BW h = 1; PACI h = 2, a = 2 of m = 4),
    stopped at the step-3 checkpoint and resumed: each TP rank predicts its own shards (the
    extrapolation is elementwise). Gradient norms at 1e-4 as above. Controls: no prediction, and
    for PACI the prediction applied in the backward too. Measured: 2BW losses 9.0e-8, weights
    1.1e-6, norms 9.9e-6; PACI 1.5e-7, 1.1e-6 and 1.3e-5."""
    paci = schedule == "PACI"
    run = resumed_at_step_3(tmp_path / "run", *TRAIN, f"parallelism.pipeline_parallel_schedule={schedule}", TP2,
                            *(("parallelism.paci.accumulation=2", "training.weight_prediction=2") if paci else ("training.weight_prediction=1",)),
                            nproc=4)
    settings, batches, weights = reference_inputs(run)
    assert settings.tensor_ranks == 2
    if paci:
        drains = ref.drain_steps(run)
        rule = lambda **options: ref.paci(settings, batches, drains, **options)
        update_of_step = lambda step: step * 4 // 2
        controls = ({}, {"prediction": 2.0, "backward_weights": "forward"})
        predicted = {"prediction": 2.0}
    else:
        rule = lambda **options: ref.two_bw(settings, batches, **options)
        update_of_step = lambda step: step
        controls, predicted = ({},), {"prediction": 1.0}
    assert_equal_with_resharded_norms(differences(run, weights, rule(**predicted), update_of_step))
    for control in controls:
        assert_different(differences(run, weights, rule(**control), update_of_step))


def test_stages_send_sequence_parallel_shards_and_log_tp_collectives(two_bw):
    """Under sequence parallel a stage sends its (B, L/tp, D) shard of the activations, and the
    TP collectives (all-gather and reduce-scatter inside each stage's TP pair) are in the log
    that the NCCL model replays."""
    logs = nccl_model.read_logs(two_bw / "comm")
    shard_bytes = MICROBATCH * int(setting("training.seq_len")) // 2 * int(setting("model.dim")) * 4
    for rank, peer in ((0, 2), (1, 3)):
        activations = [r["bytes"] for r in logs[rank] if r["op"] == "send" and r["peer"] == peer]
        assert activations and set(activations[1:]) == {shard_bytes}, (rank, set(activations))  # the first is the header
    for rank, records in logs.items():
        groups = {r["group"]: r["ranks"] for r in records if r["op"] == "group"}
        tp_pair = [rank - rank % 2, rank - rank % 2 + 1]
        kinds = {r["kind"] for r in records if r["op"] == "coll" and groups[r["group"]] == tp_pair}
        assert {"all_gather_into_tensor", "reduce_scatter_tensor"} <= kinds, (rank, kinds)


def resumed_from_the_middle(run, destination):
    """A copy of `run` cut back to its step-3 checkpoint (later checkpoint and metrics removed), resumed to the end."""
    shutil.copytree(run, destination, ignore=shutil.ignore_patterns("comm"))
    shutil.rmtree(destination / "checkpoint" / f"step-{STEPS}")
    log = destination / "metrics.jsonl"
    log.write_text("".join(line + "\n" for line in log.read_text().splitlines() if json.loads(line)["step"] <= 3))
    run_cli("resume", "--run-dir", str(destination))
    return destination


def assert_resumes_exactly(run, destination) -> None:
    """`run` resumed from its middle checkpoint into `destination` logs the same steps and ends with the same weights."""
    resumed = resumed_from_the_middle(run, destination)
    assert max(metrics(resumed)) == STEPS
    assert_same_run(run, resumed, rel=1e-6)
    assert_close_weights(final_weights(resumed), final_weights(run))


def test_2bw_muon_on_fsdp_times_tensor_parallel_equals_the_independent_reference(tmp_path):
    """PP 2 x FSDP 2 x TP 2 (8 processes), PipeDream2BW, Muon (each matrix gathered over the
    flattened FSDP x TP group) and error feedback, against `ref.two_bw` on both data ranks'
    batches joined, with the run's own stage split: the first stage holds the embeddings only,
    so it has no Muon matrix, yet its ranks must take part in making the other stage's group (a
    run where they did not hung at optimizer build). Losses to 1e-5, gradient norms and weights
    to 1e-4 as for PACI with TP above (Newton-Schulz on matrices whose gradients TP and FSDP
    summed in another order). Controls: no error feedback, and Q, K and V orthogonalised as one
    matrix. NCCL's ordering rules hold (nccl_model)."""
    layers = ", ".join(f'"layers.{i}"' for i in range(4))
    embeddings_alone = f'parallelism.module_fqns_per_model_part=[["tok_embeddings"], [{layers}, "norm", "lm_head"]]'
    run = pipelined(tmp_path / "2bw", *TRAIN, "parallelism.pipeline_parallel_schedule=PipeDream2BW", *MUON_EF, TP2,
                    embeddings_alone, config="debug_cpu_pp2_fsdp2.toml", nproc=8)
    settings, batches, weights = reference_inputs(run)
    assert settings.tensor_ranks == settings.data_ranks == 2 and settings.stages[0] == ("tok_embeddings",)
    update_of_step = lambda step: step
    found = differences(run, weights, ref.two_bw(settings, batches), update_of_step)
    print("reference:", found)
    assert found["loss"] < 1e-5 and found["grad_norm"] < 1e-4 and found["weights"] < 1e-4, found
    assert_different(differences(run, weights, ref.two_bw(settings, batches, error_feedback=False), update_of_step))
    assert_different(differences(run, weights, ref.two_bw(settings, batches, whole_qkv=True), update_of_step))
    nccl_model.assert_nccl_safe(run / "comm", stages=2, ranks_per_stage=4)


@pytest.mark.parametrize("assignments, named", [
    (["model.n_heads=6", "model.dim=96"], "parallelism.tensor_parallel_degree (4) must divide model.n_heads (6)"),
    (["model.n_kv_heads=2"], "parallelism.tensor_parallel_degree (4) must divide model.n_kv_heads (2)"),
    (["training.seq_len=62"], "training.seq_len (62) must be divisible by parallelism.tensor_parallel_degree (4)"),
])
def test_a_bad_tensor_parallel_layout_is_one_line_naming_the_keys(tmp_path, capsys, assignments, named):
    status, out, err = cli_in_process(capsys, "train", "--config", str(CONFIGS / "debug_cpu_pp2.toml"), "--nproc-per-node", "8",
                                      "--run-dir", str(tmp_path / "run"),
                                      *sets("parallelism.pipeline_parallel_schedule=PipeDream2BW",
                                            "parallelism.tensor_parallel_degree=4", *assignments))
    assert status == 2 and named in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


def test_the_single_process_emulation_refuses_tensor_parallel():
    run = load_run_config(CONFIGS / "debug_cpu.toml", ["parallelism.pipeline_parallel_schedule=PACI", "parallelism.emulated_stages=2",
                                                       "parallelism.tensor_parallel_degree=2"])
    with pytest.raises(UserError, match=r"emulated_stages runs every stage in one process; set parallelism.tensor_parallel_degree = 1"):
        run.check(2)
