"""A CRC-32 of every file of a checkpoint, recorded once its save has finished and verified
before it is read: a file damaged in place, at its full length, is then found.

`ChecksumRecorder` computes them on rank 0 on a background thread, off the training path, and
writes checksums.json into the checkpoint atomically; a checkpoint without one (a save that ended
before its checksums, or one from an older titan-async) is verified by its sizes alone.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import zlib
from pathlib import Path

CHECKSUM_FILE = "checksums.json"
_CHUNK = 8 << 20


def crc32(path: Path) -> int:
    """CRC-32 of the file at `path`, read in chunks."""
    value = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            value = zlib.crc32(chunk, value)
    return value


def record(checkpoint: Path) -> None:
    """Write `checkpoint`/checksums.json for the files in it (a checkpoint removed meanwhile, by
    `checkpoint.keep_latest_k`, is skipped)."""
    try:
        files = {p.name: crc32(p) for p in sorted(checkpoint.iterdir()) if p.is_file() and p.name != CHECKSUM_FILE}
        temporary = checkpoint / (CHECKSUM_FILE + ".tmp")
        temporary.write_text(json.dumps({"algorithm": "crc32", "files": files}))
        os.replace(temporary, checkpoint / CHECKSUM_FILE)
    except FileNotFoundError:
        return


def mismatch(checkpoint: Path) -> str | None:
    """The first file of `checkpoint` that no longer matches its recorded checksum, as a reason,
    or None (also when no checksums were recorded)."""
    path = checkpoint / CHECKSUM_FILE
    if not path.is_file():
        return None
    try:
        recorded = json.loads(path.read_text())["files"]
    except (ValueError, KeyError, TypeError):
        return f"unreadable {CHECKSUM_FILE}"
    for name, value in sorted(recorded.items()):
        if not (checkpoint / name).is_file():
            return f"{name} missing"
        if crc32(checkpoint / name) != value:
            return f"{name} does not match its checksum (damaged in place)"
    return None


class ChecksumRecorder:
    """Records the checksums of each finished save, in save order, on one background thread (a
    checkpoint saved twice, as a stop at a checkpoint step does, ends with the second save's
    checksums); `join` waits for all."""

    def __init__(self) -> None:
        self._queue: queue.Queue[Path | None] = queue.Queue()
        self._thread: threading.Thread | None = None

    def _work(self) -> None:
        while (checkpoint := self._queue.get()) is not None:
            record(checkpoint)

    def start(self, checkpoint: Path) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="checkpoint checksums", daemon=True)
            self._thread.start()
        self._queue.put(checkpoint)

    def join(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
