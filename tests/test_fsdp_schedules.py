"""Streaming schedules with FSDP2 inside each stage (PP=2 x FSDP=2 on 4 processes).

Both schedules under FSDP equal the independent reference (independent_reference.py) in
test_independent_reference.py. The comparisons here are with titan-async's own references,
`training.gradient_delay = 1` on FSDP 2 and the single-process-per-data-rank emulation, for what
they add: torchtitan's step metrics over the data ranks, the device-time replay of the 2BW run,
and the emulation itself (a user-facing mode); also W&B and the bytes FSDP moves. Resume under
FSDP is checked against the independent reference (PACI, 2BW with weight prediction) and by
test_replicas_and_accumulation.py (2BW's shards on a replicate mesh)."""

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
    run_cli("train", *layout, "--run-dir", str(run_dir), *sets(*EXACT, *assignments), env={"TITAN_ASYNC_COMM_LOG": str(run_dir / "comm"), "TITAN_ASYNC_STREAM_MODEL": "1"})
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
    """Also: with every stage in one process (FSDP 2, emulated stages) rank 0 alone writes, as
    "stage 0", the scalars summed over its stages."""
    paci = ("parallelism.pipeline_parallel_schedule=PACI", "parallelism.paci.accumulation=2")
    emulated = train(tmp_path / "emulated", *paci, "parallelism.emulated_stages=2",
                     layout=("--config", str(CONFIGS / "debug_cpu_fsdp2.toml"), "--nproc-per-node", "2"))
    pipelined = train(tmp_path / "paci", *paci)
    assert_same_run(emulated, pipelined)
    assert_close_weights(final_weights(pipelined), final_weights(emulated))
    nccl_model.assert_nccl_safe(pipelined / "comm", stages=2, ranks_per_stage=2)
    assert sorted(p.name for p in (emulated / "pipeline").iterdir()) == ["stage0.jsonl"]
    rows = stage_records(emulated)[0]
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)) and {r["rank"] for r in rows} == {0}


SHARED = (*TINY, "training.steps=6", "lr_scheduler.total_steps=6", "validation.enable=false", "checkpoint.enable=false")
OFFLINE = ("metrics.enable_wandb=true", "metrics.wandb_mode=offline")
WANDB = {"PipeDream2BW": OFFLINE, "PACI": (*OFFLINE, "metrics.wandb_rank_runs=true")}


@pytest.fixture(scope="module")
def schedule_runs(tmp_path_factory) -> dict:
    """1F1B, PipeDream2BW and PACI (a = m = 4) under PP 2 x FSDP 2 on the same data for 6 steps,
    no drain before the last step (W&B offline for the streaming two): shared by the byte counts
    and by the streaming runs' comparison with synchronous training."""
    root = tmp_path_factory.mktemp("schedules")
    return {schedule: train(root / schedule, *SHARED, f"parallelism.pipeline_parallel_schedule={schedule}", *WANDB.get(schedule, ()))
            for schedule in ("1F1B", "PipeDream2BW", "PACI")}


