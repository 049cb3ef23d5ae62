"""The `[model]` section: a Llama-3-style decoder built from named presets plus overrides."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Literal

from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
from torchtitan.models.llama3 import (
    Llama3StateDictAdapter,
    _build_llama3_layers,
    _EMBEDDING_INIT,
    _EMBEDDING_SKIP_INIT,
    _NORM_INIT,
    _output_linear_init,
    parallelize_llama,
)
from torchtitan.distributed.compile import apply_compile
from torchtitan.distributed.pipeline_parallel import pipeline_llm
from torchtitan.models.common.attention import VarlenAttention
from torchtitan.models.llama3.model import Llama3Model
from torchtitan.protocols.model_spec import ModelSpec

from titan_async.core import platform
from titan_async.model.attention import DenseDocumentAttention
from titan_async.model.qwen3_moe import MOE_PRESETS, build_qwen3_moe_model, qwen3_moe_spec
from titan_async.run import process

# Sizes of torchtitan's llama3 flavors; "vocab_size" 0 means "the tokenizer's".
PRESETS: dict[str, dict[str, object]] = {
    "debugmodel": dict(dim=256, n_layers=6, n_heads=16, n_kv_heads=0, multiple_of=256, ffn_dim_multiplier=0.0, vocab_size=0, weight_tying=False),
    "1B": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, multiple_of=1024, ffn_dim_multiplier=1.5, vocab_size=128256, weight_tying=True),
    "3B": dict(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, multiple_of=1024, ffn_dim_multiplier=1.0, vocab_size=128256, weight_tying=True),
    "8B": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, multiple_of=1024, ffn_dim_multiplier=1.3, vocab_size=128256, weight_tying=False),
    "70B": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, multiple_of=4096, ffn_dim_multiplier=1.3, vocab_size=128256, weight_tying=False),
    # Not a torchtitan flavor: the ~10B target of the scale configs, 10,121,794,560 parameters.
    "10B": dict(dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, multiple_of=1024, ffn_dim_multiplier=0.75, vocab_size=128256, weight_tying=False),
}


@dataclass(kw_only=True, slots=True)
class ModelSection:
    """Model shape. Fields left at -1 take the preset's value."""

    family: Literal["llama3", "qwen3_moe"] = "llama3"
    """llama3: dense Llama 3 blocks; qwen3_moe: mixture-of-experts blocks (torchtitan's Qwen3 MoE,
    `titan_async.model.qwen3_moe`), which have presets of their own."""
    preset: str = "debugmodel"
    """Starting sizes: llama3: debugmodel, 1B, 3B, 8B, 70B (torchtitan's llama3 flavors) or 10B;
    qwen3_moe: debugmodel."""
    dim: int = -1
    """Hidden size."""
    n_layers: int = -1
    """Number of transformer blocks."""
    n_heads: int = -1
    """Attention heads."""
    n_kv_heads: int = -1
    """Key/value heads for grouped-query attention; 0 means n_heads."""
    multiple_of: int = -1
    """The SwiGLU hidden size is rounded up to a multiple of this."""
    ffn_dim_multiplier: float = -1.0
    """Scale of the SwiGLU hidden size; 0 means none."""
    vocab_size: int = -1
    """Vocabulary size; 0 means the tokenizer's size."""
    weight_tying: Literal["preset", "yes", "no"] = "preset"
    """Tie the output head to the embedding (not possible with pipeline parallelism)."""
    rope_theta: float = 500000.0
    """RoPE base frequency."""
    attention: Literal["auto", "flex", "varlen", "dense"] = "auto"
    """auto: FlexAttention on CUDA, dense per-document SDPA on CPU (which has no Flex backward)."""
    num_experts: int = -1
    """qwen3_moe: routed experts per block."""
    top_k: int = -1
    """qwen3_moe: experts each token is routed to."""
    moe_hidden_dim: int = -1
    """qwen3_moe: hidden size of each expert's SwiGLU."""
    load_balance_coeff: float = 1e-3
    """qwen3_moe: step of the auxiliary-loss-free expert-bias update at each optimizer step
    (0: no load balancing)."""
    expert_precision: Literal["bfloat16", "full"] = "bfloat16"
    """qwen3_moe: dtype of the experts' grouped matmuls. bfloat16: torchtitan's (it casts the
    tokens and expert weights); full: the dtype the rest of the model computes in (slower unless
    that is bfloat16; for exact comparisons in float32)."""
    float8: Literal["none", "rowwise", "rowwise_with_gw_hp"] = "none"
    """Float8 linear layers through torchao (the output head stays in high precision); needs SM89+,
    emulated (same recipe) on machines without CUDA (slow, eager only; for testing)."""

    def resolved(self, tokenizer_vocab_size: int) -> dict[str, object]:
        """All sizes after applying the preset and the tokenizer's vocabulary."""
        presets = MOE_PRESETS if self.family == "qwen3_moe" else PRESETS
        if self.preset not in presets:
            raise ValueError(f"model.preset must be one of {sorted(presets)} for model.family = {self.family!r}, got {self.preset!r}")
        if self.family != "qwen3_moe":
            for key in ("num_experts", "top_k", "moe_hidden_dim", "expert_precision"):
                if getattr(self, key) != next(f.default for f in fields(self) if f.name == key):
                    raise ValueError(f"model.{key} applies to model.family = \"qwen3_moe\" only (this model is {self.family!r})")
        sizes = dict(presets[self.preset])
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in sizes and value not in (-1, "preset"):
                sizes[f.name] = value == "yes" if f.name == "weight_tying" else value
        if sizes["vocab_size"] == 0:
            sizes["vocab_size"] = tokenizer_vocab_size
        if sizes["n_kv_heads"] == 0:
            sizes["n_kv_heads"] = sizes["n_heads"]
        if self.family == "qwen3_moe" and not 1 <= sizes["top_k"] <= sizes["num_experts"]:
            raise ValueError(f"model.top_k ({sizes['top_k']}) must be between 1 and model.num_experts ({sizes['num_experts']})")
        return sizes


