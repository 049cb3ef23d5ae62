"""`titan-async export`: a checkpoint as a Hugging Face model directory (Llama, or Qwen3-MoE for
mixture-of-experts runs; transformers, vLLM, lm-eval).

The conversion (config.json, Hugging Face entry names, tensors, tokenizer) is
`model.hf_conversion`'s; this command writes it out: the weights as safetensors shards, read
one block of entries at a time so that memory holds at most one output shard, the tokenizer
files, all in a directory built beside `--out` and moved into place at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn
from safetensors.torch import save_file
from torchtitan.components.tokenizer import HuggingFaceTokenizer

from titan_async.core.errors import UserError
from titan_async.model.hf_conversion import DTYPES, conversion, hf_fast_tokenizer, read_hf_tensors
from titan_async.rundir.checkpoints import checked_step

SHARD_BYTES = 5 * 2**30
"""Largest safetensors file written (Hugging Face's default shard size)."""


def _blocks(names: list[str]) -> list[list[str]]:
    """Entries grouped as read: the embedding, each transformer block, the rest."""
    blocks: dict[str, list[str]] = {}
    for name in names:
        parts = name.split(".")
        blocks.setdefault(".".join(parts[:2]) if parts[0] == "layers" else parts[0], []).append(name)
    return list(blocks.values())


def _shards(blocks: list[list[str]], nbytes: dict[str, int]) -> list[list[list[str]]]:
    """Consecutive blocks packed into shards of at most SHARD_BYTES (a larger block stands alone)."""
    shards: list[list[list[str]]] = [[]]
    size = 0
    for block in blocks:
        block_bytes = sum(nbytes[name] for name in block)
        if shards[-1] and size + block_bytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(block)
        size += block_bytes
    return shards


def _write_weights(checkpoint: Path, out: Path, adapter, entries: dict[str, tuple[torch.Size, torch.dtype]], dtype) -> None:
    """model.safetensors, or model-0000i-of-0000n.safetensors shards and their index."""
    nbytes = {name: shape.numel() * dtype.itemsize for name, (shape, _) in entries.items()}
    shards = _shards(_blocks(list(entries)), nbytes)
    files = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))
    ]
    weight_map = {}
    columns = (TextColumn("export"), BarColumn(), DownloadColumn(), TimeRemainingColumn())
    with Progress(*columns, transient=True, disable=not sys.stderr.isatty()) as progress:
        task = progress.add_task("export", total=sum(nbytes.values()))
        for file, shard in zip(files, shards):
            tensors = {}
            for block in shard:
                for hf_name, tensor in read_hf_tensors(checkpoint, adapter, entries, block).items():
                    tensors[hf_name] = tensor.to(dtype).contiguous()
                    weight_map[hf_name] = file
                progress.advance(task, sum(nbytes[name] for name in block))
            save_file(tensors, str(out / file), metadata={"format": "pt"})
            (out / file).chmod(0o644)
    if len(files) > 1:
        index = {"metadata": {"total_size": sum(nbytes.values())}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _write_tokenizer(source: Path, tokenizer: HuggingFaceTokenizer, out: Path) -> None:
    """tokenizer.json (`hf_fast_tokenizer`) and a tokenizer_config.json naming BOS and EOS."""
    hf_fast_tokenizer(source, tokenizer).save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def _claim_output(out: Path, overwrite: bool) -> Path:
    """A fresh directory beside `out` to write into; UserError if `out` holds files and not `overwrite`."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise UserError(f"--out {out}: exists and is not empty; pass --overwrite to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    scratch.chmod(0o755)
    return scratch


def export_checkpoint(checkpoint: Path, out: Path, dtype: str = "float32", overwrite: bool = False) -> None:
    """Write `checkpoint`'s model as a Hugging Face model directory at `out`. The export is built
    beside `out` and moved into place at the end, so a failed export leaves `out` as it was."""
    checked_step(checkpoint)
    scratch = _claim_output(out, overwrite)
    try:
        hf = conversion(checkpoint, dtype)
        _write_weights(checkpoint, scratch, hf.adapter, hf.entries, DTYPES[dtype])
        (scratch / "config.json").write_text(json.dumps(hf.config, indent=2))
        generation = {"bos_token_id": hf.tokenizer.bos_id, "eos_token_id": hf.tokenizer.eos_id}
        (scratch / "generation_config.json").write_text(json.dumps(generation, indent=2))
        _write_tokenizer(hf.tokenizer_source, hf.tokenizer, scratch)
        if out.exists():
            shutil.rmtree(out)
        os.replace(scratch, out)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
