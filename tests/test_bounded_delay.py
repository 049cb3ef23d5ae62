"""Fewer microbatches per step than stages: PipeDream-2BW with a bounded, uniform delay
d = ceil((p - 1) / m) on d + 1 weight versions, and PACI stepping every a < p - 1 backwards.

The 2BW policy is driven through the first stage's own action order (`actions.window_actions`,
drains included) on a least-squares problem with SGD, against the recurrence written out:
W[k+1] = W[k] - lr * grad f_k(W[k-d]), W[j] = W[0] for j < 0 (controls: the delay d - 1, and d
versions instead of d + 1). The CLI runs at PP 4 (m = 1, 2; and m = 1 with FSDP 2),
`training.gradient_delay = 2` (with prediction, with EF, and with FSDP) and PACI at PP 4
(m = a = 1, 2) are compared with
`independent_reference.py` across a resume, and their logs replayed in the NCCL model and the
device replay; what d > 1 does not run yet is refused in one line."""

from __future__ import annotations

import json

import pytest
import torch

import device_replay
import independent_reference as ref
import nccl_model
from conftest import CONFIGS, TINY, cli_in_process, metrics, run_cli, sets
from test_independent_reference import (
    STEPS, assert_different, assert_equal, assert_equal_with_resharded_norms, differences, pipelined, reference_inputs,
)
from titan_async.config.run_config import load_run_config
from titan_async.core.errors import UserError
from titan_async.pipeline.actions import drain_actions, gradient_delay, window_actions
from titan_async.pipeline.versions import TwoVersions

LR, SIZE, ROWS = 0.05, 6, 4


def problem(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, y) of microbatch k: f_k(W) = |A W - y|^2 / 2."""
    generator = torch.Generator().manual_seed(k)
    return (torch.randn(ROWS, SIZE, generator=generator, dtype=torch.float64),
            torch.randn(ROWS, generator=generator, dtype=torch.float64))


def gradient(weights: torch.Tensor, k: int) -> torch.Tensor:
    a, y = problem(k)
    return a.T @ (a @ weights - y)


def initial() -> torch.Tensor:
    return torch.randn(SIZE, generator=torch.Generator().manual_seed(99), dtype=torch.float64)


def recurrence(delay: int, microbatches: int, batches: int) -> list[torch.Tensor]:
    """W[0..batches] by the rule written out."""
    w = [initial()]
    for k in range(batches):
        at = w[max(k - delay, 0)]
        w.append(w[k] - LR * sum(gradient(at, k * microbatches + j) for j in range(microbatches)))
    return w


class TooFewVersions(TwoVersions):
    """The control: d buffers for a delay of d."""

    def __init__(self, params, microbatches, lag):
        super().__init__(params, microbatches, lag=lag)
        self.slots = lag
        self._all_live()


def drive(make_policy, stages: int, microbatches: int, batches: int, drains: set[int], resume_at: int | None = None):
    """Run stage 0's actions for `batches` windows, draining after the windows in `drains` (and
    the last); at the drain after window `resume_at` the policy's state goes through
    state_dict into a fresh policy on fresh parameters. Returns the latest weights after each
    drain, by step, and how many backwards saw weights other than their forward's."""
    param = torch.nn.Parameter(initial())
    policy = make_policy([param])
    seen, mismatched, exposed, since = {}, 0, {}, 0

    def step() -> None:
        with torch.no_grad():
            param.sub_(LR * param.grad)
        param.grad = None

    for window in range(batches):
        actions = window_actions(0, stages, microbatches, window, since)
        if window in drains or window == batches - 1:
            actions += drain_actions(0, stages, microbatches, window, since)
            since = (window + 1) * microbatches
        for action in actions:
            k = action.microbatch_index
            if action.computation_type.value == "F":
                policy.before_forward(k)
                seen[k] = param.detach().clone()
                policy.after_forward(k)
                continue
            policy.before_backward(k)
            mismatched += not torch.equal(param.detach(), seen.pop(k))
            grad = gradient(param.detach(), k)
            param.grad = grad if param.grad is None else param.grad + grad
            completed = policy.after_backward(k)
            if completed is not None:
                policy.apply_update(completed, step)
        if since == (window + 1) * microbatches:
            policy.expose_latest(window + 1)
            exposed[window + 1] = param.detach().clone()
            if window == resume_at:
                state = policy.state_dict(["w"], window + 1)
                param = torch.nn.Parameter(param.detach().clone())
                policy = make_policy([param])
                policy.load_state_dict(state, ["w"], window + 1)
    return exposed, mismatched


