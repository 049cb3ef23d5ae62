"""Checkpoint checksums: each rank records the files it wrote; on resume, after the process group
is up, each node verifies each file its ranks load once, and a checkpoint with a damaged file is
moved aside and the run resumes from the previous one."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from conftest import CONFIGS, TINY, losses, run_cli, sets
from titan_async.rundir.checkpoints import damage
from titan_async.train.verified_load import share_out

TWO_RANKS = ("--config", str(CONFIGS / "debug_cpu.toml"), "--nproc-per-node", "2")
SLOW_CRC = Path(__file__).parent / "slow_crc"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 2-process run of 4 steps with checkpoints step-2 and step-4."""
    run_dir = tmp_path_factory.mktemp("checksums") / "run"
    run_cli("train", "--run-dir", str(run_dir), *TWO_RANKS, *sets(*TINY, "training.steps=4", "checkpoint.interval=2"))
    return run_dir


def data_files(checkpoint: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in checkpoint.iterdir() if not p.name.startswith("checksums")}


def test_each_rank_records_the_files_it_wrote(saved):
    checkpoint = saved / "checkpoint" / "step-2"
    manifests = {p.name: sorted(json.loads(p.read_text())["files"]) for p in checkpoint.glob("checksums*")}
    assert manifests == {"checksums.rank0.json": [".metadata", "__0_0.distcp"], "checksums.rank1.json": ["__1_0.distcp"]}


def test_resume_verifies_after_the_process_group_is_up_once_per_node(saved, tmp_path):
    """Every checksum chunk sleeps 2.5 s and collectives time out after 5 s. Verifying the 3 files
    before the process group exists (titan-async before per-rank manifests) kept rank 1 waiting
    for rank 0 past the timeout; now the ranks verify their shares at the same time."""
    run_dir = shutil.copytree(saved, tmp_path / "run")
    python_path = os.pathsep.join(filter(None, [str(SLOW_CRC), os.environ.get("PYTHONPATH")]))
    run_cli("resume", "--run-dir", str(run_dir), *sets("training.steps=5", "checkpoint.load_only=true", "comm.init_timeout_seconds=5"),
            env={"PYTHONPATH": python_path, "TITAN_ASYNC_TEST_CRC_DELAY": "2.5"})
    checkpoint = run_dir / "checkpoint" / "step-4"
    pattern = rf"checksummed (\d+) files \((\d+) bytes\) of {re.escape(str(checkpoint))} in"
    verified = [int(m.group(2)) for rank in (0, 1) for m in re.finditer(pattern, (run_dir / "logs" / f"rank{rank}.log").read_text())]
    assert len(verified) == 2 and sum(verified) == sum(len(data) for data in data_files(checkpoint).values()), verified


def test_a_damaged_checkpoint_is_moved_aside_and_an_elastic_run_resumes_from_the_previous(saved, tmp_path):
    """step-4 damaged in place passes the launcher's cheap checks; its load fails on both ranks,
    rank 0 moves it (bytes unchanged) to damaged_checkpoints/, and the ranks load step-2 instead,
    every state of it: steps 3 and 4 train again to the uninterrupted run's losses."""
    run_dir = shutil.copytree(saved, tmp_path / "run")
    checkpoint = run_dir / "checkpoint" / "step-4"
    damaged = bytearray((checkpoint / "__1_0.distcp").read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    (checkpoint / "__1_0.distcp").write_bytes(damaged)
    before = {path.name: path.read_bytes() for path in checkpoint.iterdir()}
    result = run_cli("resume", "--run-dir", str(run_dir), "--max-restarts", "2")
    assert "restart 1" not in result.stderr, result.stderr[-3000:]  # the first workers fell back
    assert "from step-4: the run is complete (training.steps = 4)" in result.stdout  # as the launcher's cheap checks see it
    moved = run_dir / "damaged_checkpoints" / "step-4"
    warning = (f"checkpoint {checkpoint} is damaged (__1_0.distcp does not match its checksum (damaged in place)); moved to "
               f"{moved}; resuming from step-2 (its later steps train again)")
    said = [line for line in result.stderr.splitlines() if "damaged" in line]
    assert len(said) == 1 and said[0].endswith(f" WARNING titan_async: {warning}"), result.stderr[-3000:]
    assert {path.name: path.read_bytes() for path in moved.iterdir()} == before
    assert damage(checkpoint) is None  # saved again by the resumed run
    assert losses(run_dir) == losses(saved)  # exact: the rows logged after the resume replace earlier ones
    # torch elastic's agent and the workers it stops add nothing to the console
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert not [line for line in result.stderr.splitlines() if "torch/distributed/" in line or "torch/multiprocessing/" in line]


def test_each_node_verifies_each_file_it_loads_once_by_a_rank_that_loads_it():
    wanted = [("a", [".metadata", "__0_0", "__1_0"]), ("a", [".metadata", "__1_0"]),
              ("b", [".metadata", "__2_0"]), ("b", [".metadata", "__0_0", "__3_0"])]
    sizes = {".metadata": 1, "__0_0": 10, "__1_0": 10, "__2_0": 10, "__3_0": 10}
    assert share_out(wanted, sizes) == [["__0_0", ".metadata"], ["__1_0"], ["__2_0", ".metadata"], ["__0_0", "__3_0"]]
