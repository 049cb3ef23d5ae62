"""CRC-32s of a checkpoint's files, each recorded by the rank that wrote it: a file damaged in
place, at its full length, is then found before it is loaded.

Each rank records the files it wrote (DCP's FileSystemWriter names them `__R_I.distcp` after the
writing rank R; the coordinator, rank 0, also writes `.metadata`) in its own manifest,
checksums.rankR.json beside them, written atomically once the save has finished. A checkpoint of an
older titan-async holds one checksums.json of every file instead, written by rank 0, in the same
format ({"algorithm": "crc32", "files": {name: crc}}); both are read alike. `ChecksumRecorder`
computes a rank's checksums on a background thread, off the training path.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import zlib
from pathlib import Path

LEGACY_FILE = "checksums.json"
_MANIFESTS = "checksums*.json"
_CHUNK = 8 << 20


def manifest_name(rank: int) -> str:
    """The name of rank `rank`'s manifest in a checkpoint directory."""
    return f"checksums.rank{rank}.json"


def crc32(path: Path) -> tuple[int, int]:
    """(CRC-32, bytes read) of the file at `path`, read in chunks."""
    value = size = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            value = zlib.crc32(chunk, value)
            size += len(chunk)
    return value, size


def written_by(checkpoint: Path, rank: int) -> list[Path]:
    """The files of `checkpoint` that rank `rank` wrote."""
    files = sorted(checkpoint.glob(f"__{rank}_*.distcp"))
    return files + [checkpoint / ".metadata"] if rank == 0 else files


def record(checkpoint: Path, rank: int) -> None:
    """Write rank `rank`'s manifest of the files it wrote in `checkpoint` (a checkpoint removed
    meanwhile, by `checkpoint.keep_latest_k`, is skipped)."""
    try:
        files = {path.name: crc32(path)[0] for path in written_by(checkpoint, rank)}
        manifest = checkpoint / manifest_name(rank)
        temporary = manifest.with_name(manifest.name + ".tmp")
        temporary.write_text(json.dumps({"algorithm": "crc32", "files": files}))
        os.replace(temporary, manifest)
    except FileNotFoundError:
        return


def recorded(checkpoint: Path) -> dict[str, int]:
    """File name -> recorded CRC-32, from every manifest of `checkpoint` (reads only those);
    ValueError naming a manifest that cannot be read."""
    found: dict[str, int] = {}
    for path in sorted(checkpoint.glob(_MANIFESTS)):
        try:
            found.update({str(name): int(value) for name, value in json.loads(path.read_text())["files"].items()})
        except (ValueError, KeyError, TypeError, AttributeError, OSError):
            raise ValueError(f"unreadable {path.name}") from None
    return found


def mismatch(checkpoint: Path, expected: dict[str, int]) -> tuple[str | None, int]:
    """(the first file of `expected` in `checkpoint` that is missing or no longer matches its
    CRC-32, as a reason, or None; the bytes read to find out)."""
    read = 0
    for name, value in sorted(expected.items()):
        try:
            actual, size = crc32(checkpoint / name)
        except FileNotFoundError:
            return f"{name} missing", read
        read += size
        if actual != value:
            return f"{name} does not match its checksum (damaged in place)", read
    return None, read


class ChecksumRecorder:
    """Records one rank's checksums of each finished save, in save order, on one background
    thread (a checkpoint saved twice, as a stop at a checkpoint step does, ends with the second
    save's checksums); `join` waits for all."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._queue: queue.Queue[Path | None] = queue.Queue()
        self._thread: threading.Thread | None = None

    def _work(self) -> None:
        while (checkpoint := self._queue.get()) is not None:
            record(checkpoint, self.rank)

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
