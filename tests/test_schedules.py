"""PipeDream2BW and PACI: action order, exactness against the single-process references, resume.

The single-process references here are titan-async's own (`training.gradient_delay = 1`, the
emulated stages): they cover 4 stages, staleness metrics, traces and transport, which the
independent reference (independent_reference.py, 2 stages, test_independent_reference.py) does
not."""

from __future__ import annotations

import json
import math
import re
import shutil

import pytest
import torch

import device_replay
import nccl_model
from conftest import CONFIGS, TINY, checkpoint_weights, cli_in_process, losses, metrics, run_cli, sets
from titan_async.config.run_config import load_run_config
from titan_async.core.errors import UserError
from titan_async.pipeline.actions import drain_actions, pipeline_order, window_actions


def names(actions) -> list[str]:
    return [str(a) for a in actions]


def test_streaming_window_order_p2_m4():
    # stage 0 keeps one microbatch in flight: window 1 starts with batch 1's first forward,
    # then batch 0's tail backward, with no flush in between.
    assert names(window_actions(0, 2, 4, 0)) == ["0F0", "0F1", "0B0", "0F2", "0B1", "0F3", "0B2"]
    assert names(window_actions(0, 2, 4, 1)) == ["0F4", "0B3", "0F5", "0B4", "0F6", "0B5", "0F7", "0B6"]
    assert names(window_actions(1, 2, 4, 1)) == ["1F4", "1B4", "1F5", "1B5", "1F6", "1B6", "1F7", "1B7"]
    assert names(drain_actions(0, 2, 4, 1)) == ["0B7"]
    assert drain_actions(1, 2, 4, 1) == []


@pytest.mark.parametrize("microbatches", [8, 3, 2, 1])  # below 3 = stages - 1 backwards reach back several windows
def test_every_microbatch_runs_forward_then_backward_once_per_stage(microbatches):
    order = pipeline_order(num_stages=4, microbatches=microbatches, windows=5, drain_every=2)
    for rank, actions in order.items():
        done = [str(a) for a in actions]
        assert len(done) == len(set(done)) == 2 * microbatches * 5
        for k in range(5 * microbatches):
            assert done.index(f"{rank}F{k}") < done.index(f"{rank}B{k}")
        in_flight = [len([a for a in actions[:i] if "F" in str(a)]) - len([a for a in actions[:i] if "B" in str(a)])
                     for i in range(len(actions))]
        assert max(in_flight) <= 4 - rank  # w = 3 - rank held, and the forward before a backward


def test_paci_refuses_selective_activation_checkpointing():
    """Selective recomputation would mix PACI's saved and recomputed rules in one backward;
    full recomputation and none run, and 2BW runs with every mode."""
    emulated = ("parallelism.emulated_stages=2", "parallelism.pipeline_parallel_microbatch_size=1")
    paci = ("parallelism.pipeline_parallel_schedule=PACI", *emulated)

    def check(*assignments: str) -> None:
        load_run_config(CONFIGS / "debug_cpu.toml", list(assignments)).check(1)

    with pytest.raises(UserError) as refusal:
        check(*paci, "activation_checkpoint.mode=selective")
    message = str(refusal.value)
    assert "\n" not in message and 'set activation_checkpoint.mode = "full"' in message
    assert "activation_checkpoint.mode = 'selective' cannot run with PACI" in message
    check(*paci, "activation_checkpoint.mode=full")
    check(*paci, "activation_checkpoint.mode=none")
    check("parallelism.pipeline_parallel_schedule=PipeDream2BW", *emulated, "activation_checkpoint.mode=selective")


