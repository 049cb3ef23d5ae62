"""Streaming schedules with FSDP2 inside each stage (PP=2 x FSDP=2 on 4 processes)."""

from __future__ import annotations

import json
import statistics

import pytest

import device_replay
import nccl_model
from conftest import CONFIGS, TINY, cli_in_process, losses, metrics, run_cli, sets
from test_schedules import STEPS, assert_close_weights, assert_same_run, final_weights

EXACT = (*TINY, f"training.steps={STEPS}", "checkpoint.interval=3", "validation.freq=3", f"lr_scheduler.total_steps={STEPS}")
PP_FSDP = ("--config", str(CONFIGS / "debug_cpu_pp2_fsdp2.toml"), "--nproc-per-node", "4")


def train(run_dir, *assignments, layout=PP_FSDP):
    """Train; every rank's communication is logged under run_dir/comm for the NCCL model."""
    run_cli("train", *layout, "--run-dir", str(run_dir), *sets(*EXACT, *assignments), env={"TITAN_ASYNC_COMM_LOG": str(run_dir / "comm")})
    return run_dir


def test_2bw_with_fsdp_equals_delayed_reference_with_fsdp(tmp_path):
    reference = train(tmp_path / "delay", "training.gradient_delay=1",
                      layout=("--config", str(CONFIGS / "debug_cpu_fsdp2.toml"), "--nproc-per-node", "2"))
    pipelined = train(tmp_path / "2bw", "parallelism.pipeline_parallel_schedule=PipeDream2BW")
    assert_same_run(reference, pipelined)
    assert_same_step_metrics(reference, pipelined)
    assert_close_weights(final_weights(pipelined), final_weights(reference))
    nccl_model.assert_nccl_safe(pipelined / "comm", stages=2, ranks_per_stage=2)  # FSDP's collectives and the pipeline's sends
    device_replay.assert_flows_as_simulated(pipelined / "comm", "PipeDream2BW", stages=2, microbatches=4, ranks_per_stage=2)


def assert_same_step_metrics(reference, run) -> None:
    """torchtitan's own step metrics over the data ranks (the reference's) in `run` too: the
    largest data rank's mean loss and the tokens every data rank has seen."""
    expected, found = metrics(reference), metrics(run)
    for step, row in expected.items():
        assert found[step]["n_tokens_seen"] == row["n_tokens_seen"], step
        assert found[step]["loss_metrics/global_max_loss"] == pytest.approx(row["loss_metrics/global_max_loss"], rel=1e-5), step
    assert any(row["loss_metrics/global_max_loss"] > row["loss_metrics/global_avg_loss"] for row in expected.values())


def test_paci_with_fsdp_equals_its_emulation_with_fsdp(tmp_path):
    paci = ("parallelism.pipeline_parallel_schedule=PACI", "parallelism.paci.accumulation=2")
    emulated = train(tmp_path / "emulated", *paci, "parallelism.emulated_stages=2",
                     layout=("--config", str(CONFIGS / "debug_cpu_fsdp2.toml"), "--nproc-per-node", "2"))
    pipelined = train(tmp_path / "paci", *paci)
    assert_same_run(emulated, pipelined)
    assert_close_weights(final_weights(pipelined), final_weights(emulated))
    nccl_model.assert_nccl_safe(pipelined / "comm", stages=2, ranks_per_stage=2)


@pytest.mark.parametrize("schedule", ["PipeDream2BW", "PACI"])
def test_streaming_schedule_with_fsdp_resumes_exactly(tmp_path, schedule):
    common = (f"parallelism.pipeline_parallel_schedule={schedule}", "parallelism.paci.accumulation=2")
    full = train(tmp_path / "full", *common)
    split = train(tmp_path / "split", *common, "training.steps=3")
    run_cli("resume", "--run-dir", str(split), *sets(f"training.steps={STEPS}"))
    assert_same_run(full, split, rel=1e-6)


@pytest.mark.parametrize("config", ["debug_cpu_pp2_paci.toml", "debug_cpu_pp2_2bw.toml"], ids=["paci-adamw", "2bw-muon-ef"])
def test_streaming_schedule_with_fsdp_trains(tmp_path, config):
    run = tmp_path / "run"
    run_cli("train", "--config", str(CONFIGS / config), "--nproc-per-node", "4", "--run-dir", str(run),
            *sets(*EXACT, "training.local_batch_size=4", "parallelism.pipeline_parallel_microbatch_size=1",
                  "parallelism.data_parallel_shard_degree=2"))
    validation = metrics(run, "validation")
    assert validation[STEPS]["validation_metrics/loss"] < validation[1]["validation_metrics/loss"]


def test_float8_emulated_2bw_with_fsdp_tracks_float32(tmp_path):
    common = ("parallelism.pipeline_parallel_schedule=PipeDream2BW", "training.steps=20", "validation.enable=false",
              "checkpoint.enable=false", "lr_scheduler.total_steps=20")
    full_precision = train(tmp_path / "fp32", *common)
    float8 = train(tmp_path / "fp8", *common, "model.float8=rowwise")
    assert "Swapped to Float8Linear" in (float8 / "logs" / "rank0.log").read_text()
    reference, emulated = losses(full_precision), losses(float8)
    assert sorted(reference) == sorted(emulated) == list(range(1, 21))
    for step in reference:
        assert abs(emulated[step] - reference[step]) <= 0.02 * reference[step], step
    assert emulated != reference


