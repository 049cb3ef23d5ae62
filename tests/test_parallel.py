"""The shipped parallel configs train on CPU with gloo: FSDP=2 and PP=2 x FSDP=2."""

from __future__ import annotations

import math

import pytest

from conftest import CONFIGS, TINY, losses, run_cli, sets


@pytest.mark.parametrize(
    "config, nproc",
    [("debug_cpu_fsdp2.toml", "2"), ("debug_cpu_pp2_fsdp2.toml", "4")],
    ids=["fsdp2", "pp2-x-fsdp2"],
)
def test_parallel_config_trains(tmp_path, config, nproc):
    run_dir = tmp_path / "run"
    run_cli("train", "--config", str(CONFIGS / config), "--nproc-per-node", nproc, "--run-dir", str(run_dir),
            *sets(*TINY, "training.steps=8", "training.local_batch_size=2"))
    logged = losses(run_dir)
    assert sorted(logged) == list(range(1, 9))
    assert all(math.isfinite(v) for v in logged.values())
    assert logged[8] < logged[1] - 0.2, logged
    assert (run_dir / "checkpoint" / "step-8" / ".metadata").is_file()
