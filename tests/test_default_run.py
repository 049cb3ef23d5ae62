"""The default run end to end: `titan-async train` offline, then `eval` on its checkpoint."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, metrics, run_cli


@pytest.fixture(scope="module")
def default_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    run_dir = tmp_path_factory.mktemp("default") / "run"
    script = Path(sys.executable).parent / "titan-async"
    result = subprocess.run(
        [str(script), "train", "--run-dir", str(run_dir)], capture_output=True, text=True, timeout=900, cwd=REPO
    )
    assert result.returncode == 0, result.stderr[-5000:]
    return run_dir, result


def test_default_run_learns(default_run):
    run_dir, result = default_run
    validation = metrics(run_dir, "validation")
    first, last = validation[1]["validation_metrics/loss"], validation[150]["validation_metrics/loss"]
    assert last <= 0.7 * first, (first, last)
    assert "run summary" in result.stdout and "step 150/150" in result.stdout


def test_default_run_directory_layout(default_run):
    run_dir, _ = default_run
    assert (run_dir / "config.toml").is_file()
    assert (run_dir / "checkpoint" / "step-150" / ".metadata").is_file()
    assert list((run_dir / "tb").glob("*/events.out.tfevents.*"))
    log = (run_dir / "logs" / "rank0.log").read_text()
    assert "Training completed" in log
    # MFU against a GPU's peak means nothing on CPU: left out, and the log says so.
    assert "mfu(%) is not reported on CPU" in log
    rows = metrics(run_dir, "train")
    assert rows and not any("mfu(%)" in row for row in rows.values())
    train = metrics(run_dir)
    assert sorted(train) == list(range(1, 151))
    for key in ("grad_norm", "throughput(tps)", "memory/max_reserved(GiB)", "lr/AdamW"):
        assert all(math.isfinite(row[key]) for row in train.values()), key


def test_eval_reproduces_logged_validation_loss(default_run):
    run_dir, _ = default_run
    result = run_cli("eval", "--checkpoint", str(run_dir / "checkpoint" / "step-150"), "--json", "--max-new-tokens", "8")
    report = json.loads(result.stdout)
    logged = metrics(run_dir, "validation")[150]["validation_metrics/loss"]
    assert report["loss"] == pytest.approx(logged, rel=1e-5)
    assert report["perplexity"] == pytest.approx(math.exp(logged), rel=1e-5)
    assert report["tokens"] == 8 * 8 * 256  # validation.steps x local_batch_size x seq_len
    assert report["step"] == 150 and isinstance(report["continuation"], str)
