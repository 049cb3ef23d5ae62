"""Offline default corpus: the running Python's standard library.

`ensure_corpus` builds, on first use, JSON-lines train/validation splits of the
stdlib's ``.py`` sources plus the ``pydoc_data`` help topics, and a byte-level
BPE tokenizer trained on the train split; later calls return the cached files.
`register_datasets` makes both splits loadable by torchtitan's text dataloader.

Layout under the cache directory::

    stdlib-corpus-py<major>.<minor>/
        train.jsonl, validation.jsonl     one {"text": ...} object a line
        tokenizer-<vocab_size>/           tokenizer.json, tokenizer_config.json
        manifest.json                     written last; marks the build complete
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import sys
import sysconfig
import tempfile
import time
import zlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from pydoc_data.topics import topics as pydoc_topics
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

if TYPE_CHECKING:
    from datasets import Dataset

logger = logging.getLogger(__name__)

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
MAX_DOCUMENT_CHARS = 8000
VALIDATION_PERCENT = 2
TRAIN_DATASET = "stdlib"
VALIDATION_DATASET = "stdlib_validation"

_SKIPPED_DIRS = frozenset({"site-packages", "test", "tests", "idle_test", "__pycache__"})
_TOPICS_MODULE = "pydoc_data/topics.py"
_TOPIC_SOURCE_PREFIX = "pydoc_data.topics:"
_MANIFEST = "manifest.json"
_LOCK = "stdlib-corpus.lock"
_MIN_VOCAB_SIZE = 256 + 2


def default_cache_dir() -> Path:
    """Return ``$TITAN_ASYNC_CACHE`` if set and non-empty, else ``~/.cache/titan-async``."""
    configured = os.environ.get("TITAN_ASYNC_CACHE")
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "titan-async"


@dataclass(frozen=True)
class CorpusFiles:
    """Paths of a built corpus: the two JSON-lines splits and the tokenizer directory."""

    train: Path
    validation: Path
    tokenizer_dir: Path


@dataclass(frozen=True)
class Document:
    """One corpus document: a chunk of `source` (a stdlib-relative path or a pydoc topic)."""

    source: str
    chunk: int
    split: str
    text: str


def ensure_corpus(cache_dir: Path | None = None, vocab_size: int = 2048) -> CorpusFiles:
    """Return the stdlib corpus and its `vocab_size` tokenizer, building whatever is missing.

    Returns immediately when the manifest and all files exist. Otherwise takes an
    exclusive lock in `cache_dir` (default `default_cache_dir()`), so concurrent
    callers build once and the rest reuse the result.
    """
    if vocab_size < _MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be at least {_MIN_VOCAB_SIZE}, got {vocab_size}")
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    corpus_dir = root / f"stdlib-corpus-py{sys.version_info.major}.{sys.version_info.minor}"
    files = CorpusFiles(
        train=corpus_dir / "train.jsonl",
        validation=corpus_dir / "validation.jsonl",
        tokenizer_dir=corpus_dir / f"tokenizer-{vocab_size}",
    )
    if _is_complete(files, vocab_size):
        return files
    corpus_dir.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(root / _LOCK):
        if not _is_complete(files, vocab_size):
            _build(files, vocab_size)
    return files


def collect_documents(stdlib_dir: Path | None = None) -> list[Document]:
    """Return every corpus document in corpus order, each tagged with its split.

    Chunks are ordered by a hash of (source, chunk index), which mixes files
    deterministically (torchtitan reads the first epoch in order, unshuffled);
    a long text becomes consecutive chunks of at most `MAX_DOCUMENT_CHARS`
    characters cut on line boundaries. All chunks of one file share a split.
    """
    root = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    sources = _stdlib_sources(root) + [(_TOPIC_SOURCE_PREFIX + name, text) for name, text in pydoc_topics.items()]
    documents = [
        Document(source=name, chunk=index, split=_split_of(name), text=chunk)
        for name, text in sources
        for index, chunk in enumerate(_chunks(text, MAX_DOCUMENT_CHARS))
    ]
    return sorted(documents, key=lambda d: (zlib.crc32(f"{d.source}:{d.chunk}".encode()), d.source, d.chunk))


def register_datasets(files: CorpusFiles) -> tuple[str, str]:
    """Register the train and validation splits in torchtitan's dataset registry.

    Each entry loads its split as a map-style `datasets.Dataset` and yields the
    ``text`` field. Re-registering replaces the entries. Returns the two names.
    """
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS

    for name, path in ((TRAIN_DATASET, files.train), (VALIDATION_DATASET, files.validation)):
        DATASETS[name] = DatasetConfig(
            path=str(path), loader=_load_jsonl, sample_processor=_sample_text
        )
    return TRAIN_DATASET, VALIDATION_DATASET


def _load_jsonl(path: str) -> Dataset:
    """Load a JSON-lines split as a map-style dataset."""
    from datasets import load_dataset

    return load_dataset("json", data_files=str(path), split="train")


def _sample_text(sample: dict[str, Any]) -> str:
    """Return the text of one dataset row."""
    return sample["text"]


def _stdlib_sources(root: Path) -> list[tuple[str, str]]:
    """Return (relative posix path, text) of every UTF-8 stdlib module with content, sorted."""
    sources = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIPPED_DIRS]
        for filename in filenames:
            path = Path(dirpath) / filename
            relative = path.relative_to(root).as_posix()
            if path.suffix != ".py" or relative == _TOPICS_MODULE:
                continue
            try:
                text = path.read_bytes().decode("utf-8")
            except UnicodeDecodeError:
                continue
            if text.strip():
                sources.append((relative, text))
    return sorted(sources)


def _split_of(source: str) -> str:
    """Return "validation" for about `VALIDATION_PERCENT`% of stdlib files, else "train"."""
    if source.startswith(_TOPIC_SOURCE_PREFIX):
        return "train"
    if zlib.crc32(source.encode()) % 100 < VALIDATION_PERCENT:
        return "validation"
    return "train"


def _chunks(text: str, max_chars: int) -> list[str]:
    """Cut `text` into pieces of at most `max_chars` whose concatenation is `text`.

    Cuts fall on line boundaries; a single line longer than `max_chars` is cut inside.
    """
    chunks: list[str] = []
    current: list[str] = []
    size = 0
    for line in text.splitlines(keepends=True):
        for start in range(0, len(line), max_chars):
            piece = line[start : start + max_chars]
            if size + len(piece) > max_chars and current:
                chunks.append("".join(current))
                current, size = [], 0
            current.append(piece)
            size += len(piece)
    if current:
        chunks.append("".join(current))
    return chunks


def _is_complete(files: CorpusFiles, vocab_size: int) -> bool:
    """True when the manifest records the `vocab_size` tokenizer and every file exists."""
    manifest = _read_manifest(files.train.parent)
    return (
        manifest is not None
        and str(vocab_size) in manifest["tokenizers"]
        and _corpus_exists(files)
        and _tokenizer_exists(files.tokenizer_dir)
    )


def _corpus_exists(files: CorpusFiles) -> bool:
    """True when both split files exist."""
    return files.train.is_file() and files.validation.is_file()


def _tokenizer_exists(tokenizer_dir: Path) -> bool:
    """True when both tokenizer files exist in `tokenizer_dir`."""
    return all(
        (tokenizer_dir / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")
    )


def _read_manifest(corpus_dir: Path) -> dict[str, Any] | None:
    """Return the parsed manifest of `corpus_dir`, or None when there is none."""
    path = corpus_dir / _MANIFEST
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


def _build(files: CorpusFiles, vocab_size: int) -> None:
    """Write whatever of the corpus and tokenizer is missing, then the manifest."""
    start = time.perf_counter()
    corpus_dir = files.train.parent
    manifest = _read_manifest(corpus_dir)
    if manifest is None or not _corpus_exists(files):
        (corpus_dir / _MANIFEST).unlink(missing_ok=True)
        manifest = _write_splits(files)
    tokenizer = _train_tokenizer(_read_texts(files.train), vocab_size)
    _write_tokenizer(tokenizer, files.tokenizer_dir)
    manifest["tokenizers"][str(vocab_size)] = {"vocab_size": tokenizer.get_vocab_size()}
    with _atomic_writer(corpus_dir / _MANIFEST) as out:
        json.dump(manifest, out, indent=2, sort_keys=True)
    train, validation = manifest["splits"]["train"], manifest["splits"]["validation"]
    logger.info(
        "Built stdlib corpus in %s in %.1fs: train %d documents (%d bytes), "
        "validation %d documents (%d bytes), tokenizer vocab %d",
        corpus_dir,
        time.perf_counter() - start,
        train["documents"],
        train["text_bytes"],
        validation["documents"],
        validation["text_bytes"],
        vocab_size,
    )


def _write_splits(files: CorpusFiles) -> dict[str, Any]:
    """Write both JSON-lines splits; return a manifest (without tokenizers) describing them."""
    documents = collect_documents()
    splits = {}
    for split, path in (("train", files.train), ("validation", files.validation)):
        selected = [doc for doc in documents if doc.split == split]
        with _atomic_writer(path) as out:
            for doc in selected:
                out.write(json.dumps({"text": doc.text}, ensure_ascii=False) + "\n")
        sources = {doc.source for doc in selected}
        splits[split] = {
            "files": sum(not s.startswith(_TOPIC_SOURCE_PREFIX) for s in sources),
            "pydoc_topics": sum(s.startswith(_TOPIC_SOURCE_PREFIX) for s in sources),
            "documents": len(selected),
            "text_bytes": sum(len(doc.text.encode()) for doc in selected),
            "file_bytes": path.stat().st_size,
        }
    return {
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "max_document_chars": MAX_DOCUMENT_CHARS,
        "validation_percent": VALIDATION_PERCENT,
        "splits": splits,
        "tokenizers": {},
    }


def _read_texts(path: Path) -> Iterator[str]:
    """Yield the texts of a JSON-lines split in file order."""
    with path.open(encoding="utf-8") as lines:
        for line in lines:
            yield json.loads(line)["text"]


def _train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE with BOS/EOS specials; its vocabulary is exactly `vocab_size`."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(
            f"trained tokenizer has {tokenizer.get_vocab_size()} tokens, expected {vocab_size}"
        )
    return tokenizer


def _write_tokenizer(tokenizer: Tokenizer, tokenizer_dir: Path) -> None:
    """Save `tokenizer` in the layout torchtitan's HuggingFaceTokenizer loads."""
    tokenizer_dir.mkdir(parents=True, exist_ok=True)
    with _atomic_writer(tokenizer_dir / "tokenizer.json") as out:
        out.write(tokenizer.to_str(pretty=True))
    config = {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "add_bos_token": False,
        "add_eos_token": False,
    }
    with _atomic_writer(tokenizer_dir / "tokenizer_config.json") as out:
        json.dump(config, out, indent=2)


@contextmanager
def _atomic_writer(path: Path) -> Iterator[IO[str]]:
    """Yield a text file that replaces `path` atomically if, and only if, the block succeeds."""
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            os.fchmod(out.fileno(), 0o644)
            yield out
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


@contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive `flock` on `path` (created if needed) for the block."""
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
