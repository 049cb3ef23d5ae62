"""The `[data]` section: where training data and the tokenizer come from (`sources.prepare` opens it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(kw_only=True, slots=True)
class DataSection:
    """Training and validation text, and the tokenizer."""

    source: Literal["stdlib", "files", "hf", "tokens"] = "stdlib"
    """stdlib: a corpus built offline from Python's standard library; files: local
    jsonl/json/parquet/txt files; hf: a Hugging Face data set, streamed; tokens: token
    files, from `titan-async prepare` or Megatron-LM's preprocessing."""
    path: str = ""
    """files: a file, directory or glob of training files; hf: the data set id (e.g. allenai/c4);
    tokens: a directory `titan-async prepare` wrote, or a Megatron-LM PREFIX (PREFIX.bin + PREFIX.idx)."""
    validation_path: str = ""
    """files, tokens: held-out data, given as data.path is (needed when validation is on)."""
    paths: list[str] = field(default_factory=list)
    """tokens: several sources, mixed (instead of data.path); each as data.path would be."""
    weights: list[float] = field(default_factory=list)
    """tokens: each source's share of the samples, one per data.paths entry (empty: equal)."""
    names: list[str] = field(default_factory=list)
    """tokens: each source's name in logs and metrics (empty: the last component of its path)."""
    stage_steps: list[int] = field(default_factory=list)
    """tokens: the steps at which the mixture changes, strictly increasing from 0 (with data.stage_weights)."""
    stage_weights: list[list[float]] = field(default_factory=list)
    """tokens: one weight list per stage of data.stage_steps, one weight per source."""
    validation_paths: list[str] = field(default_factory=list)
    """tokens: held-out data per source of data.paths, each validated and logged apart."""
    hf_subset: str = ""
    """hf: the data set's configuration name (e.g. en), if it has several."""
    train_split: str = "train"
    """hf: split to train on."""
    validation_split: str = "validation"
    """hf: split to validate on."""
    text_field: str = "text"
    """Field that holds each document's text (txt files: one document per line)."""
    tokenizer: str = ""
    """Directory with tokenizer.json (and tokenizer_config.json); empty: the built-in
    byte-level BPE trained on the stdlib corpus."""
    vocab_size: int = 2048
    """Vocabulary size of the built-in tokenizer."""