@pytest.mark.parametrize("stages, microbatches, delay", [(4, 1, 3), (4, 2, 2), (5, 2, 2), (3, 4, 1)])
def test_bounded_delay_follows_the_recurrence_across_drains_and_a_resume(stages, microbatches, delay):
    assert gradient_delay(stages, microbatches) == delay
    batches = 9
    expected = recurrence(delay, microbatches, batches)
    exposed, mismatched = drive(lambda params: TwoVersions(params, microbatches, lag=delay), stages, microbatches, batches,
                                drains={3, 5}, resume_at=5)
    assert mismatched == 0  # every backward ran on its forward's version
    assert sorted(exposed) == [4, 6, 9]
    for step, weights in exposed.items():
        torch.testing.assert_close(weights, expected[step], rtol=1e-12, atol=1e-12)
    if delay > 1:
        shorter = recurrence(delay - 1, microbatches, batches)
        assert not torch.allclose(exposed[batches], shorter[batches], rtol=1e-6)
        few, mismatched = drive(lambda params: TooFewVersions(params, microbatches, delay), stages, microbatches, batches, drains={3})
        assert mismatched > 0 and not torch.allclose(few[batches], expected[batches], rtol=1e-6)


def test_a_delay_of_several_steps_keeps_that_many_versions_more():
    params = [torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(4))]
    policy = TwoVersions(params, microbatches=1, lag=3)
    policy.apply_update(0, lambda: None)  # the first update makes every version
    assert policy.extra_bytes() == 3 * (8 * 4 + 4) * 4
    assert len(policy.copies()) == 3 * len(params)


@pytest.mark.parametrize("assignment, message", [
    ("model.family=qwen3_moe", "model.family = 'qwen3_moe'"),
    ("training.sync_start_steps=2", "training.sync_start_steps = 2"),
    ("training.clipping=lagged_global", "training.clipping = 'lagged_global'"),
])
def test_a_delay_of_several_steps_refuses_what_it_does_not_run_yet(capsys, tmp_path, assignment, message):
    code, _, err = cli_in_process(capsys, "train", "--run-dir", str(tmp_path / "run"), *sets(
        "parallelism.pipeline_parallel_schedule=PipeDream2BW", "parallelism.emulated_stages=4",
        "training.local_batch_size=2", "parallelism.pipeline_parallel_microbatch_size=1", assignment))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "2 microbatches per step on 4 stages delays each gradient by d = ceil((stages - 1) / microbatches) = 2 steps" in err
    assert message in err and "or give each step at least 3 microbatches" in err


FOUR_STAGES = 'parallelism.module_fqns_per_model_part=[["tok_embeddings", "layers.0"], ["layers.1"], ["layers.2"], ["layers.3", "norm", "lm_head"]]'


def four_stages_resumed_at_step_4(tmp_path, schedule: str, microbatches: int, data_ranks: int = 1, *assignments: str):
    """PP 4 x FSDP `data_ranks` on 4 x `data_ranks` processes, `microbatches` of 1 sequence per
    data rank and step, stopped at the step-4 checkpoint (its communication log passes the NCCL
    model) and resumed to STEPS."""
    config = "debug_cpu_pp2_fsdp2.toml" if data_ranks > 1 else "debug_cpu_pp2.toml"
    run = pipelined(tmp_path / "run", f"parallelism.pipeline_parallel_schedule={schedule}", "parallelism.pipeline_parallel_degree=4",
                    f"parallelism.data_parallel_shard_degree={data_ranks}", FOUR_STAGES,
                    f"training.local_batch_size={microbatches}", "checkpoint.interval=4",
                    f"lr_scheduler.total_steps={STEPS}", "training.steps=4", *assignments, config=config, nproc=4 * data_ranks)
    nccl_model.assert_nccl_safe(run / "comm", 4, ranks_per_stage=data_ranks, bounded=False)
    run_cli("resume", "--run-dir", str(run), *sets(f"training.steps={STEPS}"), env={"TITAN_ASYNC_BATCH_LOG": str(run / "batches")})
    return run


