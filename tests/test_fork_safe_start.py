"""The launcher's workers start able to use CUDA: torch marks every process forked after a CUDA
runtime call (`torch._C._cuda_isInBadFork()`), and such a worker dies at its first CUDA call on
a GPU node. The mark is set on any machine with a CUDA build of torch, so a CPU run shows it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, TINY, fresh_environment, sets

pytestmark = pytest.mark.skipif(not hasattr(torch._C, "_cuda_isInBadFork"), reason="a CPU-only build of torch has no CUDA fork mark")

RUN = ["train", "--config", "debug_cpu_pp2", "--nproc-per-node", "2",
       *sets(*TINY, "training.steps=2", "checkpoint.enable=false", "validation.enable=false",
             "parallelism.pipeline_parallel_schedule=PipeDream2BW")]


def launch(run_dir: Path, *extra: str, cache: Path | None = None, before: str = "") -> str:
    """Run `titan-async RUN --run-dir run_dir` from a fresh interpreter that first runs `before`,
    with the corpus cache `cache` (None: the default); returns its stderr (fails the test on a
    non-zero exit)."""
    code = f"{before}\nfrom titan_async.cli import main\nmain()"
    result = subprocess.run([sys.executable, "-c", code, *RUN, "--run-dir", str(run_dir), *extra],
                            capture_output=True, text=True, timeout=600, cwd=REPO,
                            env={**fresh_environment(), **({"TITAN_ASYNC_CACHE": str(cache)} if cache else {})})
    assert result.returncode == 0, result.stderr[-5000:]
    return result.stderr


def forked_after_cuda(run_dir: Path) -> list[str]:
    """What each rank logged about its start, in rank order."""
    return [re.search(r"forked after a CUDA call: (\w+)", (run_dir / "logs" / f"rank{r}.log").read_text()).group(1)
            for r in range(2)]


def test_forked_workers_can_use_cuda_with_a_cold_cache_and_float8(tmp_path: Path) -> None:
    """The launcher checks the run (float8's capability check included) and builds the
    tokenizer into an empty cache before it forks; neither touches the CUDA runtime."""
    stderr = launch(tmp_path / "run", *sets("model.float8=rowwise"), cache=tmp_path / "cache")
    assert (tmp_path / "cache").is_dir()
    assert "workers start by spawn" not in stderr
    assert forked_after_cuda(tmp_path / "run") == ["no", "no"]


def test_a_launcher_that_made_a_cuda_call_spawns_its_workers(tmp_path: Path) -> None:
    """A CUDA runtime call before the launch (here torch's device count) would poison forked
    workers: the launcher sees that and starts them by spawn instead."""
    stderr = launch(tmp_path / "run", before="import torch; torch._C._cuda_getDeviceCount()")
    assert "workers start by spawn" in stderr
    assert forked_after_cuda(tmp_path / "run") == ["no", "no"]
