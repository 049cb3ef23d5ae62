"""Tests for the offline stdlib corpus and its torchtitan integration."""

from __future__ import annotations

import itertools
import json
import logging
import multiprocessing
import shutil
import sys
import sysconfig
import time
import zlib
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from titan_async.data import stdlib_corpus
from titan_async.data.stdlib_corpus import (
    BOS_TOKEN,
    EOS_TOKEN,
    MAX_DOCUMENT_CHARS,
    CorpusFiles,
    Document,
    collect_documents,
    default_cache_dir,
    ensure_corpus,
    register_datasets,
)

VOCAB_SIZE = 512
SEQ_LEN = 64


class _RecordingHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _ensure_and_count_builds(cache_dir: str) -> tuple[str, int]:
    """Child process: ensure the corpus, return the manifest text and how many builds it logged."""
    handler = _RecordingHandler()
    module_logger = logging.getLogger(stdlib_corpus.__name__)
    module_logger.setLevel(logging.INFO)
    module_logger.addHandler(handler)
    files = ensure_corpus(Path(cache_dir), vocab_size=VOCAB_SIZE)
    return _manifest_path(files).read_text(encoding="utf-8"), len(handler.records)


def _manifest_path(files: CorpusFiles) -> Path:
    return files.train.parent / "manifest.json"


def _texts(path: Path) -> list[str]:
    with path.open(encoding="utf-8") as lines:
        return [json.loads(line)["text"] for line in lines]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def corpus(cache_dir: Path) -> CorpusFiles:
    return ensure_corpus(cache_dir, vocab_size=VOCAB_SIZE)