@pytest.mark.parametrize("microbatches", [1, 2])
def test_2bw_on_four_stages_with_fewer_microbatches_equals_the_independent_reference_across_a_resume(tmp_path, microbatches):
    """PP 4 on 4 processes with m = 1 (d = 3) and m = 2 (d = 2) microbatches per step, stopped at
    the step-4 checkpoint and resumed, against `ref.two_bw` with that delay; the logged global
    norms wait for stage 0's update, d steps after its batch. Controls: the delays d - 1 and
    d + 1, and the update written into the stale version. The run's communication log passes
    the NCCL model and the device replay."""
    delay = gradient_delay(4, microbatches)
    run = four_stages_resumed_at_step_4(tmp_path, "PipeDream2BW", microbatches)
    settings, batches, weights = reference_inputs(run)
    assert len(settings.stages) == 4 and settings.microbatches == microbatches
    update_of_step = lambda step: step
    assert_equal(differences(run, weights, ref.two_bw(settings, batches, delay=delay), update_of_step))
    for control in ({"delay": delay - 1}, {"delay": delay + 1}, {"delay": delay, "variant": "stale"}):
        assert_different(differences(run, weights, ref.two_bw(settings, batches, **control), update_of_step))
    assert {row[f"staleness_max/stage{s}"] for row in metrics(run).values() for s in range(4)} <= {0.0, float(delay)}
    # Uninterrupted long enough to fill the pipeline after the start (d windows) and run steady:
    # no stage waits on another's collective, and each idles as simulated (not at all).
    steady = pipelined(tmp_path / "steady", "parallelism.pipeline_parallel_schedule=PipeDream2BW", "parallelism.pipeline_parallel_degree=4",
                       FOUR_STAGES, f"training.local_batch_size={microbatches}", "training.steps=10", "checkpoint.enable=false", nproc=4)
    nccl_model.assert_nccl_safe(steady / "comm", 4)
    device_replay.assert_flows_as_simulated(steady / "comm", "PipeDream2BW", 4, microbatches=microbatches)


def test_error_feedback_at_a_delay_of_two_steps_equals_the_independent_reference(tmp_path):
    """Muon + EF (c = 1) at `training.gradient_delay = 2`: the correction c d (u_t - u_{t-1})
    extrapolates the updates by the two steps the gradient is late; control: the one-step
    correction (d = 1) at the same delay, and no EF."""
    run = pipelined(tmp_path / "run", "training.gradient_delay=2", "parallelism.data_parallel_shard_degree=1",
                    "optimizer.name=muon", "optimizer.lr=0.02", "optimizer.error_feedback.enabled=true",
                    config="debug_cpu.toml", nproc=1)
    settings, batches, weights = reference_inputs(run)
    assert settings.optimizer == "muon" and settings.error_feedback == 1.0
    assert_equal(differences(run, weights, ref.two_bw(settings, batches, delay=2), lambda step: step))
    for control in ({"ef_delay": 1}, {"error_feedback": False}):
        assert_different(differences(run, weights, ref.two_bw(settings, batches, delay=2, **control), lambda step: step))


@pytest.mark.parametrize("prediction", [0.0, 1.0])
def test_gradient_delay_of_two_steps_equals_the_independent_reference(tmp_path, prediction):
    """`training.gradient_delay = 2` on one process trains the rule of 2BW at d = 2 (the cheap
    stand-in for studies), against `ref.two_bw(delay=2)`, also with weight prediction (h = 1:
    each gradient taken at W[k-2] + 2 (W[k-2] - W[k-3])), across a resume at step 3; controls:
    delays 1 and 3, and the prediction's horizon not scaled by the delay."""
    run = pipelined(tmp_path / "run", "training.gradient_delay=2", "parallelism.data_parallel_shard_degree=1",
                    f"training.weight_prediction={prediction}", f"lr_scheduler.total_steps={STEPS}", "training.steps=3",
                    config="debug_cpu.toml", nproc=1)
    run_cli("resume", "--run-dir", str(run), *sets(f"training.steps={STEPS}"), env={"TITAN_ASYNC_BATCH_LOG": str(run / "batches")})
    settings, batches, weights = reference_inputs(run)
    assert_equal(differences(run, weights, ref.two_bw(settings, batches, delay=2, prediction=prediction), lambda step: step))
    controls = [{"delay": 1, "prediction": prediction}, {"delay": 3, "prediction": prediction}]
    if prediction:
        controls += [{"delay": 2, "prediction": prediction / 2}, {"delay": 2}]
    for control in controls:
        assert_different(differences(run, weights, ref.two_bw(settings, batches, **control), lambda step: step))