def test_split_backward_schedules_refuse_selective_activation_checkpointing():
    """torch's split backward (input gradients, then weight gradients through the same nodes)
    fails on a block under torchtitan's selective recomputation; the config refuses the
    combination for each schedule that splits, in one line, and keeps full recomputation."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w1, self.w2 = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.w2(torch.relu(self.w1(x)))

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleDict({"0": Block()})
    SelectiveAC(SelectiveAC.Config()).apply(model)
    x = torch.randn(4, 8, requires_grad=True)
    out = model.layers["0"](x)
    params = list(model.parameters())
    _, groups = stage_backward_input([out], [torch.ones_like(out)], [x], iter(params))
    with pytest.raises(RuntimeError, match="Trying to backward an extra time"):
        stage_backward_weight(iter(params), groups)

    def check(*assignments: str) -> None:
        load_run_config(CONFIGS / "debug_cpu_pp2.toml", ["validation.enable=false", *assignments]).check(2)

    for schedule in ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"):
        chosen = (f"parallelism.pipeline_parallel_schedule={schedule}", "parallelism.pipeline_parallel_microbatch_size=1")
        with pytest.raises(UserError) as refusal:
            check(*chosen, "activation_checkpoint.mode=selective")
        message = str(refusal.value)
        assert "\n" not in message and f"activation_checkpoint.mode = 'selective' cannot run with {schedule}" in message
        check(*chosen, "activation_checkpoint.mode=full")


def test_split_backward_schedules_turn_off_donated_buffers(monkeypatch):
    """torch's default lets a compiled backward donate its buffers, and then refuses to run it a
    second time, which the weight half of a split backward does (tools/gpu/bench_split_backward.py
    met it on a GPU with FlexAttention, on the CPU with compiled blocks): a split schedule turns the
    donation off and warns what compiled blocks cost; other schedules leave torch's setting."""
    import torch._functorch.config as functorch_config

    from titan_async.pipeline.config import prepare_split_backward

    monkeypatch.setattr(functorch_config, "donated_buffer", True)
    assert prepare_split_backward("1F1B", compiled=True) is None and functorch_config.donated_buffer
    assert prepare_split_backward("PipeDream2BW", compiled=True) is None and functorch_config.donated_buffer
    assert prepare_split_backward("ZBVZeroBubble", compiled=False) is None and not functorch_config.donated_buffer
    monkeypatch.setattr(functorch_config, "donated_buffer", True)
    warning = prepare_split_backward("dualpipev", compiled=True)
    assert not functorch_config.donated_buffer and "(I + W) / B = 2.14" in warning


@pytest.mark.parametrize(
    "assignment, message",
    [
        ("parallelism.pipeline_parallel_schedule=Zigzag", "unknown schedule; valid names are 1F1B, GPipe"),
        ("parallelism.paci.accumulation=0", "parallelism.paci.accumulation: expected a positive integer, got 0"),
        ("training.gradient_delay=17", "training.gradient_delay: expected an integer in [0, 16], got 17"),
        ("training.clipping=global", "training.clipping must be one of 'per_stage', 'lagged_global', got 'global'"),
        ("training.weight_prediction=-1", "training.weight_prediction: expected a number >= 0, got -1.0"),
        ("training.weight_prediction=1 parallelism.pipeline_parallel_schedule=1F1B", "parallelism.pipeline_parallel_schedule = '1F1B' has no delay"),
        ("training.weight_prediction=1 training.sync_start_steps=2", "training.weight_prediction does not run with training.sync_start_steps yet"),
        ("checkpoint.async_mode=async", "checkpoint.async_mode = 'async' cannot run with PipeDream2BW"),
        ("checkpoint.async_mode=async_with_pinned_mem", "checkpoint.async_mode = 'async_with_pinned_mem' cannot run with"),
    ],
)
def test_bad_schedule_settings(capsys, tmp_path, assignment, message):
    from titan_async import cli

    schedule = "PACI" if "paci" in assignment else "PipeDream2BW"
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--config", str(CONFIGS / "debug_cpu_pp2.toml"), "--nproc-per-node", "2",
                  "--run-dir", str(tmp_path / "run"), *sets(f"parallelism.pipeline_parallel_schedule={schedule}", *assignment.split())])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and message in err and len(err.splitlines()) == 1, err


def test_lagged_global_clipping_is_refused_where_a_step_has_its_global_norm(capsys, tmp_path):
    from titan_async import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--config", str(CONFIGS / "debug_cpu_pp2.toml"), "--nproc-per-node", "2",
                  "--run-dir", str(tmp_path / "run"), *sets("parallelism.pipeline_parallel_schedule=1F1B", "training.clipping=lagged_global")])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and "training.clipping = 'lagged_global' is for the streaming schedules" in err, err
    assert len(err.splitlines()) == 1, err