def stage_records(run_dir) -> dict[int, list[dict]]:
    """Pipeline stage -> the per-step pipeline scalars its first rank wrote."""
    return {
        int(path.stem.removeprefix("stage")): [json.loads(line) for line in path.read_text().splitlines()]
        for path in sorted((run_dir / "pipeline").glob("stage*.jsonl"))
    }


def assert_one_writer_per_stage(run_dir, writers: list[int]) -> None:
    """Stage s's scalars come from rank writers[s] alone, once per step: no per-rank file, one
    TensorBoard folder per stage."""
    records = stage_records(run_dir)
    assert {stage: {r["rank"] for r in rows} for stage, rows in records.items()} == {s: {w} for s, w in enumerate(writers)}
    for rows in records.values():
        assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    assert sorted(p.name for p in (run_dir / "pipeline").iterdir()) == [f"stage{s}.jsonl" for s in range(len(writers))]
    assert sorted(p.name for p in (run_dir / "tb" / "pipeline").iterdir()) == [f"stage{s}" for s in range(len(writers))]


def test_streaming_schedules_move_the_fsdp_bytes_of_1f1b_as_planned_and_2bw_keeps_one_shard_copy(tmp_path, capsys):
    """Under PP 2 x FSDP 2 a streaming stage gathers and reduces once per update, as torch's 1F1B
    does once per step: all-gather + reduce-scatter bytes per step of each stage's first rank
    within 1.3x of 1F1B's (measured by counting FSDP's collectives) and within 10% of what `plan`
    predicts; 2BW keeps one copy of the stage's shard, whose size the plan's dry run measures on a
    fake process group. Ranks 0 and 2 alone write the stages' scalars, and W&B (offline) has one
    run for the job by default (2BW), one more per stage with `metrics.wandb_rank_runs` (PACI)."""
    settings = (*TINY, "training.steps=6", "lr_scheduler.total_steps=6", "validation.enable=false", "checkpoint.enable=false")
    offline = ("metrics.enable_wandb=true", "metrics.wandb_mode=offline")
    wandb = {"PipeDream2BW": offline, "PACI": (*offline, "metrics.wandb_rank_runs=true")}
    per_step, records = {}, {}
    for schedule in ("1F1B", "PipeDream2BW", "PACI"):
        run = train(tmp_path / schedule, *settings, f"parallelism.pipeline_parallel_schedule={schedule}", *wandb.get(schedule, ()))
        assert_one_writer_per_stage(run, writers=[0, 2])
        records[schedule] = stage_records(run)
        per_step[schedule] = {
            stage: statistics.median(r["fsdp_all_gather_bytes"] + r["fsdp_reduce_scatter_bytes"] for r in rows)
            for stage, rows in records[schedule].items()
        }
    for schedule, suffixes in (("PipeDream2BW", [""]), ("PACI", ["", "-stage0", "-stage1"])):
        run_id = json.loads((tmp_path / schedule / "launch.json").read_text())["run_id"]
        assert sorted(p.name for p in (tmp_path / schedule).rglob("run-*.wandb")) == sorted(f"run-{run_id}{s}.wandb" for s in suffixes)
    assert sorted(per_step["1F1B"]) == [0, 1] and all(per_step["1F1B"].values())
    for schedule in ("PipeDream2BW", "PACI"):
        for stage, moved in per_step[schedule].items():
            assert moved <= 1.3 * per_step["1F1B"][stage], (schedule, stage, moved, per_step["1F1B"][stage])

    code, out, _ = cli_in_process(capsys, "plan", "--config", str(CONFIGS / "debug_cpu_pp2_fsdp2.toml"), "--gpus-per-node", "4",
                                  *sets(*settings, "parallelism.pipeline_parallel_schedule=PipeDream2BW"), "--json")
    assert code == 0
    plan = json.loads(out)
    predicted = {row["name"]: row["ranks"] for row in plan["communication"]}
    for schedule, stages in per_step.items():
        for stage, moved in stages.items():
            expected = predicted[schedule][stage]
            assert abs(moved / (expected["all_gather"] + expected["reduce_scatter"]) - 1) <= 0.1, (schedule, stage, moved, predicted[schedule])

    compared = []
    for dry in plan["dry_run"]["ranks"]:
        rows = records["PipeDream2BW"][dry["pp_rank"]]
        if dry["rank"] != rows[0]["rank"]:
            continue  # not its stage's writer
        shard = dry["allocated"]["weights"]
        assert dry["allocated"]["weight_versions"] == dry["estimate"]["weight_versions"] == shard
        measured = max(r["weight_versions_gib"] for r in rows) * 2**30
        assert abs(measured - shard) <= 1e-6 * shard, dry["rank"]
        compared.append(dry["rank"])
    assert compared == [0, 2]
