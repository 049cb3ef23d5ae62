"""Which checkpoint a run resumes from: the latest whose files are intact. Nothing is deleted.

The checks here are cheap (metadata, sizes, manifests; no file is read whole), since the launcher
makes them before any process group exists; each file's checksum is verified when it is loaded
(`titan_async.train.verified_load`, which moves a checkpoint damaged in place to RUN/damaged_checkpoints/
with `quarantine`), or, for `eval` and `export`, by `checked_step`."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from titan_async.core.errors import UserError
from titan_async.rundir import checksums
from titan_async.rundir.directory import CHECKPOINT_DIR, DAMAGED_DIR


def damage(checkpoint: Path) -> str | None:
    """Why `checkpoint` cannot be loaded (.metadata missing or unreadable, a file it names missing
    or shorter than the data it locates there, a file without a recorded checksum: its rank's
    manifest is missing, so the save's checksums did not finish), or None when it is complete.
    Reads .metadata and the manifests only."""
    if not (checkpoint / ".metadata").is_file():
        return "no .metadata: the save did not finish"
    try:
        metadata = FileSystemReader(str(checkpoint)).read_metadata()
    except Exception as err:  # a truncated or garbled pickle raises any of several types
        return f"unreadable .metadata ({type(err).__name__})"
    if not isinstance(metadata, Metadata) or metadata.storage_data is None:
        return "unreadable .metadata (not DCP metadata)"
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        path = checkpoint / name
        if not path.is_file():
            return f"{name} missing"
        if path.stat().st_size < size:
            return f"{name} truncated ({path.stat().st_size} of {size} bytes)"
    try:
        recorded = checksums.recorded(checkpoint)
    except ValueError as err:
        return str(err)
    unrecorded = sorted({".metadata", *needed} - recorded.keys())
    if unrecorded:
        return f"no checksum recorded for {unrecorded[0]}: the save's checksums did not finish"
    return None


def named_step(checkpoint: Path) -> int:
    """N of a complete checkpoint directory RUN/checkpoint/step-N (`damage`: .metadata, sizes and
    manifests; no file is read whole, the load verifies what it reads against its checksum, as
    `rundir.checksummed_read` does); UserError naming --checkpoint otherwise."""
    match = re.fullmatch(r"step-(\d+)", checkpoint.name)
    if match is None or checkpoint.parent.name != CHECKPOINT_DIR:
        raise UserError(f"--checkpoint {checkpoint}: expected a checkpoint directory RUN/checkpoint/step-N")
    if not checkpoint.is_dir():
        saved = ", ".join(p.name for _, p in reversed(saved_checkpoints(checkpoint.parent.parent))) or "none"
        raise UserError(f"--checkpoint {checkpoint}: no such checkpoint (the run has: {saved})")
    problem = damage(checkpoint)
    if problem is not None:
        raise UserError(f"--checkpoint {checkpoint}: cannot read the checkpoint ({problem})")
    return int(match.group(1))


def checked_step(checkpoint: Path) -> int:
    """`named_step`, with every file of the checkpoint read against its checksum (`eval` and
    `export` read it all anyway)."""
    step = named_step(checkpoint)
    problem = checksums.mismatch(checkpoint, checksums.recorded(checkpoint))[0]
    if problem is not None:
        raise UserError(f"--checkpoint {checkpoint}: cannot read the checkpoint ({problem})")
    return step


def saved_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every checkpoint directory step-N, complete or not, newest first."""
    folder = run_dir / CHECKPOINT_DIR
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := re.fullmatch(r"step-(\d+)", p.name))] if folder.is_dir() else []
    return sorted(found, reverse=True)


def has_intact_checkpoint(run_dir: Path) -> bool:
    """Whether some checkpoint of the run in `run_dir` is complete (`damage`)."""
    return any(damage(checkpoint) is None for _, checkpoint in saved_checkpoints(run_dir))


def quarantine(checkpoint: Path) -> Path:
    """Move the checkpoint directory RUN/checkpoint/step-N to RUN/damaged_checkpoints/step-N (step-N.2,
    step-N.3, ... if taken), where no scan for checkpoints looks; returns where it went."""
    folder = checkpoint.parent.parent / DAMAGED_DIR
    folder.mkdir(exist_ok=True)
    target, copy = folder / checkpoint.name, 1
    while target.exists():
        copy += 1
        target = folder / f"{checkpoint.name}.{copy}"
    checkpoint.rename(target)
    return target


def quarantined_note(run_dir: Path) -> str | None:
    """How many checkpoints of `run_dir` `quarantine` moved, and where, in words; None if none."""
    folder = run_dir / DAMAGED_DIR
    count = len(list(folder.iterdir())) if folder.is_dir() else 0
    if not count:
        return None
    return f"{count} checkpoint{'s' * (count != 1)} damaged in place {'is' if count == 1 else 'are'} quarantined in {folder}"


def resume_point(run_dir: Path, warn: Callable[[str], None], before: int | None = None) -> tuple[int, Path] | None:
    """(step, directory) of the latest intact checkpoint of `run_dir` (of those before step `before`
    if given), calling `warn` with one line for each newer, damaged one; None when the run saved
    none. UserError when every one is damaged, or when the run has none left but quarantined ones."""
    saved = [(step, checkpoint) for step, checkpoint in saved_checkpoints(run_dir) if before is None or step < before]
    problems = []
    for step, checkpoint in saved:
        problem = damage(checkpoint)
        if problem is None:
            for skipped, reason in problems:
                warn(f"skipping damaged checkpoint {skipped} ({reason}); resuming from {checkpoint.name}")
            return step, checkpoint
        problems.append((checkpoint, problem))
    note = quarantined_note(run_dir)
    if problems or note:
        found = []
        if problems:
            newest, reason = problems[0]
            found.append(f"all {len(problems)} are damaged (newest: {newest.name}, {reason})")
        if note:
            found.append(note)
        raise UserError(f"--run-dir {run_dir}: no intact checkpoint to resume from; {'; '.join(found)}; nothing was deleted")
    return None


def last_logged_step(run_dir: Path) -> int:
    """The latest training step in `run_dir`'s metrics.jsonl (0 if none): the progress a crash
    loses back to a checkpoint, to the granularity of `metrics.log_freq`."""
    path = run_dir / "metrics.jsonl"
    steps = [0]
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by the crash
                continue
            if row.get("kind") == "train":
                steps.append(int(row["step"]))
    return max(steps)