def test_delay_rescheduling_divides_the_lr_by_the_delay_fading_out_across_a_resume(tmp_path):
    """`lr_scheduler.delay_rescheduling_steps = K` at `training.gradient_delay = 2`: each lr of
    scheduler step k divided by 2 ** (1 - min(k / K, 1)), the ramp crossing a resume at step 3,
    against `ref.two_bw(delay=2)` with the factor written out; controls: no rescheduling, and the
    ramp divided by the delay 3."""
    run = pipelined(tmp_path / "run", "training.gradient_delay=2", "parallelism.data_parallel_shard_degree=1",
                    f"lr_scheduler.delay_rescheduling_steps={STEPS - 1}", f"lr_scheduler.total_steps={STEPS}", "training.steps=3",
                    config="debug_cpu.toml", nproc=1)
    run_cli("resume", "--run-dir", str(run), *sets(f"training.steps={STEPS}"), env={"TITAN_ASYNC_BATCH_LOG": str(run / "batches")})
    settings, batches, weights = reference_inputs(run)
    assert settings.delay_rescheduling_steps == STEPS - 1
    assert_equal(differences(run, weights, ref.two_bw(settings, batches, delay=2), lambda step: step))
    for control in ({"lr_delay": 1}, {"lr_delay": 3}):
        assert_different(differences(run, weights, ref.two_bw(settings, batches, delay=2, **control), lambda step: step))


def test_delay_rescheduling_refuses_a_synchronous_schedule(capsys, tmp_path):
    code, _, err = cli_in_process(capsys, "train", "--run-dir", str(tmp_path / "run"), *sets(
        "lr_scheduler.delay_rescheduling_steps=10", "parallelism.pipeline_parallel_schedule=1F1B"))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "lr_scheduler.delay_rescheduling_steps = 10" in err and "'1F1B' has none: set it to 0, or use PipeDream2BW or PACI" in err


def test_resume_refuses_a_change_of_the_delay(tmp_path, capsys):
    """Fewer microbatches on resume would need another number of weight versions than the
    checkpoint holds: refused in one line, naming both."""
    run = tmp_path / "run"
    run_cli("train", "--run-dir", str(run), *sets(
        *TINY, "parallelism.pipeline_parallel_schedule=PipeDream2BW", "parallelism.emulated_stages=4",
        "training.local_batch_size=2", "parallelism.pipeline_parallel_microbatch_size=1", "training.steps=2",
        "checkpoint.interval=2", "validation.enable=false"))  # in a process of its own: training sets up loggers
    code, _, err = cli_in_process(capsys, "resume", "--run-dir", str(run), *sets("training.local_batch_size=1", "training.steps=3"))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "a delay of 2 steps (3 weight versions)" in err and "a delay of 3 steps (4 weight versions)" in err


def test_2bw_on_four_stages_with_fsdp_and_one_microbatch_equals_the_independent_reference_across_a_resume(tmp_path):
    """PP 4 x FSDP 2 (8 processes) with one microbatch per data rank and step: d = 3 on the
    sharded versions of stages held gathered, stopped at step 4 and resumed, against
    `ref.two_bw(delay=3)` over both data ranks' batches; controls: the delays 2 and 4."""
    run = four_stages_resumed_at_step_4(tmp_path, "PipeDream2BW", 1, data_ranks=2)
    settings, batches, weights = reference_inputs(run)
    assert len(settings.stages) == 4 and settings.data_ranks == 2 and settings.microbatches == 1
    assert_equal_with_resharded_norms(differences(run, weights, ref.two_bw(settings, batches, delay=3), lambda step: step))
    for delay in (2, 4):
        assert_different(differences(run, weights, ref.two_bw(settings, batches, delay=delay), lambda step: step))


