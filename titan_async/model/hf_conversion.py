"""A checkpoint as a Hugging Face model, in memory: the transformers config (config.json), the
entry names, the tensors and the tokenizer that `export` writes and `eval --tasks` loads.

The run's stored config gives the model: llama3 becomes `LlamaForCausalLM` (torchtitan's
`Llama3StateDictAdapter` maps the entries and permutes Q/K for HF's rotary layout), qwen3_moe
becomes `Qwen3MoeForCausalLM` (`Qwen3StateDictAdapter`, which splits the stacked experts). HF's
Qwen3-MoE routes by the softmax scores alone, so a checkpoint whose expert biases (load
balancing) moved is refused: its routing has no transformers equivalent. The checkpoint is
read with DCP in this one process whatever layout wrote it (DCP's metadata joins FSDP shards
and pipeline stages), any subset of entries at a time. Only the model's own entries are read:
after step N they hold W[N] for every schedule (PipeDream2BW's second version lies under
separate keys).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from tokenizers import Tokenizer, processors
from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.models.llama3 import Llama3StateDictAdapter
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

from titan_async.config.run_config import load_run_config
from titan_async.core.errors import UserError
from titan_async.data.sources import tokenizer_dir
from titan_async.model.meta import build_meta_model
from titan_async.rundir import directory as runs
from titan_async.rundir.checksummed_read import ChecksumMismatch, ChecksummedReader

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def hf_llama_config(model, bos_id: int | None, eos_id: int | None, dtype: str) -> dict:
    """The transformers `LlamaConfig` (config.json) of a torchtitan llama3 model config;
    UserError naming the feature when HF Llama cannot express the model."""
    attention = model.layers[0].attention
    rope = attention.rope
    if rope.scaling not in ("none", "llama"):
        raise UserError(f"model: rope scaling {rope.scaling!r} has no Hugging Face Llama equivalent")
    epsilons = {model.norm.eps} | {norm.eps for layer in model.layers for norm in (layer.attention_norm, layer.ffn_norm)}
    if len(epsilons) != 1:
        raise UserError(f"model: RMSNorm eps differs between norms ({sorted(epsilons)}); Hugging Face Llama has one")
    scaling = None
    if rope.scaling == "llama":
        scaling = {
            "rope_type": "llama3",
            "factor": rope.scaling_factor,
            "low_freq_factor": rope.low_freq_factor,
            "high_freq_factor": rope.high_freq_factor,
            "original_max_position_embeddings": rope.original_max_position_embeddings,
        }
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": model.vocab_size,
        "hidden_size": model.dim,
        "intermediate_size": model.layers[0].feed_forward.w1.out_features if model.layers[0].feed_forward else None,
        "num_hidden_layers": len(model.layers),
        "num_attention_heads": attention.n_heads,
        "num_key_value_heads": attention.n_kv_heads or attention.n_heads,
        "head_dim": attention.head_dim or model.dim // attention.n_heads,
        "hidden_act": "silu",
        "max_position_embeddings": rope.max_seq_len,
        "rms_norm_eps": epsilons.pop(),
        "rope_theta": rope.theta,
        "rope_scaling": scaling,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": model.enable_weight_tying,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": dtype,
    }


def hf_qwen3_moe_config(model, bos_id: int | None, eos_id: int | None, dtype: str) -> dict:
    """The transformers `Qwen3MoeConfig` (config.json) of titan-async's qwen3_moe model config
    (every block a mixture of experts, softmax top-k routing renormalized over the k)."""
    dense = hf_llama_config(model, bos_id, eos_id, dtype)
    for key in ("rope_scaling", "mlp_bias", "intermediate_size"):
        del dense[key]
    moe, attention = model.layers[0].moe, model.layers[0].attention
    if attention.qk_norm is None or attention.qk_norm.eps != dense["rms_norm_eps"]:
        raise UserError("model: Hugging Face Qwen3-MoE needs QK norms with the blocks' RMSNorm eps")
    router = moe.router
    if router.score_func != "softmax" or router.route_scale != 1.0:
        raise UserError(f"model: routing ({router.score_func}, scale {router.route_scale}) has no Hugging Face Qwen3-MoE equivalent")
    return {
        **dense,
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "moe_intermediate_size": moe.routed_experts.inner_experts.hidden_dim,
        "intermediate_size": moe.routed_experts.inner_experts.hidden_dim,
        "num_experts": moe.num_experts,
        "num_experts_per_tok": router.top_k,
        "norm_topk_prob": router.route_norm,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "router_aux_loss_coef": 0.0,
    }


def _check_expressible(adapter, expected: dict[str, torch.Tensor]) -> None:
    """UserError for a model entry that torchtitan's adapter gives no Hugging Face name."""
    for name, tensor in expected.items():
        if not adapter.to_hf({name: tensor}):
            raise UserError(f"model: entry {name!r} has no Hugging Face equivalent")


