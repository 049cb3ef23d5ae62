"""Opening the `[data]` section's sources: where training text and the tokenizer come from.

Text sources are registered in torchtitan's dataset registry, so torchtitan's own
HF text data loader (packing, per-document positions, exact resume) reads them;
token files (`tokens`) are read by `token_loader.TokenDataLoader`, which packs alike.
"""

from __future__ import annotations

import glob
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from titan_async.core.errors import UserError
from titan_async.data.section import DataSection
from titan_async.data.token_sources import MIXTURE_KEYS, token_sources

if TYPE_CHECKING:
    from torchtitan.components.dataloader import BaseDataLoader

    from titan_async.data.token_files import TokenCorpus

_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}


@dataclass(frozen=True)
class PreparedData:
    """The training and validation data loaders' configs, the tokenizer directory, and for token
    files the largest token id each key's data holds (where recorded)."""

    train_loader: BaseDataLoader.Config
    validation_loader: BaseDataLoader.Config
    tokenizer_dir: Path
    token_corpora: dict[str, tuple[str, TokenCorpus]] = field(default_factory=dict)
    """Token files: key -> (its value, the corpus it names)."""
    validation_sources: dict[str, BaseDataLoader.Config] = field(default_factory=dict)
    """A mixture's sources by name -> the loader of that source's validation data (validated apart)."""

    def check_tokens(self, vocab_size: int, seq_len: int) -> None:
        """UserError naming the key whose token data holds an id the model's vocabulary lacks (where
        recorded), or not one window of `seq_len` tokens."""
        from titan_async.data.packed_windows import PackedWindows

        for key, (path, corpus) in self.token_corpora.items():
            largest = corpus.max_token_id
            if largest is not None and largest >= vocab_size:
                raise UserError(f"{key} = {path!r}: holds token id {largest}, beyond the model's vocabulary of {vocab_size} "
                                "(model.vocab_size, or data.tokenizer's size); prepare it with the run's tokenizer")
            # Each document gives its length - 1 shifted tokens: count them only where the cheap bound falls short.
            if corpus.token_count() - len(corpus) < seq_len and not len(PackedWindows(corpus, seq_len)):
                raise UserError(f"{key} = {path!r}: holds {corpus.token_count()} tokens in {len(corpus)} documents, not one "
                                f"window of training.seq_len = {seq_len} tokens (each document gives its length - 1); "
                                "give more data or a shorter seq_len")


def text_files(pattern: str, key: str) -> tuple[str, list[str]]:
    """The loader builder name and the sorted files that `pattern` names."""
    path = Path(pattern).expanduser()
    if path.is_dir():
        files = sorted(str(p) for p in path.rglob("*") if p.suffix in _FILE_BUILDERS)
    else:
        files = sorted(glob.glob(str(path)))
    if not files:
        raise UserError(f"{key} = {pattern!r}: no jsonl/json/parquet/txt files found there")
    suffixes = {Path(f).suffix for f in files}
    if len(suffixes) != 1 or not suffixes <= _FILE_BUILDERS.keys():
        raise UserError(
            f"{key} = {pattern!r}: expected files of one type among {sorted(_FILE_BUILDERS)}, found {sorted(suffixes)}"
        )
    return _FILE_BUILDERS[suffixes.pop()], files


def _load_files(path: str, builder: str, files: list[str]):
    from datasets import load_dataset

    return load_dataset(builder, data_files=files, split="train")


def _load_hf(path: str, subset: str, split: str):
    from datasets import load_dataset

    return load_dataset(path, name=subset or None, split=split, streaming=True)


def _register(name: str, path: str, loader, text_field: str) -> str:
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS

    DATASETS[name] = DatasetConfig(path=path, loader=loader, sample_processor=lambda s: s[text_field])
    return name


def tokenizer_dir(data: DataSection, builtin: Path | None = None) -> Path:
    """The directory of the tokenizer `data` names (building the stdlib one if needed)."""
    if not data.tokenizer:
        if builtin is None:
            from titan_async.data.stdlib_corpus import ensure_corpus

            builtin = ensure_corpus(vocab_size=data.vocab_size).tokenizer_dir
        return builtin
    directory = Path(data.tokenizer).expanduser()
    if not (directory / "tokenizer.json").is_file():
        raise UserError(f"data.tokenizer = {data.tokenizer!r}: expected a directory containing tokenizer.json")
    return directory