def test_gradient_delay_of_two_steps_with_fsdp_equals_the_independent_reference(tmp_path):
    """`training.gradient_delay = 2` under FSDP 2 (two processes; the versions kept as shards
    that FSDP reshards as configured), across a resume at step 3, against `ref.two_bw(delay=2)`;
    controls: delays 1 and 3."""
    run = pipelined(tmp_path / "run", "training.gradient_delay=2", "parallelism.data_parallel_shard_degree=2",
                    f"lr_scheduler.total_steps={STEPS}", "training.steps=3", config="debug_cpu_fsdp2.toml", nproc=2)
    run_cli("resume", "--run-dir", str(run), *sets(f"training.steps={STEPS}"), env={"TITAN_ASYNC_BATCH_LOG": str(run / "batches")})
    settings, batches, weights = reference_inputs(run)
    assert settings.data_ranks == 2
    assert_equal_with_resharded_norms(differences(run, weights, ref.two_bw(settings, batches, delay=2), lambda step: step))
    for delay in (1, 3):
        assert_different(differences(run, weights, ref.two_bw(settings, batches, delay=delay), lambda step: step))


def test_gradient_delay_of_two_steps_with_fsdp_and_tensor_parallel_equals_the_independent_reference(tmp_path):
    """`training.gradient_delay = 2` on FSDP 2 x TP 2 (four processes: the versions kept as
    shards of the two-dimensional mesh) against `ref.two_bw(delay=2)`; controls: delays 1 and 3."""
    run = pipelined(tmp_path / "run", "training.gradient_delay=2", "parallelism.data_parallel_shard_degree=2",
                    "parallelism.tensor_parallel_degree=2", config="debug_cpu_fsdp2.toml", nproc=4)
    settings, batches, weights = reference_inputs(run)
    assert settings.data_ranks == 2 and settings.tensor_ranks == 2
    assert_equal_with_resharded_norms(differences(run, weights, ref.two_bw(settings, batches, delay=2), lambda step: step))
    for delay in (1, 3):
        assert_different(differences(run, weights, ref.two_bw(settings, batches, delay=delay), lambda step: step))


@pytest.mark.parametrize("microbatches", [1, 2])
def test_paci_on_four_stages_with_fewer_microbatches_equals_the_independent_reference_across_a_resume(tmp_path, microbatches):
    """PACI at p = 4 stepping every a = m backwards, m = 1 and 2: a microbatch of stage 0 crosses
    up to ceil(3 / a) of its stage's local steps (3 and 2) between forward and backward, against
    `ref.paci_stages` across a resume at step 4. Controls: a step one backward late, and the
    backward at the forward's weights (a stash). At m = 1 each stage's lr is also rescheduled by
    its own mean delay (p - 1 - s) / a = 3, 2, 1, 0 (`lr_scheduler.delay_rescheduling_steps`);
    controls: every stage at stage 0's delay, and no rescheduling."""
    rescheduled = ("lr_scheduler.delay_rescheduling_steps=5",) if microbatches == 1 else ()
    run = four_stages_resumed_at_step_4(tmp_path, "PACI", microbatches, 1, *rescheduled)
    settings, batches, weights = reference_inputs(run)
    drains = ref.drain_steps(run)
    assert drains == {4, STEPS} and settings.microbatches == microbatches
    delays = [3.0, 2.0, 1.0, 0.0] if rescheduled else None
    update_of_step = lambda step: step  # a = m: one local step per batch
    assert_equal(differences(run, weights, ref.paci_stages(settings, batches, drains, lr_delays=delays), update_of_step))
    assert_different(differences(run, weights, ref.paci_stages(settings, batches, drains, late=1, lr_delays=delays), update_of_step))
    assert_different(differences(run, weights, ref.paci_stages(settings, batches, drains, backward_weights="forward", lr_delays=delays),
                                 update_of_step))
    if rescheduled:
        for control in ([3.0] * 4, None):
            assert_different(differences(run, weights, ref.paci_stages(settings, batches, drains, lr_delays=control), update_of_step))


