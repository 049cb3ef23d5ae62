"""Shared helpers: the CLI in-process and as a subprocess, and small fast configs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from titan_async.core import platform

platform.configure()

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "train_configs"

# A ~0.2M-parameter model and short sequences: a step takes a few tens of ms on CPU.
TINY = [
    "model.dim=64", "model.n_layers=4", "model.n_heads=4",
    "training.seq_len=64", "training.local_batch_size=4",
    "validation.steps=2", "validation.freq=1000",
    "lr_scheduler.warmup_steps=2", "debug.deterministic=true",
]


SLOWEST_FILES = ("test_default_run.py", "test_moe.py", "test_independent_reference.py", "test_sync_start.py",
                 "test_fsdp_schedules.py", "test_tensor_parallel.py", "test_bounded_delay.py", "test_schedules.py",
                 "test_replicas_and_accumulation.py",
                 "test_bench_schedules.py", "test_fault_tolerance.py", "test_token_data.py")
"""Files with the longest multi-process runs (`--durations`), slowest first. Under `-n 2 --dist
loadfile --no-loadscope-reorder` (pyproject's addopts) xdist hands out whole files in collection
order, so these start first and the many short files fill in around them; in xdist's default
order (most tests first) a long file with few tests started last and ran alone for minutes."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """`SLOWEST_FILES` first, in that order; every other file after them, as collected."""
    rank = {name: i for i, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOWEST_FILES)))


LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


@pytest.fixture(autouse=True)
def isolated_environment():
    """Each test sees the environment as it was: in-process commands (eval) set launcher variables."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def sets(*assignments: str) -> list[str]:
    """['--set', a, '--set', b, ...]"""
    return [item for a in assignments for item in ("--set", a)]


def run_cli(*args: str, check: bool = True, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `titan-async ARGS` in a fresh interpreter; with `check`, fail the test on a non-zero exit."""
    result = subprocess.run(
        [sys.executable, "-m", "titan_async.cli", *args],
        capture_output=True, text=True, timeout=timeout, cwd=REPO, env={**fresh_environment(), **(env or {})},
    )
    if check and result.returncode != 0:
        pytest.fail(f"titan-async {' '.join(args)} exited {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return result


def cli_in_process(capsys, *args: str) -> tuple[int, str, str]:
    """Run `titan-async ARGS` in this process: (exit status, stdout, stderr)."""
    from titan_async import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(list(args))
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


def fresh_environment() -> dict[str, str]:
    """This process's environment without torch launcher variables, as a new shell would have it."""
    return {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}


def metrics(run_dir: Path, kind: str = "train") -> dict[int, dict]:
    """Step -> logged scalars of `kind` ("train" or "validation") from metrics.jsonl."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row for row in rows if row["kind"] == kind}


def losses(run_dir: Path) -> dict[int, float]:
    return {step: row["loss_metrics/global_avg_loss"] for step, row in metrics(run_dir).items()}


def checkpoint_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The model tensors stored in a DCP checkpoint directory, read in this process."""
    metadata = dcp.FileSystemReader(str(checkpoint)).read_metadata()
    state = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith(("tok_embeddings", "layers", "norm", "lm_head")) and hasattr(meta, "size")
    }
    dcp.load(state, checkpoint_id=str(checkpoint))
    return state
