"""`titan-async prepare`: tokenize text files once into token shards that `data.source = "tokens"` reads.

One shard per input file, tokenized by a pool of worker processes. Each document becomes exactly
the tokens torchtitan's HF text dataset makes of it (its tokenizer's `encode` with BOS and EOS),
read by the same `datasets` builder the `files` source uses, so a prepared run sees the token
stream of a `files` run of the same text.

A shard is written under temporary names and renamed, then its receipt (`shard-N.json`, its
manifest entry plus what it was made from) is renamed into place: a rerun after an interruption
keeps every shard whose receipt matches its source file, the tokenizer and the text field and whose
files have the recorded sizes (`--verify`: and sha256), and redoes the rest. `manifest.json` is
written last, atomically.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from titan_async.core.errors import UserError
from titan_async.data.sources import text_files
from titan_async.data.token_files import FORMAT_VERSION, MANIFEST, sha256, shard_problem, token_dtype

_WRITE_DOCUMENTS = 4096
"""Documents tokenized between two writes (and progress reports) of a shard."""


@dataclass(frozen=True)
class ShardJob:
    """What one worker turns into one shard."""

    index: int
    source: str
    builder: str
    out: str
    tokenizer_dir: str
    text_field: str
    dtype: str
    receipt: dict
    """What the shard is made from: a kept shard's receipt must match it."""

    @property
    def name(self) -> str:
        return f"shard-{self.index:05d}"


@dataclass(frozen=True)
class PrepareResult:
    manifest: dict
    tokens_written: int
    shards_kept: int
    seconds: float
    workers: int


def prepare_tokens(inputs: list[str], out: Path, tokenizer_dir: Path, text_field: str = "text",
                   workers: int | None = None, verify: bool = False, progress: bool = True) -> PrepareResult:
    """Tokenize the files `inputs` name into shards under `out` and write its manifest."""
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    files = [(builder, f) for pattern in inputs for builder, f in _each_file(pattern)]
    vocab_size = HuggingFaceTokenizer(tokenizer_path=str(tokenizer_dir)).get_vocab_size()
    dtype = token_dtype(vocab_size)
    tokenizer_sha = sha256(tokenizer_dir / "tokenizer.json")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"--out {out}: cannot be made a directory: {err.strerror}") from None
    jobs = [ShardJob(i, f, builder, str(out), str(tokenizer_dir), text_field, dtype.name,
                     {"source": str(Path(f).resolve()), **_stamp(f), "tokenizer_sha256": tokenizer_sha,
                      "text_field": text_field, "dtype": dtype.name})
            for i, (builder, f) in enumerate(files)]
    entries = {job.index: entry for job in jobs if (entry := _kept_shard(job, dtype.itemsize, verify))}
    todo = [job for job in jobs if job.index not in entries]
    workers = max(1, min(workers or os.cpu_count() or 1, len(todo) or 1))
    start = time.perf_counter()
    entries.update(_run(todo, workers, progress))
    seconds = time.perf_counter() - start
    manifest = {
        "format_version": FORMAT_VERSION, "dtype": dtype.name, "vocab_size": vocab_size,
        "tokenizer_sha256": tokenizer_sha, "text_field": text_field,
        "shards": [entries[job.index] for job in jobs],
    }
    _write_atomically(out / MANIFEST, json.dumps(manifest, indent=1))
    written = sum(entries[job.index]["token_count"] for job in todo)
    return PrepareResult(manifest, written, len(jobs) - len(todo), seconds, workers)


def _each_file(pattern: str) -> list[tuple[str, str]]:
    builder, files = text_files(pattern, "INPUT")
    return [(builder, f) for f in files]


def _stamp(path: str) -> dict:
    stat = Path(path).stat()
    return {"source_bytes": stat.st_size, "source_mtime_ns": stat.st_mtime_ns}


def _kept_shard(job: ShardJob, itemsize: int, verify: bool) -> dict | None:
    """The manifest entry of `job`'s shard when a complete one made from the same input is on disk."""
    out = Path(job.out)
    try:
        receipt = json.loads((out / f"{job.name}.json").read_text())
    except (OSError, ValueError):
        return None
    entry = receipt.pop("shard", None)
    if receipt != job.receipt or entry is None or shard_problem(out, entry, itemsize, checksum=verify):
        return None
    return entry


