"""`titan-async report`: a self-contained HTML page and PNGs from a finished run."""

from __future__ import annotations

import base64
import html
import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from matplotlib.figure import Figure

from conftest import CONFIGS, TINY, cli_in_process, metrics, run_cli, sets
from titan_async.rundir import directory as runs
from titan_async.commands.report import summary, write_report
from titan_async.rundir.record import read_run

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A 6-step run of the tiny model, validated at steps 1, 3 and 6."""
    run_dir = tmp_path_factory.mktemp("report") / "run"
    run_cli("train", "--config", str(CONFIGS / "debug_cpu.toml"), "--run-dir", str(run_dir),
            *sets(*TINY, "training.steps=6", "training.local_batch_size=2", "validation.freq=3"))
    return run_dir


def report(capsys, *args: str) -> tuple[int, str, str]:
    return cli_in_process(capsys, "report", *args)


def embedded_images(page: str) -> list[bytes]:
    return [base64.b64decode(data) for data in re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)]


def test_report_has_curves_config_and_optimizer_groups(finished_run, capsys):
    status, out, err = report(capsys, "--run-dir", str(finished_run))
    assert status == 0, err
    page_path = finished_run / "report" / "report.html"
    assert out.strip() == f"report: {page_path}"
    page = page_path.read_text()

    for section in ("summary", "loss", "throughput", "steps", "optimizer-groups", "config"):
        assert f'<section id="{section}">' in page, section
    assert '<section id="pipeline">' not in page
    for series in ("training loss", "validation loss", "tokens/s per device", "lr/AdamW"):
        assert series in page, series
    train, validation = metrics(finished_run), metrics(finished_run, "validation")
    assert sorted(train) == list(range(1, 7)) and sorted(validation) == [1, 3, 6]
    for step, row in train.items():
        assert f"<td>{step}</td><td>{row['loss_metrics/global_avg_loss']:.4f}</td>" in page
    assert f"{train[6]['loss_metrics/global_avg_loss']:.4f} (step 6)" in page
    assert f"{validation[6]['validation_metrics/loss']:.4f} (step 6)" in page
    assert "6 of 6" in page
    assert html.escape((finished_run / "config.toml").read_text()) in page
    assert "tok_embeddings.weight" in page and "AdamW" in page

    pngs = {path.name: path.read_bytes() for path in (finished_run / "report").glob("*.png")}
    assert sorted(pngs) == ["loss.png", "throughput.png"]
    assert all(data.startswith(PNG_SIGNATURE) and len(data) > 5000 for data in pngs.values())
    assert sorted(embedded_images(page)) == sorted(pngs.values())


def test_report_of_a_traced_pipeline_run_shows_bubble_timeline_and_stop(finished_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir, ignore=shutil.ignore_patterns("checkpoint", "report"))
    (run_dir / "pipeline").mkdir()
    for stage in (0, 1):
        rows = [{"step": step, "rank": stage, "time": float(step), "memory_gib": 0.5, "bubble": 0.1 * (stage + 1)} for step in range(1, 7)]
        (run_dir / "pipeline" / f"stage{stage}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    timeline = Figure(figsize=(4, 1))
    timeline.add_subplot().broken_barh([(0, 1)], (0, 1))
    timeline.savefig(run_dir / "pipeline" / "timeline.png")
    runs.record_stop(run_dir, 6, "signal")

    page_path = write_report(run_dir, tmp_path / "out" / "page.html")
    page = page_path.read_text()
    assert '<section id="pipeline">' in page and "Measured pipeline bubble per stage (its first rank)" in page
    assert "at step 6 by a signal, with a checkpoint" in page
    folder = page_path.parent
    assert sorted(p.name for p in folder.glob("*.png")) == ["bubble.png", "loss.png", "throughput.png", "timeline.png"]
    assert (folder / "timeline.png").read_bytes() == (run_dir / "pipeline" / "timeline.png").read_bytes()
    assert sorted(embedded_images(page)) == sorted(p.read_bytes() for p in folder.glob("*.png"))


@pytest.mark.parametrize("case", ["empty directory", "no metrics", "out is a directory"])
def test_report_refuses_bad_input_with_one_line(finished_run, tmp_path, capsys, case):
    run_dir, extra, expected = tmp_path, [], "not a titan-async run directory (no config.toml)"
    if case == "no metrics":
        shutil.copy(finished_run / "config.toml", tmp_path / "config.toml")
        expected = "no training step logged yet"
    elif case == "out is a directory":
        run_dir, extra, expected = finished_run, ["--out", str(tmp_path)], "is a directory"
    status, _, err = report(capsys, "--run-dir", str(run_dir), *extra)
    assert status == 2
    assert len(err.strip().splitlines()) == 1 and err.startswith("titan-async: ") and expected in err, err


def _fake_run(folder: Path, *assignments: str) -> Path:
    """A run directory holding only debug_cpu's config.toml with `assignments` (no training)."""
    from titan_async.config.run_config import load_run_config, render_toml

    folder.mkdir()
    (folder / "config.toml").write_text(render_toml(load_run_config(CONFIGS / "debug_cpu.toml", list(assignments))))
    return folder


