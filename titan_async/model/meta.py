"""The whole model on the meta device, as training would build it: what `plan` splits into
stages and measures, and what `export` maps to Hugging Face names."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.tools.utils import set_default_dtype

from titan_async.config.run_config import RunConfig
from titan_async.core.errors import UserError
from titan_async.model.llama import build_model_spec


@dataclass(frozen=True)
class MetaModel:
    """The model spec training would use and the whole model built from it on the meta device.

    `module` is never parallelized: torchtitan's pipeline split deep-copies the modules of
    each stage, and a dry run without pipeline parallelism works on a copy."""

    spec: ModelSpec
    module: torch.nn.Module


def build_meta_model(run: RunConfig, vocab: int, fsdp: bool) -> MetaModel:
    """`run`'s model on meta, its config updated for the parallelism as the trainer does."""
    try:
        spec = build_model_spec(run.model, vocab, fsdp=fsdp)
        spec.model.update_from_config(config=SimpleNamespace(parallelism=run.parallelism))
    except (ValueError, NotImplementedError) as err:
        raise UserError(f"{run.source}: {err}") from None
    with torch.device("meta"), set_default_dtype(TORCH_DTYPE_MAP[run.training.dtype]):
        return MetaModel(spec, spec.model.build())