@pytest.mark.parametrize("microbatches", [1, 2])
def test_paci_on_four_stages_with_fewer_microbatches_flows_as_simulated(tmp_path, microbatches):
    """PACI at p = 4 with m = a = 1 and 2: stage s crosses up to ceil((p - 1 - s) / a) of its own
    local steps between a microbatch's forward and backward (its rule against the hand-written
    reference: test_pipeline_references.py); its log passes the NCCL model and the device replay."""
    run = pipelined(tmp_path / "run", "parallelism.pipeline_parallel_schedule=PACI", "parallelism.pipeline_parallel_degree=4",
                    FOUR_STAGES, f"training.local_batch_size={microbatches}", "training.steps=10", "checkpoint.enable=false", nproc=4)
    rows = metrics(run)
    assert [rows[10][f"staleness_max/stage{s}"] for s in range(4)] == [float(-(-(3 - s) // microbatches)) for s in range(4)]
    nccl_model.assert_nccl_safe(run / "comm", 4)
    device_replay.assert_flows_as_simulated(run / "comm", "PACI", 4, microbatches=microbatches, accumulation=microbatches)


def test_plan_notes_what_train_refuses_and_the_delay_with_fewer_microbatches_than_stages(capsys):
    """One microbatch per step on 4 stages: torch's 1F1B refuses it, PipeDream2BW runs at d = 3."""
    code, out, err = cli_in_process(capsys, "plan", "--config", str(CONFIGS / "debug_cpu_pp2.toml"), "--gpus-per-node", "4",
                                    "--json", *sets("parallelism.pipeline_parallel_degree=4", "training.local_batch_size=1",
                                                    "parallelism.pipeline_parallel_schedule=PipeDream2BW",
                                                    "parallelism.pipeline_parallel_microbatch_size=1"))
    assert code == 0, err
    plan = json.loads(out)
    notes = {row["name"]: row["note"] for row in plan["schedules"]}
    assert notes["1F1B"].startswith("train refuses it") and notes["GPipe"] == ""
    assert notes["PipeDream2BW"] == "gradient delay 3 steps" and plan["layout"]["gradient_delay"] == 3
    ranks = plan["ranks"]
    weights = [rank["memory"]["weights"] for rank in ranks]
    assert [rank["memory"]["weight_versions"] for rank in ranks] == pytest.approx([3 * w for w in weights])


def test_plan_counts_the_sharded_versions_of_a_delay_of_three_steps_as_its_dry_run_allocates_them(capsys):
    """PP 4 x FSDP 2, one microbatch per step: three side shards of each rank's weights, in the
    estimate and in the dry run of the real policies."""
    code, out, err = cli_in_process(capsys, "plan", "--config", str(CONFIGS / "debug_cpu_pp2_fsdp2.toml"), "--gpus-per-node", "8",
                                    "--json", *sets("parallelism.pipeline_parallel_degree=4", "parallelism.data_parallel_shard_degree=2",
                                                    "training.local_batch_size=1", "parallelism.pipeline_parallel_schedule=PipeDream2BW",
                                                    "parallelism.pipeline_parallel_microbatch_size=1"))
    assert code == 0, err
    plan = json.loads(out)
    for rank in plan["dry_run"]["ranks"]:
        assert rank["weight_policies"] == ["ShardedDelayedVersions"]
        assert rank["allocated"]["weight_versions"] == 3 * rank["allocated"]["weights"] == rank["estimate"]["weight_versions"]


def test_a_delay_of_several_steps_refuses_weight_prediction_under_fsdp():
    """d + 1 versions are predicted on plain parameters only so far: PP 4 x FSDP 2 with one
    microbatch per step and weight prediction is refused before launch, naming the keys and
    the ways out."""
    run = load_run_config(CONFIGS / "debug_cpu_pp2_fsdp2.toml", [
        "parallelism.pipeline_parallel_schedule=PipeDream2BW", "parallelism.pipeline_parallel_degree=4",
        "parallelism.data_parallel_shard_degree=2", "training.local_batch_size=1", "parallelism.pipeline_parallel_microbatch_size=1",
        "training.weight_prediction=1"])
    with pytest.raises(UserError) as refused:
        run.check(8)
    message = str(refused.value)
    assert "\n" not in message and "delays each gradient by d = ceil((stages - 1) / microbatches) = 3 steps" in message
    assert ("training.weight_prediction = 1.0 and FSDP or replicas (parallelism.data_parallel_shard_degree x "
            "data_parallel_replicate_degree = 2) yet: set weight_prediction to 0 or both degrees to 1") in message
    assert message.endswith("or give each step at least 3 microbatches")
    run = load_run_config(CONFIGS / "debug_cpu_pp2_fsdp2.toml", [
        "parallelism.pipeline_parallel_schedule=PipeDream2BW", "parallelism.pipeline_parallel_degree=4",
        "parallelism.data_parallel_shard_degree=2", "training.local_batch_size=1", "parallelism.pipeline_parallel_microbatch_size=1"])
    run.check(8)  # without prediction it runs (test_2bw_on_four_stages_with_fsdp_and_one_microbatch_...)
