"""Resume is exact: stop after a checkpoint, resume, and get the uninterrupted run's losses."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from conftest import CONFIGS, REPO, TINY, losses, metrics, run_cli, sets

STEPS = 6
EXACT = sets(*TINY, f"lr_scheduler.total_steps={STEPS}", "checkpoint.interval=3")


@pytest.mark.parametrize(
    "config, nproc",
    [("debug_cpu.toml", "1"), ("debug_cpu_pp2.toml", "2")],
    ids=["single-process", "pp2-1f1b"],
)
def test_resume_matches_uninterrupted_run(tmp_path, config, nproc):
    common = ("--config", str(CONFIGS / config), "--nproc-per-node", nproc, *EXACT)
    run_cli("train", "--run-dir", str(tmp_path / "full"), *common, *sets(f"training.steps={STEPS}"))
    run_cli("train", "--run-dir", str(tmp_path / "split"), *common, *sets("training.steps=3"))
    assert (tmp_path / "split" / "checkpoint" / "step-3" / ".metadata").is_file()
    resumed = run_cli("resume", "--run-dir", str(tmp_path / "split"), *sets(f"training.steps={STEPS}"))
    assert "from step-3" in resumed.stdout

    full, split = losses(tmp_path / "full"), losses(tmp_path / "split")
    assert sorted(full) == sorted(split) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert split[step] == pytest.approx(full[step], rel=1e-6, abs=0), step
    assert full[STEPS] < full[1]


def test_sigterm_saves_a_resumable_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-m", "titan_async.cli", "train", "--run-dir", str(run_dir), *sets(*TINY, "training.steps=400")],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    deadline = time.monotonic() + 300
    while not ((run_dir / "metrics.jsonl").is_file() and len(metrics(run_dir)) >= 3):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 130, err[-3000:]

    stopped = json.loads((run_dir / "stopped.json").read_text())["step"]
    assert 3 <= stopped < 400
    assert f"stopped at step {stopped}" in out
    assert (run_dir / "checkpoint" / f"step-{stopped}" / ".metadata").is_file()

    run_cli("resume", "--run-dir", str(run_dir), *sets(f"training.steps={stopped + 2}"))
    assert max(losses(run_dir)) == stopped + 2
    assert not (run_dir / "stopped.json").exists()


@pytest.fixture(scope="module")
def two_step_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("two_steps") / "run"
    run_cli("train", "--run-dir", str(run_dir), *sets(*TINY, "training.steps=2"))
    return run_dir


@pytest.mark.parametrize(
    "assignment, key",
    [
        ("optimizer.name=muon", "optimizer.name"),
        ("optimizer.error_feedback.enabled=true", "optimizer.error_feedback.enabled"),
        ("training.gradient_delay=1", "training.gradient_delay"),
        ("training.clipping=lagged_global", "training.clipping"),
        ("training.weight_prediction=1", "training.weight_prediction"),
    ],
)
def test_resume_refuses_settings_the_checkpoint_has_no_state_for(two_step_run, capsys, assignment, key):
    from titan_async import cli

    run_dir = two_step_run
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["resume", "--run-dir", str(run_dir), *sets("training.steps=4", assignment)])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and key in err and "start a new run" in err and len(err.splitlines()) == 1, err
    assert sorted(p.name for p in (run_dir / "checkpoint").iterdir()) == ["step-2"]


def test_a_run_or_resume_that_diverges_does_not_exit_0(tmp_path):
    # eps = 0: AdamW's first update of an embedding row that saw no token is 0/0 (NaN).
    run_dir = tmp_path / "run"
    result = run_cli("train", "--run-dir", str(run_dir), *sets(*TINY, "training.steps=2", "optimizer.eps=0"), check=False)
    assert result.returncode == 3, result.stderr[-3000:]
    assert "titan-async: warning: the validation loss at step 2 is nan: the model diverged" in result.stderr
    result = run_cli("resume", "--run-dir", str(run_dir), *sets("training.steps=3"), check=False)
    assert result.returncode == 3, result.stderr[-3000:]
    assert "titan-async: warning: the validation loss at step 3 is nan: the model diverged" in result.stderr
