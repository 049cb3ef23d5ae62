"""`train` and `resume` refuse a run whose per-rank peak (plan's estimate) exceeds the memory each
rank has, in one line with exit status 2, before anything is allocated or written;
`--skip-memory-check` starts it anyway; a worker torchrun started without titan-async's launcher
checks itself. TITAN_ASYNC_MEMORY_AVAILABLE_GIB makes the memory there is deterministic."""

from __future__ import annotations

import os
import resource
import subprocess
import sys

from conftest import CONFIGS, REPO, TINY, cli_in_process, fresh_environment, metrics, run_cli, sets

from titan_async.commands.plan.command import make_plan
from titan_async.cluster.estimate import Cluster
from titan_async.config.run_config import load_run_config

GIB = 2**30
TINY_RUN = [*TINY, "training.steps=1", "validation.enable=false", "metrics.enable_tensorboard=false"]
TOO_BIG = ["parallelism.pipeline_parallel_degree=1", "parallelism.pipeline_parallel_schedule=1F1B", "data.tokenizer="]


def _cap_address_space() -> None:
    """The child's address space capped at 8 GiB: were the check missing, the 1B model's
    allocation would fail there instead of taking the machine's memory."""
    resource.setrlimit(resource.RLIMIT_AS, (8 * GIB, 8 * GIB))


def test_a_run_that_cannot_fit_is_refused_in_one_line_before_it_allocates(tmp_path):
    run_dir = tmp_path / "big"
    command = [sys.executable, "-m", "titan_async.cli", "train", "--config", str(CONFIGS / "1b_2bw_muon.toml"),
               "--run-dir", str(run_dir), *sets(*TOO_BIG)]
    env = {k: v for k, v in fresh_environment().items() if k != "TITAN_ASYNC_MEMORY_AVAILABLE_GIB"}
    child = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, preexec_fn=_cap_address_space)
    _, status, usage = os.wait4(child.pid, 0)  # this child's own peak RSS (one line of output fits the pipes)
    stderr = child.stderr.read()
    child.stdout.close(), child.stderr.close()
    assert os.waitstatus_to_exitcode(status) == 2, stderr[-3000:]
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("titan-async: ") and "GiB at its peak" in lines[0], lines[0]
    assert "activation_checkpoint.mode=full" in lines[0] and "--skip-memory-check" in lines[0], lines[0]
    assert not run_dir.exists()  # nothing written: no checkpoint, no metrics
    assert usage.ru_maxrss * 1024 < 2 * GIB  # Linux reports KiB


def _estimate(config_sets: list[str]) -> int:
    """plan's peak for one CPU process, as `titan-async plan` computes it (the independent reference)."""
    run = load_run_config(CONFIGS / "debug_cpu.toml", config_sets)
    return make_plan(run, Cluster.parse(1, 1, "80GiB"), gpu=False)["peak_bytes"]


def test_the_refusal_flips_exactly_at_plans_estimate(tmp_path, capsys, monkeypatch):
    peak = _estimate(TINY_RUN)
    below, above = tmp_path / "below", tmp_path / "above"
    monkeypatch.setenv("TITAN_ASYNC_MEMORY_AVAILABLE_GIB", repr((peak - 1) / GIB))  # one byte short
    status, _, err = cli_in_process(capsys, "train", "--config", "debug_cpu", "--run-dir", str(below), *sets(*TINY_RUN))
    assert status == 2 and len(err.splitlines()) == 1, err
    assert f"needs about {peak / GIB:.3g} GiB" in err and "activation_checkpoint.mode=full" in err
    assert not below.exists()
    run_cli("train", "--config", "debug_cpu", "--run-dir", str(above), *sets(*TINY_RUN),
            env={"TITAN_ASYNC_MEMORY_AVAILABLE_GIB": repr(peak / GIB)})  # exactly the estimate: it fits
    assert list(metrics(above)) == [1]


def test_skip_memory_check_starts_the_run_and_resume_and_a_torchrun_worker_check_too(tmp_path, capsys, monkeypatch):
    run_dir, tiny = tmp_path / "run", {"TITAN_ASYNC_MEMORY_AVAILABLE_GIB": "0.0001"}
    started = run_cli("train", "--config", "debug_cpu", "--run-dir", str(run_dir), "--skip-memory-check",
                      *sets(*TINY_RUN), env=tiny)
    assert list(metrics(run_dir)) == [1], started.stderr[-3000:]

    monkeypatch.setenv("TITAN_ASYNC_MEMORY_AVAILABLE_GIB", "0.0001")
    status, _, err = cli_in_process(capsys, "resume", "--run-dir", str(run_dir), *sets("training.steps=2"))
    assert status == 2 and len(err.splitlines()) == 1, err
    assert "has 0.0001 GiB" in err and "--skip-memory-check" in err and 2 not in metrics(run_dir)

    # A worker that torchrun started directly (python -m titan_async.run.worker RUN_DIR) checks before it builds.
    worker_env = {**fresh_environment(), **tiny, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                  "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29577"}
    worker = subprocess.run([sys.executable, "-m", "titan_async.run.worker", str(run_dir)], cwd=REPO, env=worker_env,
                            capture_output=True, text=True, timeout=300)
    assert worker.returncode == 2, worker.stderr[-3000:]
    assert worker.stderr.splitlines()[-1].startswith("titan-async: ") and "GiB at its peak" in worker.stderr
    assert 2 not in metrics(run_dir)
