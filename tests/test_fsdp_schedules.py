"""Streaming schedules with FSDP2 inside each stage (PP=2 x FSDP=2 on 4 processes)."""

from __future__ import annotations

import pytest

from conftest import CONFIGS, TINY, losses, metrics, run_cli, sets
from test_schedules import STEPS, assert_close_weights, assert_same_run, final_weights

EXACT = (*TINY, f"training.steps={STEPS}", "checkpoint.interval=3", "validation.freq=3", f"lr_scheduler.total_steps={STEPS}")
PP_FSDP = ("--config", str(CONFIGS / "debug_cpu_pp2_fsdp2.toml"), "--nproc-per-node", "4")


def train(run_dir, *assignments, layout=PP_FSDP):
    run_cli("train", *layout, "--run-dir", str(run_dir), *sets(*EXACT, *assignments))
    return run_dir


def test_2bw_with_fsdp_equals_delayed_reference_with_fsdp(tmp_path):
    reference = train(tmp_path / "delay", "training.gradient_delay=1",
                      layout=("--config", str(CONFIGS / "debug_cpu_fsdp2.toml"), "--nproc-per-node", "2"))
    pipelined = train(tmp_path / "2bw", "parallelism.pipeline_parallel_schedule=PipeDream2BW")
    assert_same_run(reference, pipelined)
    assert_close_weights(final_weights(pipelined), final_weights(reference))


def test_paci_with_fsdp_equals_its_emulation_with_fsdp(tmp_path):
    paci = ("parallelism.pipeline_parallel_schedule=PACI", "parallelism.paci.accumulation=2")
    emulated = train(tmp_path / "emulated", *paci, "parallelism.emulated_stages=2",
                     layout=("--config", str(CONFIGS / "debug_cpu_fsdp2.toml"), "--nproc-per-node", "2"))
    pipelined = train(tmp_path / "paci", *paci)
    assert_same_run(emulated, pipelined)
    assert_close_weights(final_weights(pipelined), final_weights(emulated))


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
