"""Token data on disk: the shards `titan-async prepare` writes, and Megatron-LM indexed data sets.

Prepared directory::

    manifest.json                      written last; lists every shard
    shard-00000.tokens                 every document's tokens, concatenated (uint16 or uint32)
    shard-00000.docs                   int64 token offsets: each document's start, then the end

Megatron-LM indexed data set (`PREFIX.bin` + `PREFIX.idx`, the MMIDIDX layout): the .idx holds the
9-byte magic, version 1 (<Q), the dtype code (<B), the sequence count (<Q), the document count
(<Q), then int32 sequence lengths, int64 byte pointers into the .bin, int64 document indices.
Each sequence is one document here.

Both open as a `TokenCorpus`: memory-mapped, so memory does not grow with the data.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from titan_async.core.errors import UserError

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
MEGATRON_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}
"""Megatron-LM's dtype codes."""
_MEGATRON_HEADER = struct.Struct("<9sQBQQ")


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits in it, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class TokenPart:
    """One file of tokens: document i is tokens[starts[i] : starts[i] + lengths[i]]."""

    tokens: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray

    def document(self, index: int) -> np.ndarray:
        start = int(self.starts[index])
        return self.tokens[start : start + int(self.lengths[index])]

    def lengths_between(self, start: int, stop: int) -> np.ndarray:
        """The lengths of documents start..stop-1, as int64."""
        return np.asarray(self.lengths[start:stop], dtype=np.int64)


@dataclass(frozen=True)
class TokenCorpus:
    """Documents in order across parts; the largest token id and the tokenizer.json's sha256 where
    recorded (None: not recorded, as in Megatron-LM's files)."""

    parts: tuple[TokenPart, ...]
    max_token_id: int | None
    tokenizer_sha256: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "_ends", np.cumsum([len(p.starts) for p in self.parts], dtype=np.int64))

    def __len__(self) -> int:
        return int(self._ends[-1]) if self.parts else 0

    def token_count(self) -> int:
        """Tokens in all parts (their files' sizes; no pass over them)."""
        return sum(len(part.tokens) for part in self.parts)

    def document(self, index: int) -> np.ndarray:
        part, first = self._part(index)
        return self.parts[part].document(index - first)

    def lengths_between(self, start: int, stop: int) -> np.ndarray:
        """The lengths of documents start..stop-1 (stop clipped to the end of start's part), as int64."""
        part, first = self._part(start)
        return self.parts[part].lengths_between(start - first, min(stop, int(self._ends[part])) - first)

    def _part(self, index: int) -> tuple[int, int]:
        """The part that holds document `index`, and the index of that part's first document."""
        part = int(np.searchsorted(self._ends, index, side="right"))
        return part, int(self._ends[part - 1]) if part else 0


def open_tokens(path: str, key: str) -> TokenCorpus:
    """The corpus at `path` (a prepared directory or a Megatron prefix), checked cheaply (sizes, header):
    UserError naming `key` when a file is missing, truncated or of another format."""
    location = Path(path).expanduser()
    if (location / MANIFEST).is_file():
        return _open_prepared(location, key)
    if Path(f"{location}.idx").is_file():
        return _open_megatron(location, key)
    raise UserError(f"{key} = {path!r}: expected a directory with {MANIFEST} (titan-async prepare) "
                    "or the prefix of a Megatron-LM PREFIX.bin + PREFIX.idx pair")


def read_manifest(directory: Path, key: str) -> dict:
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"{key} = {str(directory)!r}: unreadable {MANIFEST}: {err}") from None
    if manifest.get("format_version") != FORMAT_VERSION:
        raise UserError(f"{key} = {str(directory)!r}: {MANIFEST} has format_version "
                        f"{manifest.get('format_version')!r}, expected {FORMAT_VERSION}")
    return manifest


def shard_problem(directory: Path, shard: dict, itemsize: int, checksum: bool = False) -> str:
    """Why the shard `shard` (a manifest entry) is not intact on disk, or "" when it is."""
    tokens, docs = directory / shard["tokens"], directory / shard["docs"]
    for path, expected in ((tokens, shard["token_count"] * itemsize), (docs, (shard["document_count"] + 1) * 8)):
        if not path.is_file():
            return f"shard file {path.name} is missing"
        if (size := path.stat().st_size) != expected:
            return f"shard file {path.name} has {size} bytes, the manifest says {expected}"
    if checksum and sha256(tokens) != shard["sha256"]:
        return f"shard file {tokens.name} does not match its sha256 in the manifest"
    return ""