def _run(jobs: list[ShardJob], workers: int, progress: bool) -> dict[int, dict]:
    """Write the shards of `jobs` on `workers` processes, with a progress bar: index -> manifest entry."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    if not jobs:
        return {}
    context = multiprocessing.get_context("spawn")
    columns = (TextColumn("tokenizing"), BarColumn(), MofNCompleteColumn(), TextColumn("shards, {task.fields[tokens]:,} tokens"),
               TimeElapsedColumn())
    entries: dict[int, dict] = {}
    with context.Manager() as manager, Progress(*columns, disable=not progress) as bar:
        reports = manager.Queue()
        with ProcessPoolExecutor(workers, mp_context=context, initializer=_set_reports, initargs=(reports,)) as pool:
            task = bar.add_task("shards", total=len(jobs), tokens=0)
            pending, tokens = {pool.submit(write_shard, job) for job in jobs}, 0
            while pending:
                done, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
                for future in done:
                    index, entry = future.result()
                    entries[index] = entry
                while not reports.empty():
                    tokens += reports.get()
                bar.update(task, completed=len(entries), tokens=tokens)
    return entries


_reports = None


def _set_reports(queue) -> None:
    global _reports
    _reports = queue


def write_shard(job: ShardJob) -> tuple[int, dict]:
    """Tokenize `job.source` into the shard `job.name` under `job.out`: its index and manifest entry."""
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    tokenizer = HuggingFaceTokenizer(tokenizer_path=job.tokenizer_dir)
    out = Path(job.out)
    tokens_path, docs_path = out / f"{job.name}.tokens", out / f"{job.name}.docs"
    temporary = {path: path.with_name(path.name + ".tmp") for path in (tokens_path, docs_path)}
    digest, offsets, max_id, pending = hashlib.sha256(), [0], -1, []
    with temporary[tokens_path].open("wb") as f:
        for number, row in enumerate(_rows(job)):
            if job.text_field not in row:
                raise UserError(f"--text-field {job.text_field!r}: document {number} of {job.source} has no such field "
                                f"(it has {sorted(row)})")
            ids = tokenizer.encode(row[job.text_field], add_bos=True, add_eos=True)
            pending.append(ids)
            offsets.append(offsets[-1] + len(ids))
            if len(pending) == _WRITE_DOCUMENTS:
                max_id = max(max_id, _write(f, pending, job.dtype, digest))
                pending = []
        max_id = max(max_id, _write(f, pending, job.dtype, digest))
        f.flush()
        os.fsync(f.fileno())
    np.asarray(offsets, dtype=np.int64).tofile(temporary[docs_path])
    for final, tmp in temporary.items():
        tmp.replace(final)
    entry = {"tokens": tokens_path.name, "docs": docs_path.name, "token_count": offsets[-1],
             "document_count": len(offsets) - 1, "max_token_id": max_id, "sha256": digest.hexdigest(),
             "source": job.source}
    _write_atomically(out / f"{job.name}.json", json.dumps({**job.receipt, "shard": entry}))
    return job.index, entry


def _rows(job: ShardJob):
    """The rows of `job.source`, read by the `datasets` builder the `files` source uses; an unreadable
    file is a UserError naming it."""
    from datasets import load_dataset

    number = 0
    try:
        for number, row in enumerate(load_dataset(job.builder, data_files=[job.source], split="train", streaming=True)):
            yield row
    except (ValueError, OSError) as err:
        raise UserError(f"prepare {job.source}: unreadable as {job.builder} after {number} document(s): {err}") from None


def _write(f, documents: list[list[int]], dtype: str, digest) -> int:
    """Append `documents`' tokens to `f`; the largest id among them (-1 for none)."""
    if not documents:
        return -1
    ids = np.fromiter((t for d in documents for t in d), dtype=np.int64)
    if not len(ids):
        return -1
    data = ids.astype(dtype).tobytes()
    f.write(data)
    digest.update(data)
    if _reports is not None:
        _reports.put(len(ids))
    return int(ids.max())


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