def test_streaming_schedule_rejects_context_parallel_stages(capsys, tmp_path):
    from titan_async import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--config", str(CONFIGS / "debug_cpu_pp2_fsdp2.toml"), "--nproc-per-node", "4",
                  "--run-dir", str(tmp_path / "run"),
                  *sets("parallelism.pipeline_parallel_schedule=PACI", "parallelism.data_parallel_shard_degree=1",
                        "parallelism.context_parallel_degree=2")])
    assert exit_info.value.code == 2
    assert "'PACI' does not support parallelism.context_parallel_degree > 1" in capsys.readouterr().err


STEPS = 6
EXACT = (*TINY, "training.local_batch_size=8", f"training.steps={STEPS}", "checkpoint.interval=3", "validation.freq=3")


def train(run_dir, *assignments, nproc="1", config="debug_cpu.toml"):
    """Train; every rank's communication is logged under run_dir/comm for the NCCL model."""
    run_cli("train", "--config", str(CONFIGS / config), "--nproc-per-node", nproc, "--run-dir", str(run_dir),
            *sets(*EXACT, *assignments), env={"TITAN_ASYNC_COMM_LOG": str(run_dir / "comm"), "TITAN_ASYNC_STREAM_MODEL": "1"})
    return run_dir


def final_weights(run_dir) -> dict[str, torch.Tensor]:
    return checkpoint_weights(run_dir / "checkpoint" / f"step-{STEPS}")


def assert_same_run(a, b, rel=1e-5, norm_rel=1e-4):
    """The same losses and validation losses (within `rel`) and global gradient norms (within
    `norm_rel`) at every logged step. A norm is a float32 sum of squares that FSDP shards, TP,
    EP and replicas associate differently from one whole tensor (measured up to 5.5e-5 relative);
    a stage's norm in place of the global one is off by percents."""
    for kind in ("train", "validation"):
        first, second = metrics(a, kind), metrics(b, kind)
        keys = {"loss_metrics/global_avg_loss": rel, "grad_norm": norm_rel} if kind == "train" else {"validation_metrics/loss": rel}
        assert sorted(first) == sorted(second)
        for step in first:
            for key, tolerance in keys.items():
                # a skipped update's norm is NaN in both
                assert second[step][key] == pytest.approx(first[step][key], rel=tolerance, nan_ok=True), (kind, step, key)


@pytest.fixture(scope="module")
def delayed_reference(tmp_path_factory):
    return train(tmp_path_factory.mktemp("delay") / "run", "training.gradient_delay=1")


@pytest.mark.parametrize("stages", [2, 4])
def test_2bw_equals_delayed_gradient_reference(tmp_path, capsys, delayed_reference, stages):
    run = train(tmp_path / "run", "parallelism.pipeline_parallel_schedule=PipeDream2BW",
                f"parallelism.pipeline_parallel_degree={stages}", "parallelism.pipeline_parallel_microbatch_size=1",
                nproc=str(stages), config="debug_cpu_pp2.toml")
    assert_same_run(delayed_reference, run)  # global grad norms included
    assert all(row[f"staleness/stage{s}"] == row[f"staleness_max/stage{s}"] == 1.0 for row in metrics(run).values()
               for s in range(stages))  # every 2BW gradient is one optimizer step old
    assert f"sqrt({stages}) x 1 = {math.sqrt(stages):.4g}" in (run / "logs" / "rank0.log").read_text()  # the clipping notice
    reference, pipelined = final_weights(delayed_reference), final_weights(run)
    assert_close_weights(pipelined, reference)
    nccl_model.assert_nccl_safe(run / "comm", stages)  # windows, drains, validation and checkpoints
    device_replay.assert_flows_as_simulated(run / "comm", "PipeDream2BW", stages, microbatches=8)
    # The control: the stop agreement as main ran it on CUDA (an all-reduce over every stage,
    # waited on the compute stream at once) stalls each stage at each step boundary.
    as_before = device_replay.replay(device_replay.with_immediate_world_waits(nccl_model.read_logs(run / "comm")), lambda rank: rank)
    assert {rank for rank, _ in map(stall_rank_and_step, as_before.stalls)} == set(range(stages - 1)), as_before.stalls
    assert_plan_bounds_transport(capsys, run, stages)