def _open_prepared(directory: Path, key: str) -> TokenCorpus:
    manifest = read_manifest(directory, key)
    dtype = np.dtype(manifest["dtype"])
    parts = []
    for shard in manifest["shards"]:
        if problem := shard_problem(directory, shard, dtype.itemsize):
            raise UserError(f"{key} = {str(directory)!r}: {problem}; rerun titan-async prepare")
        if not shard["document_count"]:
            continue
        offsets = np.memmap(directory / shard["docs"], dtype=np.int64, mode="r")
        tokens = np.memmap(directory / shard["tokens"], dtype=dtype, mode="r") if shard["token_count"] else np.empty(0, dtype)
        parts.append(TokenPart(tokens, offsets[:-1], _Lengths(offsets)))
    return TokenCorpus(tuple(parts), max((s["max_token_id"] for s in manifest["shards"]), default=-1),
                       manifest["tokenizer_sha256"])


class _Lengths:
    """Document lengths from memory-mapped offsets, without materializing them."""

    def __init__(self, offsets: np.ndarray):
        self._offsets = offsets

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, index: int | slice) -> int | np.ndarray:
        if isinstance(index, slice):
            start, stop, _ = index.indices(len(self))
            return np.diff(self._offsets[start : max(start, stop) + 1])
        return int(self._offsets[index + 1] - self._offsets[index])


def _open_megatron(prefix: Path, key: str) -> TokenCorpus:
    index, data = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    where = f"{key} = {str(prefix)!r}"
    with index.open("rb") as f:
        header = f.read(_MEGATRON_HEADER.size)
    if len(header) < _MEGATRON_HEADER.size or header[:9] != MEGATRON_MAGIC:
        raise UserError(f"{where}: {index.name} does not start with Megatron-LM's MMIDIDX magic")
    _, version, code, sequences, documents = _MEGATRON_HEADER.unpack(header)
    if version != 1:
        raise UserError(f"{where}: {index.name} has index version {version}, expected 1")
    if code not in MEGATRON_DTYPES or not np.issubdtype(MEGATRON_DTYPES[code], np.integer):
        raise UserError(f"{where}: {index.name} has dtype code {code}, expected an integer type (1-5 or 8)")
    dtype = np.dtype(MEGATRON_DTYPES[code])
    needed = _MEGATRON_HEADER.size + sequences * 4 + sequences * 8 + documents * 8
    if index.stat().st_size < needed:
        raise UserError(f"{where}: {index.name} has {index.stat().st_size} bytes, its header needs {needed}")
    if not data.is_file():
        raise UserError(f"{where}: {data.name} is missing")
    lengths = np.memmap(index, dtype=np.int32, mode="r", offset=_MEGATRON_HEADER.size, shape=(sequences,)) if sequences else np.empty(0, np.int32)
    pointers = (np.memmap(index, dtype=np.int64, mode="r", offset=_MEGATRON_HEADER.size + sequences * 4, shape=(sequences,))
                if sequences else np.empty(0, np.int64))
    if sequences:
        end = int(pointers[-1]) + int(lengths[-1]) * dtype.itemsize
        if data.stat().st_size < end:
            raise UserError(f"{where}: {data.name} has {data.stat().st_size} bytes, its index points up to byte {end}")
    if not sequences or not data.stat().st_size:
        return TokenCorpus((), None)
    tokens = np.memmap(data, dtype=dtype, mode="r")
    return TokenCorpus((TokenPart(tokens, _Starts(pointers, dtype.itemsize), lengths),), None)


class _Starts:
    """Token offsets from memory-mapped byte pointers, without materializing them."""

    def __init__(self, pointers: np.ndarray, itemsize: int):
        self._pointers, self._itemsize = pointers, itemsize

    def __len__(self) -> int:
        return len(self._pointers)

    def __getitem__(self, index: int) -> int:
        return int(self._pointers[index]) // self._itemsize
