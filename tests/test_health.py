"""A non-finite gradient skips the update; past the limit the run stops with a resumable checkpoint."""

from __future__ import annotations

import json

import torch
from torchtitan.distributed.pipeline_parallel import _generate_llm_fqn_per_model_part

from conftest import CONFIGS, TINY, checkpoint_weights, losses, run_cli, sets


def test_nan_gradient_skips_update_then_stops_resumably(tmp_path):
    run = tmp_path / "run"
    result = run_cli(
        "train", "--run-dir", str(run),
        *sets(*TINY, "training.steps=10", "checkpoint.interval=1", "checkpoint.keep_latest_k=0",
              "health.inject_nonfinite_steps=[3]", "health.max_nonfinite_steps=0"),
        check=False,
    )
    assert result.returncode == 3, result.stderr[-3000:]
    assert "non-finite gradients" in result.stdout
    assert json.loads((run / "stopped.json").read_text()) == {"step": 3, "reason": "nonfinite"}
    log = (run / "logs" / "rank0.log").read_text()
    assert "stage 0 (rank 0) has a non-finite gradient" in log
    # Step 3 is a checkpoint step: torchtitan's periodic save wrote it, and the stop saves no second copy.
    assert sorted(p.name for p in (run / "checkpoint").iterdir()) == ["step-1", "step-2", "step-3"]
    assert log.count("Saving the checkpoint.") == 3 and "checkpoint at last step" not in log, log
    before, after = checkpoint_weights(run / "checkpoint" / "step-2"), checkpoint_weights(run / "checkpoint" / "step-3")
    assert all(torch.equal(before[k], after[k]) for k in before)

    run_cli("resume", "--run-dir", str(run), *sets("health.inject_nonfinite_steps=[]", "training.steps=5"))
    assert sorted(losses(run)) == [1, 2, 3, 4, 5]


def test_pipeline_stage_that_saw_it_is_named(tmp_path):
    run = tmp_path / "run"
    run_cli(
        "train", "--config", str(CONFIGS / "debug_cpu_pp2.toml"), "--nproc-per-node", "2", "--run-dir", str(run),
        *sets(*TINY, "training.steps=4", "health.inject_nonfinite_steps=[2]", "health.inject_stage=1"),
    )
    assert "step 2: stage 1 (rank 1) has a non-finite gradient" in (run / "logs" / "rank1.log").read_text()
    assert sorted(losses(run)) == [1, 2, 3, 4]


def test_a_streaming_stage_skips_its_own_update_and_the_run_stops_resumably(tmp_path):
    run = tmp_path / "run"
    result = run_cli(
        "train", "--run-dir", str(run),
        *sets(*TINY, "training.steps=10", "checkpoint.interval=1", "checkpoint.keep_latest_k=0",
              "parallelism.pipeline_parallel_schedule=PipeDream2BW", "parallelism.emulated_stages=2",
              "parallelism.pipeline_parallel_microbatch_size=1",
              "health.inject_nonfinite_steps=[3]", "health.inject_stage=1", "health.max_nonfinite_steps=0"),
        check=False,
    )
    assert result.returncode == 3, result.stderr[-3000:]
    assert json.loads((run / "stopped.json").read_text()) == {"step": 3, "reason": "nonfinite"}
    log = (run / "logs" / "rank0.log").read_text()
    assert "step 3: stage 1 (rank 0) has a non-finite gradient" in log and "stage 0 (rank 0) has a non-finite" not in log
    stages = _generate_llm_fqn_per_model_part(2, 4)  # torchtitan's split of 4 layers into 2 stages
    before, after = checkpoint_weights(run / "checkpoint" / "step-2"), checkpoint_weights(run / "checkpoint" / "step-3")
    for stage, changed in ((0, True), (1, False)):
        names = [k for k in before if k.split(".")[0] in stages[stage] or ".".join(k.split(".")[:2]) in stages[stage]]
        assert names and any(not torch.equal(before[k], after[k]) for k in names) == changed, stage