def _inner_attention_backend(choice: str) -> str:
    if choice == "auto":
        return "dense" if platform.is_cpu() else "flex"
    return choice


def parallelize_without_fsdp(model, *, parallel_dims, training, parallelism, compile_config, ac_config, dump_folder):
    """torchtitan's llama3 parallelize function minus FSDP (which it applies even on one rank).

    Weight-version policies switch parameter storage between microbatches; FSDP2 reads
    its own shard buffer instead, so stages they manage keep plain parameters.
    """
    if ac_config is not None:
        ac_config.build(dump_folder=dump_folder).apply(model)
    if compile_config.enable and "model" in compile_config.components:
        apply_compile(model, compile_config=compile_config, parallel_dims=parallel_dims)
    return model


def build_model_spec(section: ModelSection, tokenizer_vocab_size: int, fsdp: bool = True, compiled: bool = False) -> ModelSpec:
    """A torchtitan ModelSpec for the llama3 model that `section` describes (`fsdp`: see
    `parallelize_without_fsdp`; `compiled`: whether the model will be compiled)."""
    s = section.resolved(tokenizer_vocab_size)
    dim, n_heads, vocab = s["dim"], s["n_heads"], s["vocab_size"]
    if dim % n_heads:
        raise ValueError(f"model.dim ({dim}) must be divisible by model.n_heads ({n_heads})")
    if n_heads % s["n_kv_heads"]:
        raise ValueError(f"model.n_heads ({n_heads}) must be divisible by model.n_kv_heads ({s['n_kv_heads']})")
    backend = _inner_attention_backend(section.attention)
    if section.family == "qwen3_moe":
        return _moe_model_spec(section, s, backend, fsdp)
    layers = _build_llama3_layers(
        fuse_qkv=True,
        n_layers=s["n_layers"],
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=s["n_kv_heads"],
        hidden_dim=compute_ffn_hidden_dim(
            dim,
            multiple_of=s["multiple_of"],
            ffn_dim_multiplier=s["ffn_dim_multiplier"] or None,
        ),
        rope=ComplexRoPE.Config(
            dim=dim // n_heads, max_seq_len=131072, theta=section.rope_theta, scaling="llama"
        ),
        attn_backend="varlen" if backend == "dense" else backend,
    )
    config = Llama3Model.Config(
        dim=dim,
        vocab_size=vocab,
        enable_weight_tying=s["weight_tying"],
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab,
            embedding_dim=dim,
            param_init=_EMBEDDING_SKIP_INIT if s["weight_tying"] else _EMBEDDING_INIT,
        ),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_output_linear_init(dim)),
        layers=layers,
    )
    _use_dense_attention(config, backend)
    if section.float8 != "none":
        config = _with_float8_linears(config, section.float8, compiled)
    return ModelSpec(
        name="llama3",
        flavor=section.preset,
        model=config,
        parallelize_fn=parallelize_llama if fsdp else parallelize_without_fsdp,
        pipelining_fn=pipeline_llm,
        post_optimizer_build_fn=None,
        state_dict_adapter=Llama3StateDictAdapter,
    )


