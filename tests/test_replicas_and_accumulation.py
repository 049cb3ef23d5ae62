"""Streaming schedules with data-parallel replicas inside each stage (DDP), and with gradient
accumulation.

PACI and PipeDream2BW with DDP replicas and with HSDP (replicas x FSDP) and Muon, and both
with accumulation are checked against the independent reference in test_independent_reference.py. Accumulated local batches form one batch of
the stream, so accumulating two equals one pass of twice the local batch.
"""

from __future__ import annotations

import pytest

from conftest import CONFIGS, cli_in_process, losses, run_cli, sets
from test_fsdp_schedules import train
from test_schedules import STEPS, assert_close_weights, assert_same_run, final_weights

FSDP2 = ("--config", str(CONFIGS / "debug_cpu_fsdp2.toml"), "--nproc-per-node", "2")
PP2_REPLICAS2 = ("--config", str(CONFIGS / "debug_cpu_pp2_fsdp2.toml"), "--nproc-per-node", "4")
REPLICAS = ("parallelism.data_parallel_shard_degree=1", "parallelism.data_parallel_replicate_degree=2")


@pytest.mark.parametrize("assignments, named", [
    (["parallelism.data_parallel_shard_degree=-1", "parallelism.data_parallel_replicate_degree=3"],
     "parallelism.data_parallel_replicate_degree (3)"),
    (["parallelism.data_parallel_shard_degree=1", "parallelism.data_parallel_replicate_degree=2", "training.global_batch_size=12"],
     "training.global_batch_size (12)"),
])
def test_a_bad_replica_layout_is_one_line_naming_the_keys(tmp_path, capsys, assignments, named):
    status, out, err = cli_in_process(capsys, "train", *PP2_REPLICAS2, "--run-dir", str(tmp_path / "run"), *sets(*assignments))
    assert status == 2 and named in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


def test_paci_accumulating_two_local_batches_equals_one_pass_of_twice_the_local_batch(tmp_path):
    """PACI's `accumulation` counts local backwards (microbatches); left unset it is every
    microbatch of the step, the accumulated local batches' included. (PipeDream2BW's accumulation
    is checked against the independent reference, test_independent_reference.py.)"""
    pp2 = ("--config", str(CONFIGS / "debug_cpu_pp2.toml"), "--nproc-per-node", "2")
    common = ("parallelism.pipeline_parallel_schedule=PACI", "parallelism.pipeline_parallel_microbatch_size=1",
              "validation.enable=false")
    accumulated = train(tmp_path / "accumulated", *common, "training.local_batch_size=2", "training.global_batch_size=4", layout=pp2)
    single = train(tmp_path / "single", *common, "training.local_batch_size=4", layout=pp2)
    assert losses(accumulated) == pytest.approx(losses(single), rel=1e-6)
    assert_close_weights(final_weights(accumulated), final_weights(single))


def test_2bw_with_replicas_and_accumulation_resumes_exactly(tmp_path):
    """PP 2 x replicas 2, two local batches accumulated per step: a run stopped at a checkpoint and
    resumed equals the uninterrupted one (data position, both weight versions, optimizer state)."""
    common = ("parallelism.pipeline_parallel_schedule=PipeDream2BW", *REPLICAS, "training.local_batch_size=2",
              "training.global_batch_size=8", "parallelism.pipeline_parallel_microbatch_size=1")
    full = train(tmp_path / "full", *common, layout=PP2_REPLICAS2)
    split = train(tmp_path / "split", *common, "training.steps=3", layout=PP2_REPLICAS2)
    run_cli("resume", "--run-dir", str(split), *sets(f"training.steps={STEPS}"))
    assert_same_run(full, split, rel=1e-6)
