"""Two torchrun agents ("nodes") with 2 workers each join through c10d rendezvous on loopback
and train the PP=2 x FSDP=2 debug config, as the Slurm and Kubernetes launchers run it."""

from __future__ import annotations

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent(port: int, run_dir) -> subprocess.Popen:
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
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def test_two_agents_train_pp2_x_fsdp2_through_c10d_rendezvous(tmp_path):
    port, run_dir = free_port(), tmp_path / "run"
    agents = [agent(port, run_dir) for _ in range(2)]
    try:
        outputs = [a.communicate(timeout=TIMEOUT_S)[0] for a in agents]
    except subprocess.TimeoutExpired:
        for a in agents:
            os.killpg(a.pid, signal.SIGKILL)
        pytest.fail(f"the two agents did not finish within {TIMEOUT_S} s")
    for a, output in zip(agents, outputs):
        assert a.returncode == 0, output[-5000:]

    lines = [re.findall(r"^rank (\d)/4 \(local rank (\d)\) on node (\d) ", output, re.MULTILINE) for output in outputs]
    workers = sorted((int(rank), int(local), int(node)) for found in lines for rank, local, node in found)
    assert workers == [(0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)], outputs
    assert all(len({node for *_, node in found}) == 1 for found in lines), "each agent is one node"

    assert sorted(metrics(run_dir)) == list(range(1, STEPS + 1))
    assert (run_dir / "checkpoint" / f"step-{STEPS}" / ".metadata").is_file()
