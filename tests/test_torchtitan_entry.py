"""titan-async's schedules from torchtitan's own entry point: `torchtitan.train` with
`--module titan_async.native --config pipedream_2bw` (through the CPU wrapper), under torch's own
launcher, trains like `titan-async train` on the same shipped config."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO, fresh_environment, losses, metrics, run_cli, sets

STEPS = 5


def test_torchtitan_train_runs_pipedream_2bw_like_titan_async_train(tmp_path):
    native = tmp_path / "native"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "-m", "titan_async.native.train", "--module", "titan_async.native", "--config", "pipedream_2bw",
         "--training.steps", str(STEPS), "--dump_folder", str(native)],
        capture_output=True, text=True, timeout=600, cwd=REPO, env=fresh_environment(),
    )
    assert result.returncode == 0, result.stderr[-5000:]
    ours = tmp_path / "ours"
    run_cli("train", "--config", "debug_cpu_pp2_2bw", "--nproc-per-node", "2", "--run-dir", str(ours), *sets(f"training.steps={STEPS}"))
    expected = losses(ours)
    assert sorted(expected) == list(range(1, STEPS + 1))
    assert losses(native) == expected
    validation = {step: row["validation_metrics/loss"] for step, row in metrics(ours, "validation").items()}
    assert validation and {step: row["validation_metrics/loss"] for step, row in metrics(native, "validation").items()} == validation
    assert all("pipeline/bubble" in row for row in metrics(native).values())  # the streaming schedule ran
