"""Two torchrun agents ("nodes") with 2 workers each join through c10d rendezvous on loopback
and train the PP=2 x FSDP=2 debug config, as the Slurm and Kubernetes launchers run it; the
launcher's checks run once per node, on its local rank 0."""

from __future__ import annotations

import collections
import os
import re
import signal
import socket
import subprocess
import sys

import pytest

from conftest import CONFIGS, REPO, TINY, metrics, sets

STEPS = 4
TIMEOUT_S = 240
COUNTED_CALLS = REPO / "tests" / "counted_calls"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent(port: int, run_dir, calls) -> subprocess.Popen:
    """One node's torchrun agent; c10d assigns node ranks in rendezvous order (--node-rank is for static rendezvous)."""
    command = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "2", "--nproc-per-node", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-node-test",
        "--rdzv-conf", "join_timeout=120",
        "-m", "titan_async.cli", "train", "--config", str(CONFIGS / "debug_cpu_pp2_fsdp2.toml"), "--run-dir", str(run_dir),
        *sets(*TINY, f"training.steps={STEPS}", "training.local_batch_size=2"),
    ]
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(COUNTED_CALLS), os.environ.get("PYTHONPATH")])),
               TITAN_ASYNC_TEST_CALLS=str(calls))
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def test_two_agents_train_pp2_x_fsdp2_through_c10d_rendezvous(tmp_path):
    """Also: each node's local rank 0 alone makes the launcher's checks, plan's memory estimate
    (`check_fits`) and the trainer config's, and its other worker goes on with their outcome: every
    call is counted by tests/counted_calls, and every worker builds its trainer config once to train."""
    port, run_dir, calls = free_port(), tmp_path / "run", tmp_path / "calls.txt"
    agents = [agent(port, run_dir, calls) for _ in range(2)]
    try:
        outputs = [a.communicate(timeout=TIMEOUT_S)[0] for a in agents]
    except subprocess.TimeoutExpired:
        for a in agents:
            os.killpg(a.pid, signal.SIGKILL)
        pytest.fail(f"the two agents did not finish within {TIMEOUT_S} s")
    for a, output in zip(agents, outputs):
        assert a.returncode == 0, output[-5000:]

    # a worker's line may follow another's unfinished one in the agent's shared output
    lines = [re.findall(r"rank (\d)/4 \(local rank (\d)\) on node (\d) ", output) for output in outputs]
    workers = sorted((int(rank), int(local), int(node)) for found in lines for rank, local, node in found)
    assert workers == [(0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)], outputs
    assert all(len({node for *_, node in found}) == 1 for found in lines), "each agent is one node"

    assert sorted(metrics(run_dir)) == list(range(1, STEPS + 1))
    assert (run_dir / "checkpoint" / f"step-{STEPS}" / ".metadata").is_file()

    counted = collections.Counter(calls.read_text().splitlines())
    assert counted == {"0 titan_async.cluster.fits.check_fits": 1, "2 titan_async.cluster.fits.check_fits": 1,
                       "0 titan_async.config.assemble.trainer_config": 2, "2 titan_async.config.assemble.trainer_config": 2,
                       "1 titan_async.config.assemble.trainer_config": 1, "3 titan_async.config.assemble.trainer_config": 1,
                       "0 titan_async.rundir.checkpoints.resume_point": 1}, counted  # the worker of rank 0 picks the checkpoint


def test_local_rank_0s_failed_check_is_every_workers_one_line(tmp_path):
    """A check that fails on local rank 0 (the memory estimate, against 1 MiB said to be there)
    fails the node's other worker with the same line, without its own check (counted)."""
    calls = tmp_path / "calls.txt"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "titan_async.cli", "train", "--config", str(CONFIGS / "debug_cpu.toml"), "--run-dir", str(tmp_path / "run"),
               *sets(*TINY, "training.steps=1")]
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(COUNTED_CALLS), os.environ.get("PYTHONPATH")])),
               TITAN_ASYNC_TEST_CALLS=str(calls), TITAN_ASYNC_MEMORY_AVAILABLE_GIB=str(1 / 1024))
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    said = [line for line in result.stderr.splitlines() if line.startswith("titan-async: ")]
    assert result.returncode != 0 and len(said) == 2 and said[0] == said[1], result.stderr[-3000:]
    assert "needs about" in said[0] and "or start anyway with --skip-memory-check" in said[0]
    assert calls.read_text().splitlines() == ["0 titan_async.config.assemble.trainer_config", "0 titan_async.cluster.fits.check_fits"]
    assert not (tmp_path / "run").exists()


def test_resume_checks_once_per_node(tmp_path):
    """resume under torchrun: local rank 0 alone scans the checkpoints and makes the launch checks;
    their failure (the memory estimate, against 1 MiB said to be there) is the other worker's line."""
    run_dir, calls = tmp_path / "run", tmp_path / "calls.txt"
    subprocess.run([sys.executable, "-m", "titan_async.cli", "train", "--run-dir", str(run_dir),
                    *sets(*TINY, "training.steps=1", "validation.enable=false")], cwd=REPO, check=True, capture_output=True,
                   timeout=TIMEOUT_S)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "titan_async.cli", "resume", "--run-dir", str(run_dir), *sets("training.steps=2")]
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(COUNTED_CALLS), os.environ.get("PYTHONPATH")])),
               TITAN_ASYNC_TEST_CALLS=str(calls), TITAN_ASYNC_MEMORY_AVAILABLE_GIB=str(1 / 1024))
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    said = [line for line in result.stderr.splitlines() if line.startswith("titan-async: ")]
    assert result.returncode != 0 and len(said) == 2 and said[0] == said[1] and "needs about" in said[0], result.stderr[-3000:]
    assert calls.read_text().splitlines() == ["0 titan_async.rundir.checkpoints.resume_point",
                                              "0 titan_async.config.assemble.trainer_config",
                                              "0 titan_async.cluster.fits.check_fits"]