def stall_rank_and_step(stall: str) -> tuple[int, int]:
    rank, step = re.match(r"rank (\d+), step (\d+)", stall).groups()
    return int(rank), int(step)


def assert_plan_bounds_transport(capsys, run, stages: int) -> None:
    """`plan` of the run's own config shows at least the point-to-point buffers the run held."""
    _, out, _ = cli_in_process(capsys, "plan", "--config", str(run / "config.toml"), "--gpus-per-node", str(stages), "--json")
    planned = json.loads(out)["ranks"]
    for rank, records in nccl_model.read_logs(run / "comm").items():
        measured = nccl_model.live_bytes(records)
        assert 0 < measured <= planned[rank]["memory"]["p2p_buffers"], (rank, measured, planned[rank]["memory"])


def assert_close_weights(result: dict, reference: dict, rel: float = 1e-5) -> None:
    """Every tensor within `rel` relative (norm of the difference over the reference's norm)."""
    assert result.keys() == reference.keys() and len(reference) > 10
    for key in reference:
        difference = (result[key] - reference[key]).norm() / reference[key].norm()
        assert difference < rel, (key, float(difference))


@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B"])
def test_synchronous_schedule_equals_no_pipeline(tmp_path, schedule):
    plain = train(tmp_path / "plain")
    pipelined = train(tmp_path / "pp", "parallelism.pipeline_parallel_microbatch_size=1", f"parallelism.pipeline_parallel_schedule={schedule}",
                      nproc="2", config="debug_cpu_pp2.toml")
    assert_same_run(plain, pipelined)
    nccl_model.assert_nccl_safe(pipelined / "comm", 2, bounded=False)  # torch's own schedule: the control


def test_delay_changes_the_trajectory(tmp_path, delayed_reference):
    plain = train(tmp_path / "plain")
    assert losses(plain)[1] == pytest.approx(losses(delayed_reference)[1], rel=1e-6)
    assert losses(plain)[STEPS] != pytest.approx(losses(delayed_reference)[STEPS], rel=1e-4)


def test_trace_shows_streaming_order(tmp_path):
    run = train(tmp_path / "run", "parallelism.pipeline_parallel_schedule=PipeDream2BW", "metrics.pipeline_trace=true",
                "parallelism.pipeline_parallel_microbatch_size=2", "checkpoint.enable=false", "validation.enable=false",
                nproc="2", config="debug_cpu_pp2.toml")
    expected = pipeline_order(num_stages=2, microbatches=4, windows=STEPS)
    for rank in (0, 1):
        events = json.loads((run / "pipeline" / f"trace_rank{rank}.json").read_text())["traceEvents"]
        computed = [e["name"] for e in sorted(events, key=lambda e: e["ts"]) if "O" not in e["name"]]
        assert computed == names(expected[rank])
    assert (run / "pipeline" / "trace.json").is_file() and (run / "pipeline" / "timeline.png").is_file()


@pytest.mark.parametrize("schedule, stages", [("PipeDream2BW", 2), ("PACI", 4)])
def test_streaming_schedule_equals_its_single_process_emulation(tmp_path, schedule, stages):
    common = (f"parallelism.pipeline_parallel_schedule={schedule}", "parallelism.pipeline_parallel_microbatch_size=1")
    pipelined = train(tmp_path / "pp", *common, f"parallelism.pipeline_parallel_degree={stages}", nproc=str(stages), config="debug_cpu_pp2.toml")
    emulated = train(tmp_path / "emulated", *common, f"parallelism.emulated_stages={stages}")
    assert_same_run(emulated, pipelined)
    if (schedule, stages) == ("PACI", 4):
        assert_paci_staleness(pipelined, stages, microbatches=8)
    assert_close_weights(final_weights(pipelined), final_weights(emulated))
    nccl_model.assert_nccl_safe(pipelined / "comm", stages)
    device_replay.assert_flows_as_simulated(pipelined / "comm", schedule, stages, microbatches=8)