@pytest.fixture(scope="module")
def manifest(corpus: CorpusFiles) -> dict[str, Any]:
    return json.loads(_manifest_path(corpus).read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def documents() -> list[Document]:
    return collect_documents()


@pytest.fixture(scope="module")
def tokenizer(corpus: CorpusFiles):
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    return HuggingFaceTokenizer.Config().build(tokenizer_path=str(corpus.tokenizer_dir))


def test_default_cache_dir_honours_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("TITAN_ASYNC_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("TITAN_ASYNC_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "titan-async"


def test_outputs_exist_and_are_non_empty(
    corpus: CorpusFiles, cache_dir: Path, manifest: dict[str, Any]
) -> None:
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert corpus.train.parent == cache_dir / f"stdlib-corpus-py{version}"
    assert corpus.tokenizer_dir == corpus.train.parent / f"tokenizer-{VOCAB_SIZE}"
    for path in (
        corpus.train,
        corpus.validation,
        corpus.tokenizer_dir / "tokenizer.json",
        corpus.tokenizer_dir / "tokenizer_config.json",
        _manifest_path(corpus),
    ):
        assert path.stat().st_size > 0, path
    assert manifest["python"] == version
    assert manifest["tokenizers"] == {str(VOCAB_SIZE): {"vocab_size": VOCAB_SIZE}}
    splits = manifest["splits"]
    assert splits["train"]["documents"] == len(_texts(corpus.train))
    assert splits["validation"]["documents"] == len(_texts(corpus.validation))
    assert splits["train"]["file_bytes"] == corpus.train.stat().st_size
    assert splits["train"]["pydoc_topics"] > 0
    total_text = splits["train"]["text_bytes"] + splits["validation"]["text_bytes"]
    assert 5_000_000 < total_text < 40_000_000


def test_split_files_hold_collected_documents_in_order(
    corpus: CorpusFiles, documents: list[Document]
) -> None:
    assert _texts(corpus.train) == [d.text for d in documents if d.split == "train"]
    assert _texts(corpus.validation) == [d.text for d in documents if d.split == "validation"]


def test_splits_share_no_source_file(documents: list[Document]) -> None:
    splits_of_source: dict[str, set[str]] = defaultdict(set)
    for doc in documents:
        splits_of_source[doc.source].add(doc.split)
    assert all(len(splits) == 1 for splits in splits_of_source.values())
    validation_sources = {d.source for d in documents if d.split == "validation"}
    assert validation_sources
    for source in validation_sources:
        assert source.endswith(".py")
        assert zlib.crc32(source.encode()) % 100 < 2


def test_validation_is_a_small_fraction(manifest: dict[str, Any]) -> None:
    train = manifest["splits"]["train"]["documents"]
    validation = manifest["splits"]["validation"]["documents"]
    assert 0.01 <= validation / (train + validation) <= 0.04


def test_documents_are_bounded_chunks_of_whole_files(documents: list[Document]) -> None:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    chunks: dict[str, list[str]] = defaultdict(list)
    for doc in sorted(documents, key=lambda d: (d.source, d.chunk)):
        assert 0 < len(doc.text) <= MAX_DOCUMENT_CHARS
        chunks[doc.source].append(doc.text)
    files = [source for source in chunks if source.endswith(".py")]
    assert "os.py" in files and "json/decoder.py" in files
    assert "pydoc_data/topics.py" not in files
    for source in files:
        parts = set(Path(source).parts)
        assert not parts & {"site-packages", "test", "tests", "idle_test"}, source
        assert "".join(chunks[source]) == (stdlib / source).read_bytes().decode("utf-8")
    assert any(len(pieces) > 1 for pieces in chunks.values())


def test_second_call_is_cached(
    corpus: CorpusFiles, cache_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    mtime = corpus.train.stat().st_mtime_ns
    with caplog.at_level(logging.INFO, logger=stdlib_corpus.__name__):
        start = time.perf_counter()
        again = ensure_corpus(cache_dir, vocab_size=VOCAB_SIZE)
        elapsed = time.perf_counter() - start
    assert again == corpus
    assert elapsed < 0.5
    assert corpus.train.stat().st_mtime_ns == mtime
    assert caplog.records == []


def test_new_vocab_size_reuses_the_corpus(
    corpus: CorpusFiles, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    shutil.copytree(corpus.train.parent, tmp_path / corpus.train.parent.name)
    copied = tmp_path / corpus.train.parent.name / "train.jsonl"
    mtime = copied.stat().st_mtime_ns
    with caplog.at_level(logging.INFO, logger=stdlib_corpus.__name__):
        files = ensure_corpus(tmp_path, vocab_size=300)
    assert len(caplog.records) == 1
    assert files.train == copied and copied.stat().st_mtime_ns == mtime
    assert (files.tokenizer_dir / "tokenizer.json").is_file()
    manifest = json.loads(_manifest_path(files).read_text(encoding="utf-8"))
    assert set(manifest["tokenizers"]) == {str(VOCAB_SIZE), "300"}


def test_missing_manifest_triggers_a_deterministic_rebuild(
    corpus: CorpusFiles, tmp_path: Path
) -> None:
    shutil.copytree(corpus.train.parent, tmp_path / corpus.train.parent.name)
    copied = tmp_path / corpus.train.parent.name / "train.jsonl"
    (copied.parent / "manifest.json").unlink()
    mtime = copied.stat().st_mtime_ns
    files = ensure_corpus(tmp_path, vocab_size=VOCAB_SIZE)
    assert files.train.stat().st_mtime_ns != mtime
    assert files.train.read_bytes() == corpus.train.read_bytes()
    tokenizer_json = files.tokenizer_dir / "tokenizer.json"
    assert tokenizer_json.read_bytes() == (corpus.tokenizer_dir / "tokenizer.json").read_bytes()
    assert _manifest_path(files).read_text() == _manifest_path(corpus).read_text()


def test_rejects_vocab_smaller_than_byte_alphabet(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        ensure_corpus(tmp_path, vocab_size=200)


def test_tokenizer_through_torchtitan(tokenizer) -> None:
    assert tokenizer.get_vocab_size() == VOCAB_SIZE
    bos, eos = tokenizer.token_to_id(BOS_TOKEN), tokenizer.token_to_id(EOS_TOKEN)
    assert (tokenizer.bos_id, tokenizer.eos_id) == (bos, eos)
    for text in ("def f(x):\n    return x + 1  # one\n", "héllo → 世界", " tab\tand  spaces "):
        ids = tokenizer.encode(text, add_bos=True, add_eos=True)
        assert ids[0] == bos and ids[-1] == eos
        assert ids.count(bos) == 1 and ids.count(eos) == 1
        assert tokenizer.decode(ids) == text
        assert tokenizer.encode(text) == ids[1:-1]


def test_concurrent_builds_agree(tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")
    with context.Pool(2) as pool:
        results = pool.map(_ensure_and_count_builds, [str(tmp_path)] * 2)
    (first, first_builds), (second, second_builds) = results
    assert first == second
    assert json.loads(first)["tokenizers"] == {str(VOCAB_SIZE): {"vocab_size": VOCAB_SIZE}}
    assert sorted([first_builds, second_builds]) == [0, 1]
    assert not list(tmp_path.rglob("*.tmp"))


def test_registered_datasets_feed_torchtitan(
    corpus: CorpusFiles,
    manifest: dict[str, Any],
    tokenizer,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    import datasets
    from torchtitan.hf_datasets import text_datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")
    monkeypatch.setattr(text_datasets, "DATASETS", dict(text_datasets.DATASETS))
    names = register_datasets(corpus)
    assert register_datasets(corpus) == names == ("stdlib", "stdlib_validation")

    splits = (("train", corpus.train), ("validation", corpus.validation))
    for name, (split, path) in zip(names, splits):
        config = text_datasets.DATASETS[name]
        assert config.path == str(path)
        loaded = config.loader(config.path)
        assert isinstance(loaded, datasets.Dataset)
        assert len(loaded) == manifest["splits"][split]["documents"]

        dataset = text_datasets.HuggingFaceTextDataset(
            dataset_name=name, dataset_path=None, tokenizer=tokenizer, seq_len=SEQ_LEN
        )
        samples = list(itertools.islice(dataset, 3))
        assert len(samples) == 3
        for inputs, labels in samples:
            assert inputs["input"].shape == inputs["positions"].shape == (SEQ_LEN,)
            assert labels.shape == (SEQ_LEN,)
        first_document = config.sample_processor(loaded[0])
        expected = tokenizer.encode(first_document, add_bos=True, add_eos=True)
        assert len(expected) > SEQ_LEN + 1
        assert samples[0][0]["input"].tolist() == expected[:SEQ_LEN]
        assert samples[0][1].tolist() == expected[1 : SEQ_LEN + 1]
