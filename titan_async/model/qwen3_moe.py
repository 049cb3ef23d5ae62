"""The mixture-of-experts family: torchtitan's Qwen3 MoE (the attention and `Decoder` base that
llama3 uses, with QK norms, and token-choice top-k routing to SwiGLU experts), sized by the
`[model]` section.

Chosen over deepseek_v3 (multi-head latent attention, shared experts) because its attention
and stage split are the ones the dense model already runs under both streaming schedules, so
the experts and their load balancing are the only new parts. Load balancing keeps torchtitan's
rule (expert_bias += coeff * sign(mean count - count), centred) but titan-async applies it where
each stage steps (`titan_async.pipeline.load_balance`), so the spec installs no optimizer hook.
torchtitan's experts multiply in bfloat16 whatever the model's dtype; `FullPrecisionExperts`
(`model.expert_precision = "full"`) keep the model's.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torchtitan.distributed.pipeline_parallel import pipeline_llm
from torchtitan.models.common import CosSinRoPE, Embedding, Linear
from torchtitan.models.common.moe import GroupedExperts
from torchtitan.models.qwen3 import Qwen3Model, parallelize_qwen3
from torchtitan.models.qwen3 import _EMBEDDING_INIT, _LINEAR_INIT, _build_qwen3_moe_layers, _qwen3_norm
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter
from torchtitan.protocols.model_spec import ModelSpec

# Sizes of the MoE presets; "vocab_size" 0 means "the tokenizer's".
MOE_PRESETS: dict[str, dict[str, object]] = {
    # CPU-sized: 8 experts, top-2, each expert a quarter of a dense FFN's width.
    "debugmodel": dict(dim=256, n_layers=6, n_heads=16, n_kv_heads=0, vocab_size=0, weight_tying=False,
                       num_experts=8, top_k=2, moe_hidden_dim=256),
}


class FullPrecisionExperts(GroupedExperts):
    """torchtitan's `GroupedExperts` with the grouped matmuls in the dtype of the tokens and
    weights they get, instead of bfloat16: the same SwiGLU, w2(silu(w1 x) * w3 x) per expert."""

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        """GroupedExperts' fields; builds a `FullPrecisionExperts`."""

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        w1, w3, w2 = ((w.to_local() if isinstance(w, DTensor) else w).transpose(-2, -1)
                      for w in (self.w1_EFD, self.w3_EFD, self.w2_EDF))
        offsets = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
        hidden = F.silu(self._grouped_mm(A=x_RD, B_t=w1, offs=offsets)) * self._grouped_mm(A=x_RD, B_t=w3, offs=offsets)
        return self._grouped_mm(A=hidden, B_t=w2, offs=offsets)


def build_qwen3_moe_model(sizes: dict[str, object], rope_theta: float, load_balance_coeff: float, attention_backend: str,
                          expert_precision: str = "bfloat16") -> Qwen3Model.Config:
    """The Qwen3 MoE model config of resolved `sizes` (every block an MoE block; head_dim = dim / n_heads;
    `expert_precision` "full": `FullPrecisionExperts`)."""
    dim, n_heads, vocab = sizes["dim"], sizes["n_heads"], sizes["vocab_size"]
    head_dim = dim // n_heads
    layers = _build_qwen3_moe_layers(
        n_layers=sizes["n_layers"],
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=sizes["n_kv_heads"],
        head_dim=head_dim,
        moe_hidden_dim=sizes["moe_hidden_dim"],
        num_experts=sizes["num_experts"],
        top_k=sizes["top_k"],
        fuse_qkv=True,
        attn_backend=attention_backend,
        moe_comm_backend="standard",
        rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=131072, theta=rope_theta),
    )
    for layer in layers:
        layer.moe.load_balance_coeff = load_balance_coeff or None
        if expert_precision == "full":
            experts = layer.moe.routed_experts
            experts.inner_experts = FullPrecisionExperts.Config(**{
                f.name: getattr(experts.inner_experts, f.name) for f in fields(experts.inner_experts)})
    return Qwen3Model.Config(
        vocab_size=vocab,
        dim=dim,
        norm=_qwen3_norm(dim),
        enable_weight_tying=False,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_LINEAR_INIT),
        layers=layers,
    )


def qwen3_moe_spec(config: Qwen3Model.Config, preset: str, parallelize_fn=parallelize_qwen3) -> ModelSpec:
    """A torchtitan ModelSpec of `config` (no load-balancing hook: see the module docstring)."""
    return ModelSpec(
        name="qwen3",
        flavor=preset,
        model=config,
        parallelize_fn=parallelize_fn,
        pipelining_fn=pipeline_llm,
        post_optimizer_build_fn=None,
        state_dict_adapter=Qwen3StateDictAdapter,
    )