@pytest.mark.parametrize("config", ["debug_cpu_pp2_paci.toml", "debug_cpu_pp2_2bw.toml"], ids=["paci-adamw", "2bw-muon-ef"])
def test_streaming_schedule_with_fsdp_trains(tmp_path, config, schedule_runs):
    """The config's schedule on PP 2 x FSDP 2 (its optimizer: AdamW for PACI, Muon with error
    feedback for 2BW), validating (draining) at steps 1, 3 and 6 and saving at 3 and 6, against
    the rules worked out by hand for p = 2, m = 4 microbatches:
    - step 1 runs the initial weights on the same data as 1F1B: 1F1B's loss;
    - 2BW: step 2's forward still runs the initial weights (batch 1's update lands a step late,
      whatever the optimizer): the loss of the AdamW 2BW run at step 2, not 1F1B's; every gradient
      one optimizer step old (staleness 1 on both stages at every step);
    - PACI, a = m = 4: the drain at step 1 applies stage 0's last local update before step 2, so
      step 2 is 1F1B's; from step 3 on stage 0's first microbatch of each window runs forward
      before the update of the previous window's last backward, and the losses leave 1F1B's. Its
      delays: in a steady window (steps 3, 5, 6: after neither the stream's start nor a drain)
      stage 0 crosses one update in 4 microbatches, (p - 1 - s) / a = 1/4, at most 1; the last
      stage none; the windows after a start or drain (1, 2, 4) none on either stage."""
    run = tmp_path / "run"
    run_cli("train", "--config", str(CONFIGS / config), "--nproc-per-node", "4", "--run-dir", str(run),
            *sets(*EXACT, "training.local_batch_size=4", "parallelism.pipeline_parallel_microbatch_size=1",
                  "parallelism.data_parallel_shard_degree=2"))
    validation = metrics(run, "validation")
    assert validation[STEPS]["validation_metrics/loss"] < validation[1]["validation_metrics/loss"]

    trained, synchronous, rows = losses(run), losses(schedule_runs["1F1B"]), metrics(run)
    assert sorted(trained) == sorted(synchronous) == list(range(1, STEPS + 1))
    assert trained[1] == pytest.approx(synchronous[1], rel=1e-5)
    staleness = {step: {key: value for key, value in row.items() if key.startswith("staleness")} for step, row in rows.items()}
    if "2bw" in config:
        assert trained[2] == pytest.approx(losses(schedule_runs["PipeDream2BW"])[2], rel=1e-5)
        delayed_from = 2
        expected = {step: {f"{key}/stage{s}": 1.0 for key in ("staleness", "staleness_max") for s in (0, 1)} for step in rows}
    else:
        assert trained[2] == pytest.approx(synchronous[2], rel=1e-5)
        delayed_from = 3
        steady = {"staleness/stage0": 0.25, "staleness_max/stage0": 1.0, "staleness/stage1": 0.0, "staleness_max/stage1": 0.0}
        expected = {step: steady if step in (3, 5, 6) else dict.fromkeys(steady, 0.0) for step in rows}
    for step in range(delayed_from, STEPS + 1):
        assert trained[step] != pytest.approx(synchronous[step], rel=1e-6), step  # deterministic: step 1 agrees to 1e-5 and better
    assert staleness == expected
    if "paci" in config:  # the shared PACI run never drains before its last step: delayed from step 2, steady from step 2
        undrained = metrics(schedule_runs["PACI"])
        assert losses(schedule_runs["PACI"])[2] != pytest.approx(synchronous[2], rel=1e-6)
        assert [undrained[step]["staleness/stage0"] for step in range(1, 7)] == [0.0] + [0.25] * 5


def test_float8_emulated_2bw_with_fsdp_tracks_float32(tmp_path):
    common = ("parallelism.pipeline_parallel_schedule=PipeDream2BW", "training.steps=10", "validation.enable=false",
              "checkpoint.enable=false", "lr_scheduler.total_steps=10")
    full_precision = train(tmp_path / "fp32", *common)
    float8 = train(tmp_path / "fp8", *common, "model.float8=rowwise")
    assert "Swapped to Float8Linear" in (float8 / "logs" / "rank0.log").read_text()
    reference, emulated = losses(full_precision), losses(float8)
    assert sorted(reference) == sorted(emulated) == list(range(1, 11))
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


def test_streaming_schedules_move_the_fsdp_bytes_of_1f1b_as_planned_and_2bw_keeps_one_shard_copy(capsys, schedule_runs):
    """Under PP 2 x FSDP 2 a streaming stage gathers and reduces once per update, as torch's 1F1B
    does once per step: all-gather + reduce-scatter bytes per step of each stage's first rank
    within 1.3x of 1F1B's (measured by counting FSDP's collectives) and within 10% of what `plan`
    predicts; 2BW keeps one copy of the stage's shard, whose size the plan's dry run measures on a
    fake process group. Ranks 0 and 2 alone write the stages' scalars, and W&B (offline) has one
    run for the job by default (2BW), one more per stage with `metrics.wandb_rank_runs` (PACI)."""
    settings = SHARED
    per_step, records = {}, {}
    for schedule, run in schedule_runs.items():
        assert_one_writer_per_stage(run, writers=[0, 2])
        records[schedule] = stage_records(run)
        per_step[schedule] = {
            stage: statistics.median(r["fsdp_all_gather_bytes"] + r["fsdp_reduce_scatter_bytes"] for r in rows)
            for stage, rows in records[schedule].items()
        }
    for schedule, suffixes in (("PipeDream2BW", [""]), ("PACI", ["", "-stage0", "-stage1"])):
        run_id = json.loads((schedule_runs[schedule] / "launch.json").read_text())["run_id"]
        assert sorted(p.name for p in schedule_runs[schedule].rglob("run-*.wandb")) == sorted(f"run-{run_id}{s}.wandb" for s in suffixes)
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
