"""`train --overwrite` never loses a run: a new config is checked in full before the directory is
touched, and the replaced run stays in RUN/overwritten/ until the new run has an intact checkpoint."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from conftest import TINY, cli_in_process, run_cli, sets
from titan_async.core.errors import UserError
from titan_async.rundir import checksums
from titan_async.rundir.overwrite import claim, release_overwritten


def _files(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def _fake_run(folder, step: int = 2):
    (folder / "checkpoint" / f"step-{step}").mkdir(parents=True)
    (folder / "checkpoint" / f"step-{step}" / "__0_0.distcp").write_text("weights")
    (folder / "logs").mkdir()
    (folder / "logs" / "rank0.log").write_text("log")
    for name in ("config.toml", "launch.json", "metrics.jsonl"):
        (folder / name).write_text(name)


def _intact_checkpoint(folder, step: int) -> None:
    dcp.save({"w": torch.ones(3)}, checkpoint_id=str(folder / "checkpoint" / f"step-{step}"), no_dist=True)
    checksums.record(folder / "checkpoint" / f"step-{step}", rank=0)


def test_claim_moves_the_run_aside_and_leaves_other_files(tmp_path):
    _fake_run(tmp_path)
    (tmp_path / "notes.txt").write_text("mine")
    before = _files(tmp_path)

    aside = claim(tmp_path, overwrite=True)

    assert aside == tmp_path / "overwritten"
    assert _files(aside) == [f for f in before if f != "notes.txt"]
    assert _files(tmp_path) == ["notes.txt"] + [f"overwritten/{f}" for f in _files(aside)]


def test_quarantined_checkpoints_are_the_runs_too(tmp_path):
    """A run whose every checkpoint was found damaged in place and moved aside still holds them."""
    _fake_run(tmp_path)
    (tmp_path / "damaged_checkpoints").mkdir()
    (tmp_path / "checkpoint" / "step-2").rename(tmp_path / "damaged_checkpoints" / "step-2")
    before = _files(tmp_path)
    with pytest.raises(UserError, match="already holds checkpoints"):
        claim(tmp_path, overwrite=False)
    assert claim(tmp_path, overwrite=True) == tmp_path / "overwritten"
    assert [f"overwritten/{f}" for f in before] == _files(tmp_path)


def test_a_second_overwrite_keeps_the_run_with_checkpoints(tmp_path):
    _fake_run(tmp_path)
    claim(tmp_path, overwrite=True)
    (tmp_path / "metrics.jsonl").write_text("a run that wrote no checkpoint")
    kept = _files(tmp_path / "overwritten")

    assert claim(tmp_path, overwrite=True) == tmp_path / "overwritten"
    assert _files(tmp_path / "overwritten") == kept
    assert not (tmp_path / "metrics.jsonl").exists()


def test_release_waits_for_an_intact_checkpoint(tmp_path):
    _fake_run(tmp_path)
    claim(tmp_path, overwrite=True)
    (tmp_path / "checkpoint" / "step-1").mkdir(parents=True)  # a save that did not finish
    assert not release_overwritten(tmp_path) and (tmp_path / "overwritten").is_dir()

    _intact_checkpoint(tmp_path, 3)
    assert release_overwritten(tmp_path) and not (tmp_path / "overwritten").exists()


def test_a_move_cut_short_is_undone_before_anything_else(tmp_path):
    _fake_run(tmp_path)
    partial = tmp_path / "overwritten.partial"
    partial.mkdir()
    for name in ("checkpoint", "config.toml"):
        (tmp_path / name).rename(partial / name)

    with pytest.raises(Exception, match="already holds checkpoints"):
        claim(tmp_path, overwrite=False)
    assert not partial.exists()
    assert (tmp_path / "checkpoint" / "step-2" / "__0_0.distcp").is_file() and (tmp_path / "config.toml").is_file()


@pytest.mark.parametrize("bad", ["model.n_heads=7", "data.source=files"])
def test_a_rejected_config_touches_nothing(tmp_path, capsys, bad):
    _fake_run(tmp_path / "run")
    before = _files(tmp_path / "run")

    code, _, err = cli_in_process(capsys, "train", "--run-dir", str(tmp_path / "run"), "--overwrite", *sets(bad))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert _files(tmp_path / "run") == before

    code, _, err = cli_in_process(capsys, "train", "--run-dir", str(tmp_path / "new"), *sets(bad))
    assert code == 2 and not (tmp_path / "new").exists()  # not even its lock file


def test_overwrite_end_to_end(tmp_path):
    run_dir = tmp_path / "run"
    run_cli("train", "--run-dir", str(run_dir), *sets(*TINY, "training.steps=2", "checkpoint.interval=2"))
    old_metrics = (run_dir / "metrics.jsonl").read_text()

    # A new run without checkpoints: the old one is kept aside, and resume says where.
    result = run_cli("train", "--run-dir", str(run_dir), "--overwrite", *sets(*TINY, "training.steps=1", "checkpoint.enable=false"))
    assert f"kept in {run_dir / 'overwritten'}" in result.stdout and "kept in" in result.stderr
    assert (run_dir / "overwritten" / "checkpoint" / "step-2" / ".metadata").is_file()
    assert (run_dir / "overwritten" / "metrics.jsonl").read_text() == old_metrics
    assert (run_dir / "metrics.jsonl").read_text() != old_metrics
    result = run_cli("resume", "--run-dir", str(run_dir), check=False)
    assert result.returncode == 2 and f"the run it replaced is in {run_dir / 'overwritten'}" in result.stderr

    # A new run that writes a checkpoint: the old one is gone; keep_latest_k holds after the final save.
    run_cli("train", "--run-dir", str(run_dir), "--overwrite",
            *sets(*TINY, "training.steps=5", "checkpoint.interval=1", "checkpoint.keep_latest_k=3"))
    assert not (run_dir / "overwritten").exists()
    assert sorted(p.name for p in (run_dir / "checkpoint").iterdir()) == ["step-3", "step-4", "step-5"]
    assert all((run_dir / "checkpoint" / f"step-{n}" / "checksums.rank0.json").is_file() for n in (3, 4, 5))
    assert not (run_dir / "comm_traces").exists()
