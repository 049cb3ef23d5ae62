"""Sync Start (`training.sync_start_steps = N`): steps 1..N synchronous, then the streaming
schedule as if it started from the weights after step N. CLI runs, PP 2 on 2 gloo processes,
the tiniest model, N = 3 of 6 steps, checkpoints at steps 2, 4 and 6 (one before the switch,
one after).

The synchronous baseline is the same config under torch's 1F1B, which clips the global gradient
norm; so do the synchronous steps of a Sync Start (drained: the global norm exists), while after
the switch each stage clips its own. `training.max_norm` = MAX_NORM clips the synchronous step
with the largest global norm (step 2, ~0.87) and none after the switch (each below ~0.82): the
synchronous steps test the global clip, and the delayed rule (`training.gradient_delay = 1`, one
model: the global clip at every step) still computes 2BW's updates. The later steps are checked against
`independent_reference.two_bw(sync_start=N)` and `paci(sync_start=N)` (a = m and a = 3), which
import nothing from titan_async, to 1e-5 relative (as tests/test_independent_reference.py), and
a reference that switches one step late (or never) must not match."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import independent_reference as ref
from conftest import CONFIGS, TINY, checkpoint_weights, cli_in_process, losses, metrics, run_cli, sets
from titan_async.pipeline.versions import LocalAccumulation, TwoVersions

N = 3
STEPS = 6
M, A = 4, 3
"""Microbatches per step (TINY's local batch of 4, microbatches of 1), and the PACI run's local accumulation."""
MAX_NORM = 0.85
SETTINGS = (*TINY, f"training.steps={STEPS}", f"lr_scheduler.total_steps={STEPS}", "checkpoint.interval=2",
            "validation.enable=false", f"training.max_norm={MAX_NORM}", "parallelism.pipeline_parallel_microbatch_size=1")
SYNC_START = (f"training.sync_start_steps={N}",)


def train(run_dir: Path, *assignments: str, config: str = "debug_cpu_pp2.toml", nproc: int = 2) -> Path:
    run_cli("train", "--config", str(CONFIGS / config), "--nproc-per-node", str(nproc), "--run-dir", str(run_dir),
            *sets(*SETTINGS, *assignments), env={"TITAN_ASYNC_BATCH_LOG": str(run_dir / "batches")})
    return run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """The 2BW and PACI (a = m, a = 3) runs with Sync Start, the synchronous (1F1B) baseline, and in one
    process with Sync Start: the delayed rule (`training.gradient_delay = 1`) and PACI's emulation."""
    root = tmp_path_factory.mktemp("sync_start")
    return {
        "2bw": train(root / "2bw", "parallelism.pipeline_parallel_schedule=PipeDream2BW", *SYNC_START),
        "paci": train(root / "paci", "parallelism.pipeline_parallel_schedule=PACI", *SYNC_START),
        "paci_a3": train(root / "paci_a3", "parallelism.pipeline_parallel_schedule=PACI", f"parallelism.paci.accumulation={A}",
                         *SYNC_START),
        "1f1b": train(root / "1f1b", "parallelism.pipeline_parallel_schedule=1F1B"),
        "delay": train(root / "delay", "training.gradient_delay=1", *SYNC_START, config="debug_cpu.toml", nproc=1),
        "emulated_paci": train(root / "emulated_paci", "parallelism.pipeline_parallel_schedule=PACI", "parallelism.emulated_stages=2",
                               *SYNC_START, config="debug_cpu.toml", nproc=1),
    }


def differences(run: Path, result: ref.Result, update_of_step=lambda step: step) -> dict[str, float]:
    """The largest relative difference from `result` of the per-step losses, the logged global
    gradient norms (the row of step t holds the norm of update `update_of_step(t)`, the last that
    applies only batches up to t - 1: t for 2BW and for PACI with a = m) and the final weights
    (per tensor, over the run's norm)."""
    weights = checkpoint_weights(run / "checkpoint" / f"step-{STEPS}")
    logged = metrics(run)
    assert sorted(logged) == sorted(result.losses) == list(range(1, STEPS + 1))
    return {
        "loss": max(abs(result.losses[step] / row["loss_metrics/global_avg_loss"] - 1) for step, row in logged.items()),
        "grad_norm": max(abs(result.global_norm(update_of_step(step)) / row["grad_norm"] - 1) for step, row in logged.items()),
        "weights": max(float((result.weights[k] - weights[k]).norm() / weights[k].norm()) for k in weights),
    }


def assert_equal(found: dict[str, float]) -> None:
    print("reference:", found)
    assert max(found.values()) < 1e-5, found


def assert_different(found: dict[str, float]) -> None:
    """A control: far from the run, not within rounding of it."""
    print("control:", found)
    assert found["loss"] > 1e-4 and found["weights"] > 1e-3, found


def reference_inputs(run: Path):
    weights = checkpoint_weights(run / "checkpoint" / f"step-{STEPS}")
    settings = ref.read_settings(run, vocab_size=weights["tok_embeddings.weight"].shape[0])
    return settings, ref.read_batches(run / "batches", settings)


def test_max_norm_clips_a_synchronous_step_and_none_after_the_switch(runs):
    """The premise of the tests below, on the logged global norms (before clipping): 1F1B clips a
    synchronous step (else the global clip would go untested), and 2BW clips neither the global
    norm nor a stage's own after the switch (else the delayed rule, which clips the global norm
    at every step, would not compute 2BW's updates)."""
    synchronous, two_bw = metrics(runs["1f1b"]), metrics(runs["2bw"])
    assert max(synchronous[step]["grad_norm"] for step in range(1, N + 1)) > MAX_NORM
    assert max(two_bw[step]["grad_norm"] for step in range(N + 1, STEPS + 1)) < MAX_NORM


@pytest.mark.parametrize("schedule", ["2bw", "paci", "paci_a3"])
def test_the_first_steps_equal_the_synchronous_run(runs, schedule):
    """Bit for bit: the same microbatches accumulate in the same order, and the synchronous steps
    clip the same global norm (summed over the stages as torchtitan sums it). The last step
    differs: the run did switch. (PACI's step N + 2 is synchronous too: on 2 stages with a = m
    its stream drained at the checkpoint of step N + 1.)"""
    sync_start, synchronous = losses(runs[schedule]), losses(runs["1f1b"])
    print({step: (sync_start[step], synchronous[step]) for step in range(1, STEPS + 1)})
    assert [sync_start[step] for step in range(1, N + 1)] == [synchronous[step] for step in range(1, N + 1)]
    assert sync_start[STEPS] != synchronous[STEPS]


def test_2bw_follows_the_reference_that_switches_at_step_n(runs):
    run = runs["2bw"]
    settings, batches = reference_inputs(run)
    assert_equal(differences(run, ref.two_bw(settings, batches, sync_start=N)))
    for control in (N + 1, 0):
        assert_different(differences(run, ref.two_bw(settings, batches, sync_start=control)))


def test_2bw_with_fsdp_follows_the_reference(tmp_path):
    """PP 2 x FSDP 2 (4 processes): the sharded versions (`ShardedTwoVersions`) step their shard
    in place and reshard while synchronous; the reference trains on both data ranks' batches.
    Gradient norms to 1e-4: FSDP's two shards sum the squares in another order (see
    tests/test_independent_reference.py's FSDP test)."""
    run = train(tmp_path / "run", "parallelism.pipeline_parallel_schedule=PipeDream2BW", *SYNC_START,
                config="debug_cpu_pp2_fsdp2.toml", nproc=4)
    settings, batches = reference_inputs(run)
    assert settings.data_ranks == 2
    found = differences(run, ref.two_bw(settings, batches, sync_start=N))
    print("reference:", found)
    assert found["loss"] < 1e-5 and found["weights"] < 1e-5 and found["grad_norm"] < 1e-4, found
    assert_different(differences(run, ref.two_bw(settings, batches, sync_start=N + 1)))


@pytest.mark.parametrize("run_name, a, controls", [("paci", M, (0,)), ("paci_a3", A, (N + 1, 0))])
def test_paci_follows_the_reference_that_switches_at_step_n(runs, run_name, a, controls):
    """`independent_reference.paci(sync_start=N)`: one step per batch and a drain after each of
    steps 1..N, then a step every `a` backwards counted from the switch. Controls: no Sync Start,
    and (for a != m) a switch one step late; with a = m that one is the run itself, whose stream
    drained at the checkpoint of step N + 1 anyway."""
    run = runs[run_name]
    settings, batches = reference_inputs(run)
    assert settings.accumulation in (None, a) and settings.microbatches == M
    drains = ref.drain_steps(run)
    update_of_step = lambda step: step if step <= N else N + (step - N) * M // a
    assert_equal(differences(run, ref.paci(settings, batches, drains, sync_start=N), update_of_step))
    for control in controls:
        assert_different(differences(run, ref.paci(settings, batches, drains, sync_start=control), update_of_step))


@pytest.mark.parametrize("single, pipelined", [("delay", "2bw"), ("emulated_paci", "paci")])
def test_the_single_process_rules_switch_alike(runs, single, pipelined):
    """`training.gradient_delay = 1` against the pipelined 2BW run, PACI's single-process
    emulation against the pipelined PACI run, all with Sync Start: the same batches (the delayed
    rule takes each in one forward instead of 4 microbatches: float32 sums in another order)."""
    expected, found = losses(runs[pipelined]), losses(runs[single])
    difference = max(abs(found[step] / expected[step] - 1) for step in expected)
    print(f"{single}:", difference)
    assert sorted(found) == sorted(expected) and difference < 1e-5


def test_staleness_is_zero_in_the_synchronous_steps(runs):
    rows = metrics(runs["2bw"])
    for stage in (0, 1):
        assert [rows[step][f"staleness_max/stage{stage}"] for step in range(1, N + 1)] == [0.0] * N
        assert [rows[step][f"staleness/stage{stage}"] for step in range(N + 2, STEPS + 1)] == [1.0] * (STEPS - N - 1)


def test_resume_before_and_after_the_switch_is_exact(runs, tmp_path, capsys):
    """Stopped at step 2 (before the switch) and at step 4 (after it), resumed each time; resume
    refuses to move the switch."""
    split = train(tmp_path / "split", "parallelism.pipeline_parallel_schedule=PipeDream2BW", *SYNC_START,
                  "training.steps=2")
    status, _, err = cli_in_process(capsys, "resume", "--run-dir", str(split), *sets("training.steps=4", f"training.sync_start_steps={N + 1}"))
    assert status == 2 and "resume cannot switch training.sync_start_steps from 3" in err and len(err.strip().splitlines()) == 1, err
    for steps in (4, STEPS):
        resumed = run_cli("resume", "--run-dir", str(split), *sets(f"training.steps={steps}"))
        assert f"from step-{steps - 2}" in resumed.stdout
    full, parts = losses(runs["2bw"]), losses(split)
    assert sorted(parts) == list(range(1, STEPS + 1))
    assert parts == full


def test_report_shows_sync_start_and_staleness_per_stage(runs, capsys):
    status, out, err = cli_in_process(capsys, "report", "--run-dir", str(runs["2bw"]))
    assert status == 0, err
    page = (runs["2bw"] / "report" / "report.html").read_text()
    assert f"steps 1..{N} synchronous (the stream drained after each), then PipeDream2BW on 2 stages" in page
    assert "staleness.png" in page and (runs["2bw"] / "report" / "staleness.png").is_file()
    for stage in (0, 1):
        assert f"staleness/stage{stage}" in page and f"staleness_max/stage{stage}" in page


def test_plan_shows_sync_start(capsys):
    status, out, err = cli_in_process(capsys, "plan", "--config", str(CONFIGS / "debug_cpu_pp2.toml"), "--gpus-per-node", "2",
                                      *sets("parallelism.pipeline_parallel_schedule=PipeDream2BW", *SYNC_START))
    assert status == 0, err
    assert f"sync start: steps 1..{N} synchronous (the stream drained after each), then PipeDream2BW" in out


def parameters() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(4))]