def assert_paci_staleness(run, stages: int, microbatches: int) -> None:
    """PACI with a local step every `microbatches` backwards: in a steady window stage s holds
    p - 1 - s microbatches in flight, each of which one local step crosses, so its delays
    average (p - 1 - s) / m and reach 1 (0 on the last stage). Steady windows here: the steps
    that neither start the stream nor follow its drain at step 3."""
    rows = metrics(run)
    for step in (3, 5, 6):
        for s in range(stages):
            assert rows[step][f"staleness/stage{s}"] == pytest.approx((stages - 1 - s) / microbatches), (step, s)
            assert rows[step][f"staleness_max/stage{s}"] == (1.0 if s < stages - 1 else 0.0), (step, s)


def test_paci_accumulation_changes_the_update_timing(tmp_path):
    common = ("parallelism.pipeline_parallel_schedule=PACI", "parallelism.pipeline_parallel_microbatch_size=1", "parallelism.emulated_stages=2")
    every_batch = train(tmp_path / "a8", *common)
    twice_a_batch = train(tmp_path / "a4", *common, "parallelism.paci.accumulation=4")
    assert losses(every_batch)[2] != pytest.approx(losses(twice_a_batch)[2], rel=1e-6)


def test_paci_resume_inside_an_accumulation_is_exact(tmp_path):
    """With a = 5 the checkpoint at step 3 falls inside an accumulation (3 x 8 backwards % 5 = 4).
    (PipeDream2BW's resume on PP 2 is checked against the independent reference in test_batch_ramp.py.)"""
    common = ("parallelism.pipeline_parallel_schedule=PACI", "parallelism.pipeline_parallel_microbatch_size=1",
              f"lr_scheduler.total_steps={STEPS}", "parallelism.paci.accumulation=5")
    full = train(tmp_path / "full", *common, nproc="2", config="debug_cpu_pp2.toml")
    split = train(tmp_path / "split", *common, "training.steps=3", nproc="2", config="debug_cpu_pp2.toml")
    run_cli("resume", "--run-dir", str(split), *sets(f"training.steps={STEPS}"))
    assert_same_run(full, split, rel=1e-6)


def test_2bw_resumes_exactly_from_its_first_step_checkpoint(tmp_path):
    """The first-step checkpoint, a save torchtitan decides on its own, is drained like the others."""
    full = train(tmp_path / "full", "parallelism.pipeline_parallel_schedule=PipeDream2BW",
                 "parallelism.pipeline_parallel_microbatch_size=1", "optimizer.name=muon",
                 "checkpoint.enable_first_step_checkpoint=true", "checkpoint.keep_latest_k=0",
                 "validation.enable=false",  # validating at step 1 would drain it anyway
                 nproc="2", config="debug_cpu_pp2.toml")
    split = shutil.copytree(full, tmp_path / "split")
    for step in (3, STEPS):
        shutil.rmtree(split / "checkpoint" / f"step-{step}")
    result = run_cli("resume", "--run-dir", str(split))
    assert "from step-1" in result.stdout
    assert_same_run(full, split, rel=1e-6)


def test_2bw_with_muon_and_error_feedback_trains(tmp_path):
    run = train(tmp_path / "run", "training.local_batch_size=8", nproc="2", config="debug_cpu_pp2_2bw.toml")
    logged = metrics(run, "validation")
    assert logged[STEPS]["validation_metrics/loss"] < logged[1]["validation_metrics/loss"] - 0.05
    assert "Muon" in (run / "optimizer_groups.txt").read_text()
    # Each optimizer's learning rate under its own name, not one ErrorFeedback key hiding the other:
    # the config's peaks (0.02, 3e-3) on the same schedule, half of them at step 1 of a 2-step warm-up.
    train_rows = metrics(run, "train")
    assert not [key for row in train_rows.values() for key in row if key.startswith("lr/ErrorFeedback")]
    assert train_rows[1]["lr/Muon"] == pytest.approx(0.01) and train_rows[1]["lr/AdamW"] == pytest.approx(1.5e-3)
    for row in train_rows.values():
        assert row["lr/Muon"] / row["lr/AdamW"] == pytest.approx(0.02 / 3e-3)