def _train_row(step: int) -> dict:
    return {"loss_metrics/global_avg_loss": 10.0 - step / 10, "grad_norm": 1.0, "throughput(tps)": 100.0 + step}


@pytest.mark.parametrize("writer", ["metrics.jsonl", "pipeline/stage0.jsonl"])
def test_a_row_a_killed_run_cut_short_is_set_aside_when_writing_starts_again(tmp_path, writer):
    """A run killed while writing step 7's row resumes from step 6: without setting the fragment
    aside, the new row 7 would extend the fragment into one unreadable line and be lost."""
    from torchtitan.components.metrics import BaseLogger

    from titan_async.train.progress import _TeeLogger
    from titan_async.train.stage_records import StageRecords

    run_dir = _fake_run(tmp_path / "run", "training.steps=10", "metrics.log_freq=1")
    path = run_dir / writer

    def start_writing():
        if writer == "metrics.jsonl":
            tee = _TeeLogger(BaseLogger(), path)
            return lambda step: tee.log(_train_row(step), step)
        records = StageRecords(run_dir, 0, SimpleNamespace(enable_tensorboard=False, enable_wandb=False))
        return lambda step: records.write({"step": step, "rank": 0, "bubble": step / 100})

    first = start_writing()
    for step in range(1, 7):
        first(step)
    whole = path.read_bytes()
    cut = json.dumps({"step": 7, "kind": "train", **_train_row(7)}).encode()[:25]
    path.write_bytes(whole + cut)  # killed inside step 7's write
    resumed = start_writing()
    for step in range(7, 11):
        resumed(step)

    lines = path.read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, 11))
    assert path.read_bytes().startswith(whole)
    assert (path.parent / f"{path.name}.truncated").read_bytes() == cut + b"\n"
    if writer == "metrics.jsonl":
        rows = dict(summary(read_run(run_dir)))
        assert rows["steps logged"] == "10 of 10" and "rows missing" not in rows
        assert rows["rows cut short"] == f"1 set aside in {path}.truncated (a run killed while writing)"


def test_report_names_the_logging_steps_without_a_row(tmp_path, capsys):
    """At metrics.log_freq = 2 a run logs steps 1, 2, 4, 6, 8 and 10; the row of step 6 is gone."""
    run_dir = _fake_run(tmp_path / "run", "training.steps=10", "metrics.log_freq=2")
    rows = [{"step": step, "kind": "train", **_train_row(step)} for step in (1, 2, 4, 8, 10)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    status, _, err = report(capsys, "--run-dir", str(run_dir))
    assert status == 0, err
    page = (run_dir / "report" / "report.html").read_text()
    assert "<td>rows missing</td><td>5 of 6 steps logged (1 missing: 6)</td>" in page
    assert "rows cut short" not in page


@pytest.mark.parametrize("tail, kept, set_aside", [
    (b'{"step": 3}', b'{"step": 3}\n', None),  # cut just before its newline: the row is whole, it gets the newline
    (b'{"step": 3, "lo', b"", b'{"step": 3, "lo\n'),
    (b"\x00\x00\x00\n", b"", b"\x00\x00\x00\n"),  # a block of zeros a crash left, newline and all
    (b"", b"", None),
])
def test_only_a_last_line_that_is_no_row_is_set_aside_and_fragments_accumulate(tmp_path, tail, kept, set_aside):
    from titan_async.rundir.jsonl import set_aside_cut_line

    path, aside = tmp_path / "metrics.jsonl", tmp_path / "metrics.jsonl.truncated"
    whole = b"".join(json.dumps({"step": step}).encode() + b"\n" for step in (1, 2))
    aside.write_bytes(b"an earlier fragment\n")
    path.write_bytes(whole + tail)
    assert set_aside_cut_line(path) == (tail if set_aside else None)
    assert path.read_bytes() == whole + kept
    assert aside.read_bytes() == b"an earlier fragment\n" + (set_aside or b"")