def _with_float8_linears(config, recipe: str, compiled: bool):
    """`config` with every linear but the output head a torchao float8 linear of `recipe`
    (emulated, same recipe, on the CPU). A process that may not use the CUDA runtime (a launcher
    on a GPU node, `process.may_use_cuda_runtime`) checks the GPU's capability by NVML and
    returns `config` unchanged: its workers build the model and convert it."""
    if not process.may_use_cuda_runtime():
        _check_float8_capability(recipe)
        return config
    # Imported here, not at the top, which a launcher imports: torchao's modules ask the CUDA
    # runtime about the GPU at import, unless `platform.configure` imported them with CUDA hidden.
    from torchao.float8 import Float8LinearConfig
    from torchtitan.components.quantization import Float8LinearConverter

    converter = Float8LinearConverter.Config(
        recipe_name=recipe, filter_fqns=["lm_head"], emulate=platform.is_cpu(), model_compile_enabled=compiled
    ).build()
    if platform.is_cpu():  # torchtitan emulates only the tensorwise recipe: emulate the one asked for
        converter.torchao_config = replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    return converter.convert(config)


FLOAT8_CAPABILITY = (8, 9)
"""The oldest NVIDIA compute capability with float8 matrix multiplies."""


def _check_float8_capability(recipe: str) -> None:
    """ValueError where NVML reports a GPU older than float8 needs (SM89, torchtitan's check);
    where NVML cannot say, the workers' conversion checks."""
    capability = platform.cuda_capability()
    if capability is not None and capability < FLOAT8_CAPABILITY:
        raise ValueError(f"model.float8 = {recipe!r} needs an NVIDIA GPU of compute capability "
                         f"{'.'.join(map(str, FLOAT8_CAPABILITY))} or later; this one has {'.'.join(map(str, capability))}")


def _use_dense_attention(config, backend: str) -> None:
    """With the "dense" backend, replace every varlen attention of `config` by per-document SDPA."""
    if backend == "dense":
        for _, _, parent, attr in list(config.traverse(VarlenAttention.Config)):
            setattr(parent, attr, DenseDocumentAttention.Config())


def _moe_model_spec(section: ModelSection, sizes: dict[str, object], backend: str, fsdp: bool) -> ModelSpec:
    """The ModelSpec of a qwen3_moe `section` (float8 is not offered for experts yet)."""
    if section.float8 != "none":
        raise ValueError(f"model.float8 = {section.float8!r} is not supported with model.family = \"qwen3_moe\"; set it to \"none\"")
    config = build_qwen3_moe_model(sizes, section.rope_theta, section.load_balance_coeff,
                                   "varlen" if backend == "dense" else backend, section.expert_precision)
    _use_dense_attention(config, backend)
    return qwen3_moe_spec(config, section.preset, **({} if fsdp else {"parallelize_fn": parallelize_without_fsdp}))
