"""A load through DCP that reads each file it touches once, start to end, checking the file
against the CRC-32 its rank recorded (`checksums`) on the way.

`ChecksummedReader` is DCP's FileSystemReader, except that each file of the load plan is read in
one sequential pass: the pieces the load needs are taken as the pass reaches them, and the bytes
between them are read for the CRC-32 alone. The checksum covers the whole file, so a file that
holds a rank's model and optimizer state together is read whole, once; a file the load does not
touch is not read at all. A file whose CRC-32 differs from the recorded one, or that has none
recorded, fails the load (`ChecksumMismatch`) at the end of its pass, before the load returns (also
when a damaged piece failed to load first): what was copied out of it is never used. .metadata is
checked when DCP reads it.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import zlib
from pathlib import Path

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from titan_async.rundir import checksums

_CHUNK = 8 << 20


class ChecksumMismatch(Exception):
    """A file of the load that is not what its rank recorded (the message names it and why)."""


class _Pass:
    """One sequential read of a file: its CRC-32 and the bytes read so far."""

    def __init__(self, handle: io.BufferedReader) -> None:
        self.handle, self.crc, self.position = handle, 0, 0

    def _read(self, size: int) -> bytes:
        data = self.handle.read(size)
        self.crc = zlib.crc32(data, self.crc)
        self.position += len(data)
        return data

    def _skip_to(self, offset: int | None) -> None:
        """Read up to `offset` (None: the end of the file) for the CRC-32 alone."""
        while offset is None or self.position < offset:
            if not self._read(_CHUNK if offset is None else min(_CHUNK, offset - self.position)):
                return

    def take(self, offset: int, length: int) -> bytes:
        """The `length` bytes at `offset`; a piece before the pass's position (another request of a
        piece already read) is read again without counting it twice."""
        if offset < self.position:
            self.handle.seek(offset)
            data = self.handle.read(length)
            self.handle.seek(self.position)
            return data
        self._skip_to(offset)
        return self._read(length)

    def finish(self) -> int:
        """The file's CRC-32, once the rest of it is read."""
        self._skip_to(None)
        return self.crc


class ChecksummedReader(FileSystemReader):
    """DCP's FileSystemReader of `checkpoint` that verifies what it reads (module docstring)."""

    def __init__(self, checkpoint: Path) -> None:
        super().__init__(str(checkpoint))
        self.checkpoint = checkpoint
        self.recorded = checksums.recorded(checkpoint)
        self._pass: _Pass | None = None

    def _verify(self, name: str, crc: int) -> None:
        if name not in self.recorded:
            raise ChecksumMismatch(f"no checksum recorded for {name}")
        if crc != self.recorded[name]:
            raise ChecksumMismatch(f"{name} does not match its checksum (damaged in place)")

    def read_metadata(self, *args, **kwargs):
        self._verify(".metadata", checksums.crc32(self.checkpoint / ".metadata")[0])
        return super().read_metadata(*args, **kwargs)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list] = {}
        for item in sorted(plan.items, key=lambda item: self.storage_data[item.storage_index].offset):
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        read = 0
        for name, items in per_file.items():
            with open(self.checkpoint / name, "rb") as handle:
                self._pass = _Pass(handle)
                try:
                    super().read_data(dataclasses.replace(plan, items=items), planner)
                finally:  # a damaged file is named as such, also where a damaged piece failed to load
                    self._verify(name, self._pass.finish())
                read += self._pass.position
            self._pass = None
        logging.getLogger("titan_async").info(f"read and checksummed {len(per_file)} files ({read} bytes) of {self.checkpoint}")
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _slice_file(self, file, sinfo) -> io.BytesIO:
        """The piece `sinfo` locates, from this file's pass (FileSystemReader's own stream is left unread)."""
        return io.BytesIO(self._pass.take(sinfo.offset, sinfo.length))
