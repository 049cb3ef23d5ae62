"""Lost workers, damaged checkpoints and concurrent runs: elastic restarts, integrity checks, the run lock."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import CONFIGS, REPO, TINY, cli_in_process, fresh_environment, losses, run_cli, sets
from titan_async.rundir.checkpoints import damage

PP_2BW_REPLICAS = ("--config", str(CONFIGS / "debug_cpu_pp2_2bw.toml"), "--nproc-per-node", "4",
                   *sets(*TINY, "training.steps=10", "checkpoint.interval=2", "parallelism.data_parallel_replicate_degree=2"))
SINGLE = ("--config", str(CONFIGS / "debug_cpu.toml"), *sets(*TINY, "checkpoint.interval=1", "checkpoint.keep_latest_k=0"))


def start(*args: str, output: Path) -> subprocess.Popen:
    """`titan-async ARGS` in the background, its stdout and stderr in `output`."""
    return subprocess.Popen([sys.executable, "-m", "titan_async.cli", *args], cwd=REPO, env=fresh_environment(),
                            stdout=output.open("w"), stderr=subprocess.STDOUT)


def wait_for(path: Path, process: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert process.poll() is None and time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.005)


def _stat(pid: int) -> list[str] | None:
    """State, parent, ... of a process from /proc/PID/stat; None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def alive(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"


def descendants(pid: int) -> list[int]:
    """Process ids below `pid` (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))):
            children.setdefault(int(stat[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def worker_of_rank(launcher: int, rank: int) -> int:
    for pid in descendants(launcher):
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if name == f"titan-async r{rank}":
            return pid
    raise AssertionError(f"no worker of rank {rank} under process {launcher}")


@pytest.fixture(scope="module")
def restarted(tmp_path_factory):
    """A PP = 2 x replicas 2 PipeDream2BW run whose rank-3 worker (a replica of stage 1) is
    SIGKILLed after the step-6 checkpoint, with --max-restarts 1, and the same run uninterrupted:
    (run dir, its output, baseline dir)."""
    root = tmp_path_factory.mktemp("restart")
    baseline = root / "baseline"
    run_cli("train", "--run-dir", str(baseline), *PP_2BW_REPLICAS)
    run_dir, output = root / "restarted", root / "restarted.out"
    launcher = start("train", "--run-dir", str(run_dir), "--max-restarts", "1", *PP_2BW_REPLICAS, output=output)
    for rank in range(4):  # step-6 is complete once every rank recorded its checksums
        wait_for(run_dir / "checkpoint" / "step-6" / f"checksums.rank{rank}.json", launcher)
    os.kill(worker_of_rank(launcher.pid, 3), signal.SIGKILL)
    assert launcher.wait(timeout=300) == 0, output.read_text()[-5000:]
    return run_dir, output.read_text(), baseline


def test_restarted_run_finishes_with_the_uninterrupted_losses(restarted):
    run_dir, output, baseline = restarted
    resumed = re.search(r"restart 1: resumed from step (\d+) \(\S+\); (\d+) steps? lost", output)
    assert resumed, output[-5000:]
    assert int(resumed.group(1)) >= 6
    expected = losses(baseline)
    assert sorted(expected) == list(range(1, 11))
    assert losses(run_dir) == expected  # exact: the rows logged after the restart replace earlier ones


def test_negative_max_restarts_is_one_line(capsys, tmp_path):
    code, _, err = cli_in_process(capsys, "train", "--run-dir", str(tmp_path / "run"), "--max-restarts", "-1", *SINGLE)
    assert code == 2 and err.strip() == "titan-async: --max-restarts -1: expected a count >= 0"


def test_max_restarts_under_torchrun_belongs_to_torchrun(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    code, _, err = cli_in_process(capsys, "resume", "--run-dir", str(tmp_path), "--max-restarts", "2")
    assert code == 2 and err.strip() == (
        "titan-async: --max-restarts 2: under torchrun or Slurm, pass it to torchrun, which restarts the workers")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A single-process run of 4 steps with checkpoints step-1 to step-4."""
    run_dir = tmp_path_factory.mktemp("damage") / "run"
    run_cli("train", "--run-dir", str(run_dir), *SINGLE, *sets("training.steps=4"))
    return run_dir


def checkpoint(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoint" / f"step-{step}"


def flip_a_byte(path: Path) -> None:
    """Damage `path` in place, its length unchanged."""
    with open(path, "r+b") as handle:
        handle.seek(path.stat().st_size // 2)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0xFF]))


def test_damage_is_found_from_metadata_sizes_and_manifests(saved, tmp_path):
    """Cheap checks only: a file damaged in place is found when it is loaded (test_checksums.py)."""
    intact = checkpoint(saved, 4)
    assert damage(intact) is None
    for name, harm, reason in [
        ("unrecorded", lambda c: (c / "checksums.rank0.json").unlink(),
         r"no checksum recorded for .metadata: the save's checksums did not finish"),
        ("garbled manifest", lambda c: (c / "checksums.rank0.json").write_text("{"), r"unreadable checksums.rank0.json"),
        ("truncated", lambda c: os.truncate(c / "__0_0.distcp", 100), r"__0_0.distcp truncated \(100 of \d+ bytes\)"),
        ("missing", lambda c: (c / "__0_0.distcp").unlink(), r"__0_0.distcp missing"),
        ("garbled", lambda c: (c / ".metadata").write_bytes(b"not a pickle"), r"unreadable .metadata \(\w+\)"),
        ("unfinished", lambda c: (c / ".metadata").unlink(), r"no .metadata: the save did not finish"),
    ]:
        copy = shutil.copytree(intact, tmp_path / name)
        harm(copy)
        assert re.fullmatch(reason, damage(copy) or ""), name


def test_every_checkpoint_damaged_is_one_line(saved, capsys, tmp_path):
    run_dir = shutil.copytree(saved, tmp_path / "run")
    for step in range(1, 5):
        (checkpoint(run_dir, step) / "__0_0.distcp").unlink()
    code, _, err = cli_in_process(capsys, "resume", "--run-dir", str(run_dir))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "no intact checkpoint to resume from; all 4 are damaged (newest: step-4, __0_0.distcp missing)" in err
    assert all(checkpoint(run_dir, step).is_dir() for step in range(1, 5))


def test_every_checkpoint_damaged_in_place_is_one_line_and_each_is_moved_aside_whole(saved, capsys, tmp_path):
    """The launcher's cheap checks pass; the worker finds each damaged in turn as it loads it, and
    refuses once none is left, as does every later resume: the run never starts over from step 0.
    The elastic agent does not restart a worker that refused (every restart would say it again)."""
    run_dir = shutil.copytree(saved, tmp_path / "run")
    for step in range(1, 5):
        flip_a_byte(checkpoint(run_dir, step) / "__0_0.distcp")
    before = {step: {p.name: p.read_bytes() for p in checkpoint(run_dir, step).iterdir()} for step in range(1, 5)}
    result = run_cli("resume", "--run-dir", str(run_dir), "--max-restarts", "2", check=False)
    aside = run_dir / "damaged_checkpoints"
    said = [line for line in result.stderr.splitlines() if line.startswith("titan-async:")]
    assert result.returncode == 2 and said == [
        f"titan-async: no intact checkpoint to resume from: {checkpoint(run_dir, 1)} is damaged (__0_0.distcp does not match "
        f"its checksum (damaged in place)), and no earlier one is intact; 4 checkpoints damaged in place are quarantined in "
        f"{aside}; "
        "nothing was deleted"], result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert {step: {p.name: p.read_bytes() for p in (aside / f"step-{step}").iterdir()} for step in range(1, 5)} == before
    assert not any((run_dir / "checkpoint").glob("step-*"))
    code, _, err = cli_in_process(capsys, "resume", "--run-dir", str(run_dir))
    assert code == 2 and err.strip() == (f"titan-async: --run-dir {run_dir}: no intact checkpoint to resume from; "
                                         f"4 checkpoints damaged in place are quarantined in {aside}; nothing was deleted")


def test_eval_and_export_refuse_a_damaged_checkpoint_in_one_line(saved, capsys, tmp_path):
    run_dir = shutil.copytree(saved, tmp_path / "run")
    flip_a_byte(checkpoint(run_dir, 2) / "__0_0.distcp")
    os.truncate(checkpoint(run_dir, 1) / "__0_0.distcp", 100)
    for step, reason in ((2, "__0_0.distcp does not match its checksum"), (1, "__0_0.distcp truncated")):
        path = checkpoint(run_dir, step)
        for command in (("eval", "--checkpoint", str(path)), ("export", "--checkpoint", str(path), "--out", str(tmp_path / "hf"))):
            code, _, err = cli_in_process(capsys, *command)
            assert code == 2 and len(err.strip().splitlines()) == 1, err
            assert f"--checkpoint {path}: cannot read the checkpoint ({reason}" in err


def test_resume_skips_damaged_checkpoints(saved):
    """Runs last among the tests of `saved`: the resume saves step-2 to step-4 again. The launcher
    skips the incomplete step-4 and step-3; the worker finds step-2 damaged in place when it loads
    it, moves it aside and loads step-1, every state of it: the losses are the uninterrupted run's."""
    first = losses(saved)
    (checkpoint(saved, 4) / "checksums.rank0.json").unlink()  # killed before its checksums were recorded
    (checkpoint(saved, 3) / ".metadata").write_bytes(b"garbled")
    flip_a_byte(checkpoint(saved, 2) / "__0_0.distcp")
    result = run_cli("resume", "--run-dir", str(saved))
    warnings = [line for line in result.stderr.splitlines() if line.startswith("titan-async: warning:")]
    assert len(warnings) == 2, result.stderr
    assert warnings[0] == (f"titan-async: warning: skipping damaged checkpoint {checkpoint(saved, 4)} (no checksum recorded "
                           "for .metadata: the save's checksums did not finish); resuming from step-2")
    assert warnings[1] == (f"titan-async: warning: skipping damaged checkpoint {checkpoint(saved, 3)} "
                           "(unreadable .metadata (UnpicklingError)); resuming from step-2")
    assert "from step-2" in result.stdout
    moved = [line for line in result.stderr.splitlines() if "is damaged" in line]
    assert len(moved) == 1 and moved[0].endswith(
        f" WARNING titan_async: checkpoint {checkpoint(saved, 2)} is damaged (__0_0.distcp does not match its checksum "
        f"(damaged in place)); moved to {saved / 'damaged_checkpoints' / 'step-2'}; resuming from step-1 (its later steps "
        "train again)"), result.stderr
    assert losses(saved) == first


def test_run_directory_lock(tmp_path, capsys):
    run_dir, output = tmp_path / "run", tmp_path / "first.out"
    first = start("train", "--run-dir", str(run_dir), "--max-restarts", "1", *SINGLE, *sets("training.steps=1000"),
                  output=output)
    wait_for(checkpoint(run_dir, 2) / ".metadata", first)
    code, _, err = cli_in_process(capsys, "train", "--run-dir", str(run_dir), *SINGLE)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"--run-dir {run_dir}: in use by a running titan-async (pid {first.pid} on " in err

    run = [first.pid, *descendants(first.pid)]  # the launcher, torchrun and its worker
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in run):
        assert time.monotonic() < deadline, "killing the launcher left processes of its run behind"
        time.sleep(0.1)
    latest = max(int(p.name.split("-")[1]) for p in (run_dir / "checkpoint").iterdir() if damage(p) is None)
    resumed = run_cli("resume", "--run-dir", str(run_dir), *sets(f"training.steps={latest + 1}"))
    assert f"from step-{latest}" in resumed.stdout
    assert max(losses(run_dir)) == latest + 1


def interrupted_pp2_run(run_dir: Path, signals: int) -> tuple[str, list[int]]:
    """A 2-process run far longer than the test, sent `signals` SIGINTs (as Ctrl-C sends the
    launcher) once it logged 2 steps: its output, after it exited with status 130, and the
    processes it had started."""
    output = run_dir.with_suffix(".out")
    launcher = start("train", "--run-dir", str(run_dir), "--config", str(CONFIGS / "debug_cpu_pp2.toml"), "--nproc-per-node", "2",
                     *sets(*TINY, "training.steps=100000", "checkpoint.interval=100000"), output=output)
    deadline = time.monotonic() + 300
    while not ((run_dir / "metrics.jsonl").is_file() and (run_dir / "metrics.jsonl").read_text().count('"train"') >= 2):
        assert launcher.poll() is None and time.monotonic() < deadline, output.read_text()[-3000:]
        time.sleep(0.05)
    family = descendants(launcher.pid)
    for _ in range(signals):
        launcher.send_signal(signal.SIGINT)
        time.sleep(0.1)
    assert launcher.wait(timeout=300) == 130, output.read_text()[-5000:]
    text = output.read_text()
    assert "Traceback" not in text, text[-5000:]
    return text, family


def test_ctrl_c_twice_stops_a_multi_process_run_cleanly_and_a_third_aborts(tmp_path):
    output, _ = interrupted_pp2_run(tmp_path / "stop", signals=2)
    assert "a stop is under way" in output
    stopped = json.loads((tmp_path / "stop" / "stopped.json").read_text())["step"]
    assert f"stopped at step {stopped} by signal, with a checkpoint" in output
    assert damage(tmp_path / "stop" / "checkpoint" / f"step-{stopped}") is None

    output, family = interrupted_pp2_run(tmp_path / "abort", signals=3)
    assert "aborted: the steps since the last checkpoint are lost" in output
    assert len(family) >= 3  # the agent and both workers
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in family) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in family if alive(pid)]


def _choice_worker(rank: int, init_file: str) -> None:
    import torch.distributed as dist

    from titan_async.train.trainer import AsyncTrainer

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        seen = {0: 6, 1: 4}[rank]  # rank 1's node lists the step-6 checkpoint late
        trainer = SimpleNamespace(checkpointer=SimpleNamespace(enable=True),
                                  config=SimpleNamespace(checkpoint=SimpleNamespace(load_step=seen)))
        AsyncTrainer.load_rank0s_choice(trainer)
        assert trainer.config.checkpoint.load_step == 6, (rank, trainer.config.checkpoint.load_step)
    finally:
        dist.destroy_process_group()


def test_every_rank_resumes_from_rank_0s_choice(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_choice_worker, args=(str(tmp_path / "init"),), nprocs=2)
