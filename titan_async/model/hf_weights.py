"""Starting a run from Hugging Face Llama weights (`checkpoint.initial_load_in_hf`).

torchtitan loads them (its HF storage reader and llama3 state-dict adapter); this module
checks beforehand, in one process, that the directory holds exactly the tensors the
config's model needs, so that a mismatch is one line naming it rather than a failure
inside every worker.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torchtitan.protocols.model_spec import ModelSpec

from titan_async.core.errors import UserError

EMBEDDING = "model.embed_tokens.weight"


def check_hf_weights(path: str, spec: ModelSpec, source: str) -> None:
    """UserError unless the safetensors in `path` have the names and shapes of `spec`'s model."""
    key = f"{source}: checkpoint.initial_load_path = {path!r}"
    if not path:
        raise UserError(f"{source}: checkpoint.initial_load_in_hf = true needs checkpoint.initial_load_path (a Hugging Face Llama directory)")
    directory = Path(path)
    if not directory.is_dir() or not any(directory.glob("*.safetensors")):
        raise UserError(f"{key}: expected a directory of Hugging Face *.safetensors weights")
    with torch.device("meta"):
        model = spec.model.build()
    adapter = spec.state_dict_adapter(spec.model, None)
    expected = {name: tuple(t.shape) for name, t in adapter.to_hf(model.state_dict()).items()}
    stored = {name: tuple(meta.size) for name, meta in HuggingFaceStorageReader(path).read_metadata().state_dict_metadata.items()}
    if EMBEDDING in stored and stored[EMBEDDING][0] != expected[EMBEDDING][0]:
        raise UserError(
            f"{key}: its vocabulary has {stored[EMBEDDING][0]} tokens, the config's model "
            f"{expected[EMBEDDING][0]} (model.vocab_size, 0 = data.tokenizer's size)"
        )
    for name, shape in expected.items():
        if name not in stored:
            raise UserError(f"{key}: no tensor {name}, which the config's model needs")
        if stored[name] != shape:
            raise UserError(f"{key}: {name} has shape {stored[name]}, the config's model needs {shape}")
    unused = sorted(set(stored) - set(expected) - {"lm_head.weight"})
    if unused:
        raise UserError(f"{key}: {unused[0]} has no place in the config's model (model.n_layers and the other [model] sizes must match)")
