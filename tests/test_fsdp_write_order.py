"""Shard writes under FSDP2 against a model of its all-gather streams, and a stale-buffer control.

The single-process emulation of 2BW and PACI runs every stage under one-rank FSDP2 on CPU,
where FSDP skips its all-gather streams: a missing write fence changes nothing there, so
matching the references cannot show one. tests/workers/fsdp_write_order.py replays each
all-gather against the model of when those streams see a shard write (after a fence), and
2BW's gathered side buffer gets a negative control: left stale, the reference rejects it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_pipeline_references import free_port, mismatch, paci_reference, two_bw_reference

WORKER = Path(__file__).parent / "workers" / "fsdp_write_order.py"


def emulate(tmp_path: Path, schedule: str, fsdp: str, variant: str = "exact"):
    """(stage -> recorded updates and evaluations, parameters all-gathered after an unfenced write)."""
    out = tmp_path / f"{schedule}-{fsdp}-{variant}"
    result = subprocess.run([sys.executable, str(WORKER), schedule, fsdp, variant, str(out)], capture_output=True, text=True,
                            timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port())})
    assert result.returncode == 0, result.stderr[-4000:]
    return {s: torch.load(out / f"stage{s}.pt") for s in range(4)}, torch.load(out / "violations.pt")


@pytest.mark.parametrize("fsdp", ["reshard", "hold"])
@pytest.mark.parametrize("schedule", ["PipeDream2BW", "PACI"])
def test_emulation_under_fsdp_follows_the_rules_and_fences_every_shard_write(tmp_path, schedule, fsdp):
    emulated, violations = emulate(tmp_path, schedule, fsdp)
    reference = two_bw_reference(4, "adamw") if schedule == "PipeDream2BW" else paci_reference(4, "adamw", 2)
    assert mismatch(emulated, *reference) < 1e-6
    assert violations == []


def test_the_write_order_model_sees_a_missing_fence(tmp_path):
    _, violations = emulate(tmp_path, "PipeDream2BW", "reshard", "no-fence")
    assert violations


def test_a_stale_gathered_side_buffer_fails_the_reference(tmp_path):
    emulated, _ = emulate(tmp_path, "PipeDream2BW", "hold", "stale-spare")
    assert mismatch(emulated, *two_bw_reference(4, "adamw")) > 1e-3