def test_two_versions_update_in_place_until_the_switch():
    """Batches 0..N-1 update the live weights in place (no second buffer, also not for a
    checkpoint); batches N and N+1 both run on W[N], and the update of batch N is written
    into a second buffer while batch N+1 still reads W[N]."""
    params = [torch.nn.Parameter(torch.zeros(8, 4)), torch.nn.Parameter(torch.zeros(4))]  # sums of ones: exact
    start = [p.detach().clone() for p in params]
    policy = TwoVersions(params, microbatches=1, sync_start=N)

    def add_one() -> None:
        for p in params:
            p.data.add_(1.0)

    def holds(offset: float) -> bool:
        return all(torch.equal(p, s + offset) for p, s in zip(params, start))

    for batch in range(N):
        policy.activate(batch)
        assert holds(batch)
        policy.apply_update(batch, add_one)
        assert policy.state_dict(["a", "b"], batch + 1)["a"].equal(start[0] + batch + 1)
    assert policy.extra_bytes() == 0 and policy.updates == N
    for batch in (N, N + 1):
        policy.activate(batch)
        assert holds(N)
    policy.apply_update(N, add_one)
    assert holds(N + 1) and policy.extra_bytes() == sum(p.numel() * 4 for p in params)
    policy.activate(N + 1)
    assert holds(N)


def test_paci_steps_once_per_batch_until_the_switch_then_every_a():
    m, a = 4, 3
    policy = LocalAccumulation(parameters(), accumulation=a, microbatches=m, sync_start=N)
    completed = {count: policy.after_backward(count - 1) for count in range(1, N * m + 4 * a + 1)}
    steps = [count for count, update in completed.items() if update is not None]
    assert steps == [m * (b + 1) for b in range(N)] + [N * m + a * (u + 1) for u in range(4)]
    assert [completed[count] for count in steps] == list(range(1, N + 5))
    assert [policy.update_of_batch(b) for b in range(N + 2)] == [*range(1, N + 1), N + m // a, N + 2 * m // a]
    policy.load_state_dict(policy.state_dict(["a", "b"], N + 1), ["a", "b"], N + 1)
    assert policy.updates == N + 4