def prepare(data: DataSection, need_validation: bool) -> PreparedData:
    """Register or open the data sets `data` describes (building the stdlib corpus if needed)."""
    for key in MIXTURE_KEYS:
        if data.source != "tokens" and getattr(data, key):
            raise UserError(f"data.{key} applies to data.source = 'tokens' only")
    if data.source == "stdlib":
        from titan_async.data.stdlib_corpus import ensure_corpus, register_datasets

        files = ensure_corpus(vocab_size=data.vocab_size)
        train, validation = register_datasets(files)
        return _text_loaders(train, validation, tokenizer_dir(data, files.tokenizer_dir))
    if data.source == "tokens":
        return _token_loaders(data, need_validation)
    if not data.path:
        raise UserError(f"data.path is required when data.source = {data.source!r}")
    if need_validation and not data.validation_path and data.source == "files":
        raise UserError(f"data.validation_path is required when validation.enable = true and data.source = {data.source!r}")
    if data.source == "files":
        builder, files = text_files(data.path, "data.path")
        train = _register("files", data.path, partial(_load_files, builder=builder, files=files), data.text_field)
        validation = ""
        if need_validation:
            builder, files = text_files(data.validation_path, "data.validation_path")
            validation = _register(
                "files_validation", data.validation_path, partial(_load_files, builder=builder, files=files), data.text_field
            )
        return _text_loaders(train, validation, tokenizer_dir(data, None))
    train = _register("hf", data.path, partial(_load_hf, subset=data.hf_subset, split=data.train_split), data.text_field)
    validation = _register(
        "hf_validation", data.path, partial(_load_hf, subset=data.hf_subset, split=data.validation_split), data.text_field
    )
    return _text_loaders(train, validation, tokenizer_dir(data, None))


def _text_loaders(train: str, validation: str, tokenizer: Path) -> PreparedData:
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

    return PreparedData(HuggingFaceTextDataLoader.Config(dataset=train),
                        HuggingFaceTextDataLoader.Config(dataset=validation, infinite=False), tokenizer)


def _token_loaders(data: DataSection, need_validation: bool) -> PreparedData:
    """Loaders over token files, after the checks that need no pass over the tokens (sizes, headers,
    the tokenizer that made them)."""
    from titan_async.data.token_files import open_tokens, sha256
    from titan_async.data.token_loader import TokenDataLoader

    if need_validation and data.path and not data.validation_path:
        raise UserError("data.validation_path is required when validation.enable = true and data.source = 'tokens'")
    sources = token_sources(data, need_validation)
    tokenizer = tokenizer_dir(data, None)
    tokenizer_sha256 = sha256(tokenizer / "tokenizer.json")
    corpora = {}
    for key, path in zip(sources.keys + sources.validation_keys, sources.paths + sources.validation_paths):
        corpus = open_tokens(path, key)
        if corpus.tokenizer_sha256 and corpus.tokenizer_sha256 != tokenizer_sha256:
            raise UserError(f"{key} = {path!r}: was tokenized by another tokenizer.json than data.tokenizer's "
                            f"({str(tokenizer)!r}); prepare it with that tokenizer, or set data.tokenizer to the one it used")
        corpora[key] = (path, corpus)
    train = TokenDataLoader.Config(sources=list(sources.paths), source_keys=list(sources.keys),
                                   stage_steps=list(sources.stage_steps), stage_weights=[list(w) for w in sources.stage_weights])
    validation = TokenDataLoader.Config(sources=list(sources.validation_paths), source_keys=list(sources.validation_keys),
                                        stage_weights=[list(sources.stage_weights[0])], infinite=False)
    apart = {}
    if len(sources.validation_paths) > 1:
        apart = {name: TokenDataLoader.Config(sources=[path], source_keys=[key], infinite=False)
                 for name, path, key in zip(sources.names, sources.validation_paths, sources.validation_keys)}
    return PreparedData(train, validation, tokenizer, corpora, apart)