def _check_unbiased_routing(checkpoint: Path, biases: dict[str, torch.Tensor]) -> None:
    """UserError when an expert bias of `checkpoint` is not zero (transformers' Qwen3-MoE
    chooses experts without one)."""
    if not biases:
        return
    state = {name: torch.empty_like(tensor, device="cpu") for name, tensor in biases.items()}
    try:
        dcp.load(state, checkpoint_id=str(checkpoint))
    except Exception as err:
        raise runs.unreadable_checkpoint(checkpoint, err) from None
    moved = [name for name, tensor in state.items() if tensor.any()]
    if moved:
        raise UserError(f"--checkpoint {checkpoint}: its expert biases ({moved[0]}, ...) moved with load balancing, and transformers' "
                        "Qwen3-MoE routes without them; train with model.load_balance_coeff = 0 to export")


def _stored_entries(checkpoint: Path, expected: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Entry -> (shape, stored dtype); UserError when the checkpoint cannot be read, or an entry
    of the run's model is missing or has another shape."""
    try:
        stored = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    except Exception as err:
        raise runs.unreadable_checkpoint(checkpoint, err) from None
    entries = {}
    for name, tensor in expected.items():
        meta = stored.get(name)
        if meta is None or not hasattr(meta, "size"):
            raise UserError(f"--checkpoint {checkpoint}: incomplete checkpoint, no model entry {name!r}")
        if meta.size != tensor.shape:
            raise UserError(
                f"--checkpoint {checkpoint}: entry {name!r} has shape {tuple(meta.size)}, the run's config "
                f"gives {tuple(tensor.shape)}"
            )
        entries[name] = (meta.size, meta.properties.dtype)
    return entries


def read_hf_tensors(checkpoint: Path, adapter, entries: dict[str, tuple[torch.Size, torch.dtype]], names: list[str],
                    verified: bool = False) -> dict[str, torch.Tensor]:
    """The checkpoint's entries `names`, in their stored dtype, under their Hugging Face names;
    UserError naming `checkpoint` if it cannot be read. `verified`: each file read is checked
    against its recorded checksum as it is read (`ChecksummedReader`), and a mismatch is the error."""
    state = {name: torch.empty(entries[name][0], dtype=entries[name][1]) for name in names}
    try:
        dcp.load(state, checkpoint_id=str(checkpoint), storage_reader=ChecksummedReader(checkpoint) if verified else None)
    except CheckpointException as failure:
        mismatch = next((error for error, _ in failure.failures.values() if isinstance(error, ChecksumMismatch)), failure)
        raise runs.unreadable_checkpoint(checkpoint, mismatch) from None
    except Exception as err:
        raise runs.unreadable_checkpoint(checkpoint, err) from None
    return adapter.to_hf(state)


def hf_fast_tokenizer(source: Path, tokenizer: HuggingFaceTokenizer) -> Tokenizer:
    """The run's tokenizer (`source`/tokenizer.json) made to prepend BOS as training did (Llama's
    convention, which transformers, vLLM and lm-eval follow)."""
    fast = Tokenizer.from_file(str(source / "tokenizer.json"))
    if tokenizer.bos_token and not tokenizer.hf_adds_bos:
        bos = tokenizer.bos_token
        fast.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.bos_id)]
        )
    return fast


@dataclass
class Conversion:
    """A checkpoint's run as a Hugging Face model, checked against the checkpoint: its
    tokenizer, config.json, the entry-name adapter and the model entries the checkpoint stores."""

    tokenizer_source: Path
    tokenizer: HuggingFaceTokenizer
    config: dict
    adapter: Llama3StateDictAdapter | Qwen3StateDictAdapter
    entries: dict[str, tuple[torch.Size, torch.dtype]]


def conversion(checkpoint: Path, dtype: str) -> Conversion:
    """How `checkpoint` (of its run's stored config) converts, config.json giving `dtype`;
    UserError when transformers cannot express the model or the checkpoint lacks an entry."""
    run = load_run_config(checkpoint.parent.parent / runs.CONFIG_FILE)
    tokenizer_source = tokenizer_dir(run.data)
    tokenizer = HuggingFaceTokenizer(tokenizer_path=str(tokenizer_source))
    meta = build_meta_model(run, tokenizer.get_vocab_size(), fsdp=False)
    model = meta.spec.model
    expected = meta.module.state_dict()
    if model.enable_weight_tying:
        del expected["lm_head.weight"]  # the embedding
    if run.model.family == "qwen3_moe":
        hf = hf_qwen3_moe_config(model, tokenizer.bos_id, tokenizer.eos_id, dtype)
        adapter = Qwen3StateDictAdapter(model, None)
        biases = {name: expected.pop(name) for name in list(expected) if name.endswith("expert_bias_E")}
        _check_unbiased_routing(checkpoint, biases)
    else:
        hf = hf_llama_config(model, tokenizer.bos_id, tokenizer.eos_id, dtype)
        adapter = Llama3StateDictAdapter(model, None)
    _check_expressible(adapter, expected)
    return Conversion(tokenizer_source, tokenizer, hf, adapter, _stored_entries(checkpoint, expected))
