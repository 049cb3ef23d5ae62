"""An independent reference trainer for PipeDream-2BW and PACI on a real (tiny) Llama model.

The equality tests in test_schedules.py compare a pipelined run with titan-async's own
`training.gradient_delay = 1` mode or its single-process emulation, which share the weight
versions, executor and step code with the pipeline. This module shares none of it: it imports
nothing from the titan-async package (its import name appears nowhere in this file; a test
checks). What it takes from elsewhere:

- the model: torchtitan's own Llama 3 modules (`Llama3Model`, built from the same sizes as the
  run's resolved config.toml), with the per-document causal attention written out here (dense
  SDPA under a mask built from the positions, where a position 0 starts a document);
- the initial weights: drawn here by the published rule of the run (each parameter from its
  torchtitan module's own initializer, under an RNG seeded by crc32(parameter name) XOR
  (seed * 0x9E3779B1 mod 2^32)); a transcription, checked by the step-1 loss;
- the batches: the token ids, positions and labels the run trained on, in the order it consumed
  them, which the run writes when `TITAN_ASYNC_BATCH_LOG=DIR` is set (one JSON line per
  microbatch, DIR/rank<R>.jsonl; a compromise: the data loader is not re-implemented here); with
  FSDP or replicas (DDP) every data rank's local batch (`data_rank_ranks`: its TP ranks log the
  same batches), joined into the global batch under one loss normalisation (the sum over its
  valid tokens); with gradient accumulation a data rank's accumulated local batches are one
  batch of the stream;
- the MoE model (`model.family = "qwen3_moe"`): torchtitan's Qwen3 MoE modules, the load-balancing
  rule of torchtitan's optimizer pre-hook (`_update_expert_bias`: per block, bias += d - mean(d),
  d = coeff * sign(mean(count) - count)) written out, and with `model.expert_precision = "full"`
  the experts' SwiGLU written out per expert in float32;
- the optimizer: torch.optim.AdamW (fused, as configured), with torchtitan's warm-up/stable/decay
  learning-rate factor transcribed, and each stage's gradient clipped on its own when it steps,
  except in the synchronous steps of a Sync Start, which clip the global norm as torch's
  synchronous schedules do (`global_norm`);
- the stage boundaries: 2 stages of 4 layers, as torchtitan splits them (stage 0:
  tok_embeddings, layers.0-1; stage 1: layers.2-3, norm, lm_head), or the run's own
  `parallelism.module_fqns_per_model_part` (which 4 stages must name).

Run under pytest, the process has also run the package's `platform.configure()` (conftest.py:
it makes torchtitan pick the CPU and gloo; it changes no model or optimizer arithmetic).

The rules, written out:
- PipeDream-2BW: W[k+1] = W[k] - Opt(grad f_k(W[k-1])), W[-1] = W[0], with a deep copy of the
  previous weights; `variant="stale"` (the control) writes the update into the stale version,
  W[k+1] = W[k-1] - Opt(grad f_k(W[k-1])), and `variant="no_delay"` takes the gradient at W[k];
  with `delay` = d (PipeDream-2BW with fewer microbatches than stages, or `training.gradient_delay
  = d`), W[k+1] = W[k] - Opt(grad f_k(W[k-d])), W[j] = W[0] for j < 0, from a copy of every W[j].
- PACI: each stage steps after every `a` of its own backwards. Stage s keeps p-1-s microbatches
  in flight (the stream drains after the steps in `drains`, where nothing stays in flight). A
  backward combines the activations its forward saved (forward-time weights) with the weights
  current at the backward: here each parameter-holding module of the stage is re-run at
  backward time as op(x, W_now) + (op(x, W_forward) - op(x, W_now)).detach(), so its value is
  the forward's and its local derivatives are taken at W_now, with x the forward-time input.
  `late=1` (the control) steps one backward late. `paci` covers 2 stages with every feature;
  `paci_stages` any number of stages (stage s holding p-1-s in flight), dense and plain.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import functools
import tomllib
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
from torchtitan.models.common.moe import GroupedExperts
from torchtitan.models.common.param_init import skip_param_init
from torchtitan.models.llama3 import _EMBEDDING_INIT, _NORM_INIT, _build_llama3_layers, _output_linear_init
from torchtitan.models.llama3.model import Llama3Model
from torchtitan.models.qwen3 import Qwen3Model, _build_qwen3_moe_layers, _qwen3_norm
from torchtitan.models.qwen3 import _EMBEDDING_INIT as _QWEN3_EMBEDDING_INIT, _LINEAR_INIT as _QWEN3_LINEAR_INIT

STAGES = (("tok_embeddings", "layers.0", "layers.1"), ("layers.2", "layers.3", "norm", "lm_head"))
"""torchtitan's split of a 4-layer model into 2 stages (the input and output modules count as a layer each)."""


# --- the run's settings, read from its resolved config.toml ---------------------------------

@dataclass
class Settings:
    dim: int
    n_layers: int
    n_heads: int
    vocab_size: int
    rope_theta: float
    seed: int
    steps: int
    local_batch_size: int
    microbatch_size: int
    max_norm: float
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    warmup_steps: int
    decay_ratio: float
    decay_type: str
    min_lr_factor: float
    accumulation: int | None
    delay_rescheduling_steps: int = 0
    """K of the delay rescheduling (`StageOptimizer`'s `lr_delay`); 0: off."""
    optimizer: str = "adamw"
    adamw_lr: float = 0.0
    """AdamW's peak lr (with Muon, optimizer.muon.adamw_lr; else optimizer.lr)."""
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    error_feedback: float | None = None
    """The error-feedback coefficient c, None when off."""
    family: str = "llama3"
    num_experts: int = 0
    top_k: int = 0
    moe_hidden_dim: int = 0
    load_balance_coeff: float = 0.0
    data_ranks: int = 1
    """The data-parallel degree (replicas x FSDP shards): each data rank trains its own local batch."""
    local_batches: int = 1
    """The local batches each data rank accumulates per step (global batch / (local batch x data ranks))."""
    tensor_ranks: int = 1
    """The tensor-parallel degree: a data rank's TP ranks train its batches together."""
    expert_ranks: int = 1
    """The expert-parallel degree: 1, or every data rank (the data ranks' tokens meet in the experts)."""
    expert_precision: str = "bfloat16"
    """torchtitan's bfloat16 experts, or "full": the experts multiply in float32 (`Float32Experts`)."""
    stages: tuple[tuple[str, ...], ...] = STAGES
    """Each stage's modules, in order (the run's `module_fqns_per_model_part`, else `STAGES`; one
    stage of every module without pipeline parallelism)."""

    @property
    def microbatches(self) -> int:
        """A data rank's microbatches per step, its accumulated local batches' included."""
        return self.local_batch_size // self.microbatch_size * self.local_batches


def read_settings(run_dir: Path, vocab_size: int) -> Settings:
    """The run's settings; only the shapes and values this reference supports are accepted."""
    c = tomllib.loads((Path(run_dir) / "config.toml").read_text())
    m, t, p, o, s = c["model"], c["training"], c["parallelism"], c["optimizer"], c["lr_scheduler"]
    assert m["family"] in ("llama3", "qwen3_moe") and m["preset"] == "debugmodel" and m["n_kv_heads"] in (0, m["n_heads"])
    assert m["multiple_of"] == -1 and m["ffn_dim_multiplier"] == -1.0 and m["float8"] == "none"
    assert m["n_layers"] == 4 and p["pipeline_parallel_degree"] in (1, 2, 4), "1, 2 or 4 stages of a 4-layer model"
    stages = tuple(tuple(modules) for modules in p.get("module_fqns_per_model_part") or ()) or STAGES
    if p["pipeline_parallel_degree"] == 1:  # `training.gradient_delay`: the whole model clips as one stage
        stages = (tuple(n for modules in STAGES for n in modules),)
    assert len(stages) == p["pipeline_parallel_degree"], "4 stages are named in parallelism.module_fqns_per_model_part"
    assert sorted(n for modules in stages for n in modules) == sorted(n for modules in STAGES for n in modules)
    data_ranks = p["data_parallel_shard_degree"] * p["data_parallel_replicate_degree"]
    assert data_ranks >= 1, "the resolved config names the degrees"
    tensor_ranks = p.get("tensor_parallel_degree", 1)
    expert_ranks = p.get("expert_parallel_degree", 1)
    assert expert_ranks in (1, data_ranks), "EP over every data rank of a stage, or none"
    assert p.get("context_parallel_degree", 1) == 1
    assert t["dtype"] == "float32"
    local_batches = max(1, t.get("global_batch_size", -1) // (t["local_batch_size"] * data_ranks))
    assert t.get("global_batch_size", -1) in (-1, local_batches * t["local_batch_size"] * data_ranks)
    if m["family"] == "qwen3_moe":
        assert m["weight_tying"] in ("preset", False) and m["load_balance_coeff"] > 0
        assert m.get("expert_precision", "bfloat16") in ("bfloat16", "full")
    assert c["activation_checkpoint"]["mode"] == "none" and o["name"] in ("adamw", "muon")
    muon, ef = o["muon"], o["error_feedback"]
    if o["name"] == "muon":
        assert muon["lr_scaling"] == "match_rms_adamw" and muon["ns_dtype"] in ("auto", "float32")
    return Settings(
        dim=m["dim"], n_layers=m["n_layers"], n_heads=m["n_heads"], vocab_size=vocab_size, rope_theta=m["rope_theta"],
        seed=c["debug"]["seed"], steps=t["steps"], local_batch_size=t["local_batch_size"],
        microbatch_size=p["pipeline_parallel_microbatch_size"], max_norm=t["max_norm"],
        lr=o["lr"], betas=(o["beta1"], o["beta2"]), eps=o["eps"], weight_decay=o["weight_decay"],
        warmup_steps=s["warmup_steps"], decay_ratio=s["decay_ratio"], decay_type=s["decay_type"],
        min_lr_factor=s["min_lr_factor"], delay_rescheduling_steps=s.get("delay_rescheduling_steps", 0), accumulation=p.get("paci", {}).get("accumulation"),
        optimizer=o["name"], adamw_lr=muon["adamw_lr"] if o["name"] == "muon" else o["lr"], momentum=muon["momentum"],
        nesterov=muon["nesterov"], ns_steps=muon["ns_steps"], error_feedback=ef["coefficient"] if ef["enabled"] else None,
        family=m["family"], num_experts=m.get("num_experts", 0), top_k=m.get("top_k", 0), moe_hidden_dim=m.get("moe_hidden_dim", 0),
        load_balance_coeff=m.get("load_balance_coeff", 0.0), data_ranks=data_ranks, local_batches=local_batches,
        tensor_ranks=tensor_ranks, expert_ranks=expert_ranks, expert_precision=m.get("expert_precision", "bfloat16"),
        stages=stages,
    )


def drain_steps(run_dir: Path) -> set[int]:
    """The steps after which the streaming run drained: checkpoints, validations and the last step."""
    c = tomllib.loads((Path(run_dir) / "config.toml").read_text())
    steps, checkpoint, validation = c["training"]["steps"], c["checkpoint"], c["validation"]
    return {step for step in range(1, steps + 1)
            if step == steps or (checkpoint["enable"] and (step % checkpoint["interval"] == 0
                                                           or (step == 1 and checkpoint["enable_first_step_checkpoint"])))
            or (validation["enable"] and (step == 1 or step % validation["freq"] == 0))}


def lr_factor(settings: Settings, step: int) -> float:
    """torchtitan's warm-up / stable / decay factor of scheduler step `step` (0-based)."""
    total, warmup = settings.steps, min(settings.warmup_steps, settings.steps)
    decay = min(round(total * settings.decay_ratio), total - warmup)
    stable = total + 1 - warmup - decay
    if step < warmup:
        return (step + 1) / warmup
    if step < warmup + stable:
        return 1.0
    progress = (step + 1 - warmup - stable) / decay
    shape = {"linear": 1 - progress, "sqrt": 1 - math.sqrt(progress), "cosine": 0.5 * (1 + math.cos(math.pi * progress))}
    return settings.min_lr_factor + (1 - settings.min_lr_factor) * shape[settings.decay_type]


# --- the model ----------------------------------------------------------------------------------

class DocumentCausalAttention(nn.Module):
    """softmax(q k^T * scale + mask) v, where a query attends keys of its own document at or before it."""

    def forward(self, q, k, v, *, attention_masks, scale=None, enable_gqa=False, **_):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=attention_masks, scale=scale, enable_gqa=enable_gqa)
        return out.transpose(1, 2)


def document_mask(positions: torch.Tensor) -> torch.Tensor:
    """[B, 1, L, L] boolean: same document (a position 0 starts one) and not in the future."""
    document = torch.cumsum(positions == 0, dim=1)
    seq_len = positions.shape[1]
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    return ((document.unsqueeze(2) == document.unsqueeze(1)) & causal).unsqueeze(1)


class Float32Experts(GroupedExperts):
    """torchtitan's grouped SwiGLU experts, w2(silu(w1 x) * w3 x) on each expert's rows, with the
    matmuls written out per expert in the tokens' dtype: `model.expert_precision = "full"`.
    With `then` (name -> weights, set by `ForwardTimeValues`) each matmul takes the value it had
    with those weights and differentiates at the current ones, so the SwiGLU's inner activations
    are the forward's too (a hook on the whole module would recompute them)."""

    then: dict[str, torch.Tensor] | None = None

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        pass

    def _linear(self, rows: torch.Tensor, name: str, expert: int) -> torch.Tensor:
        out = F.linear(rows, getattr(self, name)[expert])
        if self.then is None:
            return out
        return out + (F.linear(rows, self.then[name][expert]) - out).detach()

    def forward(self, x, num_tokens_per_expert):
        outputs = [self._linear(F.silu(self._linear(rows, "w1_EFD", e)) * self._linear(rows, "w3_EFD", e), "w2_EDF", e)
                   for e, rows in enumerate(x.split(num_tokens_per_expert.tolist()))]
        return torch.cat(outputs) if outputs else x[:0]


def build_moe_model(settings: Settings) -> nn.Module:
    """torchtitan's Qwen3 MoE at the run's sizes (every block an MoE block, fused wqkv, head_dim =
    dim / n_heads, softmax top-k routing with torchtitan's defaults), this module's attention."""
    dim, heads, vocab = settings.dim, settings.n_heads, settings.vocab_size
    layers = _build_qwen3_moe_layers(
        n_layers=settings.n_layers, dim=dim, n_heads=heads, n_kv_heads=heads, head_dim=dim // heads,
        moe_hidden_dim=settings.moe_hidden_dim, num_experts=settings.num_experts, top_k=settings.top_k, fuse_qkv=True,
        attn_backend="varlen", moe_comm_backend="standard",
        rope=CosSinRoPE.Config(dim=dim // heads, max_seq_len=131072, theta=settings.rope_theta))
    for layer in layers:
        layer.moe.load_balance_coeff = settings.load_balance_coeff
        if settings.expert_precision == "full":
            inner = layer.moe.routed_experts.inner_experts
            layer.moe.routed_experts.inner_experts = Float32Experts.Config(
                **{f.name: getattr(inner, f.name) for f in dataclasses.fields(inner)})
    config = Qwen3Model.Config(
        vocab_size=vocab, dim=dim, norm=_qwen3_norm(dim), enable_weight_tying=False,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_QWEN3_EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_QWEN3_LINEAR_INIT), layers=layers)
    return config.build()


def moe_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's MoE modules (an expert bias each), in layer order."""
    return [layer.moe for layer in model.layers.values()]


def build_model(settings: Settings) -> nn.Module:
    """torchtitan's Llama 3 (or Qwen3 MoE) at the run's sizes, with this module's attention, initialised by the run's rule."""
    dim, heads, vocab = settings.dim, settings.n_heads, settings.vocab_size
    if settings.family == "qwen3_moe":
        model = build_moe_model(settings)
        for layer in model.layers.values():
            layer.attention.inner_attention = DocumentCausalAttention()
        initialize(model, settings.seed)
        return model
    config = Llama3Model.Config(
        dim=dim, vocab_size=vocab, enable_weight_tying=False,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_output_linear_init(dim)),
        layers=_build_llama3_layers(
            fuse_qkv=True, n_layers=settings.n_layers, dim=dim, n_heads=heads, n_kv_heads=heads,
            hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=256),
            rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=131072, theta=settings.rope_theta, scaling="llama"),
            attn_backend="varlen"),
    )
    model = config.build()
    for layer in model.layers.values():
        layer.attention.inner_attention = DocumentCausalAttention()
    initialize(model, settings.seed)
    return model


@torch.no_grad()
def initialize(model: nn.Module, seed: int) -> None:
    """Each parameter from its module's initializer, the RNG seeded by its name and the run's seed."""
    for module_name, module in model.named_modules():
        initializers = getattr(module, "_param_init", None) or {}
        for name, param in module.named_parameters(recurse=False):
            if initializers.get(name, skip_param_init) is skip_param_init:
                continue
            full_name = f"{module_name}.{name}" if module_name else name
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(zlib.crc32(full_name.encode()) ^ (seed * 0x9E3779B1 % (1 << 32)))
                tensor = torch.empty_like(param)
                initializers[name](tensor)
            param.copy_(tensor)


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters (and MoE expert biases) as a checkpoint names them: torchtitan's state-dict hooks split the fused wqkv."""
    buffers = {name for name, _ in model.named_buffers() if not name.endswith("expert_bias_E")}
    return {name: t.detach().clone() for name, t in model.state_dict().items() if name not in buffers}


def stage_of(name: str, stages: tuple[tuple[str, ...], ...]) -> int:
    return next(s for s, modules in enumerate(stages) for m in modules if name == m or name.startswith(m + "."))


def stage_params(model: nn.Module, stages: tuple[tuple[str, ...], ...]) -> list[list[tuple[str, nn.Parameter]]]:
    """Each stage's (name, parameter) pairs."""
    params: list[list[tuple[str, nn.Parameter]]] = [[] for _ in stages]
    for name, param in model.named_parameters():
        params[stage_of(name, stages)].append((name, param))
    return params


# --- data -----------------------------------------------------------------------------------------

@dataclass
class Microbatch:
    tokens: torch.Tensor
    positions: torch.Tensor
    labels: torch.Tensor


def read_rank_log(batch_log: Path, rank: int) -> dict[str, torch.Tensor]:
    rows = [json.loads(line) for line in (Path(batch_log) / f"rank{rank}.jsonl").read_text().splitlines()]
    return {key: torch.cat([torch.tensor(r[key]) for r in rows]) for key in ("input", "positions", "labels")}


def data_rank_ranks(settings: Settings, data_rank: int) -> list[int]:
    """The global ranks that train data rank `data_rank`'s batches: torchtitan's mesh orders its
    dimensions pp, dp_replicate, dp_shard, tp (outermost first), so stage s, data rank d, TP rank
    t is rank (s D + d) T + t."""
    dp, tp = settings.data_ranks, settings.tensor_ranks
    return [(stage * dp + data_rank) * tp + t for stage in range(len(settings.stages)) for t in range(tp)]


def read_batches(batch_log: Path, settings: Settings, data_ranks: list[int] | None = None) -> list[list[Microbatch]]:
    """The run's global batches, each cut into its microbatches: data rank d's accumulated local
    batches (every rank of the data rank logs the same ones, `data_rank_ranks`) followed by the
    next data rank's. `data_ranks` (a control) takes only those data ranks' local batches."""
    dp, size, n = settings.data_ranks, settings.microbatch_size, settings.steps
    b = settings.local_batch_size * settings.local_batches
    assert len(list(Path(batch_log).glob("rank*.jsonl"))) == len(settings.stages) * dp * settings.tensor_ranks, "every rank's log"
    logs = []
    for d in range(dp) if data_ranks is None else data_ranks:
        first, *others = data_rank_ranks(settings, d)
        log = read_rank_log(batch_log, first)
        for rank in others:
            other = read_rank_log(batch_log, rank)
            assert all(torch.equal(log[key], other[key]) for key in log), f"ranks {first} and {rank} are not one data rank"
        assert log["input"].shape[0] == n * b, (log["input"].shape, n, b)
        logs.append(log)
    return [[Microbatch(log["input"][i:i + size], log["positions"][i:i + size], log["labels"][i:i + size])
             for log in logs for i in range(t * b, (t + 1) * b, size)] for t in range(n)]


def side_by_side(batches: list[list[Microbatch]], data_ranks: int) -> list[list[Microbatch]]:
    """Each batch's microbatches with the data ranks' i-th ones joined into one (along the batch
    dimension): what a stage's data ranks run at once, for rules that count microbatches (PACI)."""
    joined = []
    for batch in batches:
        ranks = [batch[d * len(batch) // data_ranks:(d + 1) * len(batch) // data_ranks] for d in range(data_ranks)]
        joined.append([Microbatch(*(torch.cat([getattr(mb, f) for mb in same]) for f in ("tokens", "positions", "labels")))
                       for same in zip(*ranks)])
    return joined


# --- losses, optimizers ----------------------------------------------------------------------------

def summed_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum", ignore_index=-100)


def valid_tokens(batch: list[Microbatch]) -> int:
    return int(sum((mb.labels != -100).sum() for mb in batch))


def newton_schulz(matrix: torch.Tensor, steps: int) -> torch.Tensor:
    """Muon's orthogonalisation (Keller Jordan's published quintic): X = M / ||M||_F (the wide way
    round), then `steps` times X <- a X + (b A + c A^2) X with A = X X^T, (a, b, c) = (3.4445, -4.7750, 2.0315)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = matrix.T if matrix.shape[0] > matrix.shape[1] else matrix
    x = x / x.norm().clamp(min=1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if matrix.shape[0] > matrix.shape[1] else x


def qkv_blocks(matrix: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Q, K and V rows of torchtitan's fused wqkv (rows: per KV head, its query heads, then its key, then its
    value, each head_dim rows), with one query head per KV head as in these runs."""
    grouped = matrix.reshape(-1, 3, head_dim, matrix.shape[1])
    return tuple(grouped[:, i].reshape(-1, matrix.shape[1]) for i in range(3))


def merge_qkv(blocks, head_dim: int) -> torch.Tensor:
    cols = blocks[0].shape[1]
    return torch.stack([b.reshape(-1, head_dim, cols) for b in blocks], dim=1).reshape(-1, cols)


class StageOptimizer:
    """One stage's optimizers, stepped together: the stage's gradient clipped to max_norm on its
    own, then AdamW (every parameter, or with Muon the embedding, head, MoE routers' gates and
    non-matrices) and Muon (the blocks' hidden matrices, and each matrix of an MoE block's
    stacked experts on its own), each at its peak lr times the factor of scheduler step
    `lr_step`, and error feedback when configured: w -= u_t + c d (u_t - u_{t-1}) from the second
    update on, u_t the optimizer's own update, d = `ef_delay` (the gradients' delay in steps). `whole_qkv` (a control) orthogonalises the fused
    wqkv as one matrix instead of its Q, K and V blocks. With `settings.delay_rescheduling_steps`
    K > 0 every lr of scheduler step k is also divided by `lr_delay` ** (1 - min(k / K, 1))."""

    def __init__(self, named: list[tuple[str, nn.Parameter]], settings: Settings, head_dim: int = 0,
                 error_feedback: bool = True, whole_qkv: bool = False, ef_delay: int = 1, lr_delay: int = 1) -> None:
        self.settings, self.head_dim, self.whole_qkv, self.lr_delay = settings, head_dim, whole_qkv, lr_delay
        self.params = [p for _, p in named]
        self.ef = settings.error_feedback * ef_delay if error_feedback and settings.error_feedback is not None else None
        muon = settings.optimizer == "muon"
        self.matrices = [(n, p) for n, p in named if muon and n.startswith("layers.") and (
            (p.ndim == 2 and ".router." not in n) or (p.ndim == 3 and ".inner_experts." in n))]
        others = [p for n, p in named if not any(p is q for _, q in self.matrices)]
        self.adamw = torch.optim.AdamW(others, lr=settings.adamw_lr, betas=settings.betas, eps=settings.eps,
                                       weight_decay=settings.weight_decay, fused=True)
        self.momentum = {n: torch.zeros_like(p) for n, p in self.matrices}
        self.previous = {id(p): torch.zeros_like(p) for p in self.params}
        self.updates = 0
        self.norms: list[float] = []
        self.lagged: LaggedGlobalClip | None = None
        """Set: clip by the global norm of an earlier update instead of the stage's own."""

    @torch.no_grad()
    def step(self, lr_step: int, global_norm: float | None = None) -> None:
        """One update; with `global_norm` G (a synchronous step) the gradient is scaled by
        min(1, max_norm / (G + 1e-6)) instead of by the stage's own or lagged norm."""
        settings = self.settings
        if global_norm is not None:
            norm = torch.nn.utils.get_total_norm([p.grad for p in self.params])
            for param in self.params:
                param.grad.mul_(min(1.0, settings.max_norm / (global_norm + 1e-6)))
        elif self.lagged is None:
            norm = torch.nn.utils.clip_grad_norm_(self.params, settings.max_norm, foreach=True)
        else:
            norm = self.lagged.clip(self.params, self.updates + 1)
        self.norms.append(float(norm))
        factor = lr_factor(settings, lr_step)
        if settings.delay_rescheduling_steps:
            factor /= self.lr_delay ** (1 - min(lr_step / settings.delay_rescheduling_steps, 1))
        updates = []  # (param, u, already applied)
        for name, param in self.matrices:
            grad, buffer, mu = param.grad, self.momentum[name], settings.momentum
            buffer.mul_(mu).add_(grad, alpha=1 - mu)
            m = (1 - mu) * grad + mu * buffer if settings.nesterov else buffer
            lr = settings.lr * factor
            scaled = lambda block: newton_schulz(block, settings.ns_steps) * 0.2 * math.sqrt(max(block.shape))
            if param.ndim == 3:
                orthogonal = torch.stack([scaled(expert) for expert in m])
            elif name.endswith("wqkv.weight") and not self.whole_qkv:
                orthogonal = merge_qkv([scaled(b) for b in qkv_blocks(m, self.head_dim)], self.head_dim)
            else:
                orthogonal = scaled(m)
            updates.append((param, lr * (orthogonal + settings.weight_decay * param), False))
        before = [p.detach().clone() for group in self.adamw.param_groups for p in group["params"]]
        for group in self.adamw.param_groups:
            group["lr"] = settings.adamw_lr * factor
        self.adamw.step()
        for old, param in zip(before, [p for group in self.adamw.param_groups for p in group["params"]]):
            updates.append((param, old - param, True))
        for param, update, applied in updates:
            if not applied:
                param.sub_(update)
            if self.ef is not None:
                if self.updates:
                    param.sub_(self.ef * (update - self.previous[id(param)]))
                self.previous[id(param)] = update
        self.updates += 1
        for param in self.params:
            param.grad = None

    def skip(self) -> None:
        """A skipped update: weights and optimizer state kept, the gradient dropped, its norm not
        a number (so is the global norm of that update)."""
        self.norms.append(math.nan)
        self.updates += 1
        for param in self.params:
            param.grad = None


def global_norm(optimizers: list[StageOptimizer]) -> float:
    """G of a synchronous step: the square root of the sum over the stages of each stage's squared
    gradient norm (every stage holds its gradient of the whole batch)."""
    return math.sqrt(sum(float(torch.nn.utils.get_total_norm([p.grad for p in o.params]).double()) ** 2 for o in optimizers))


@dataclass
class Result:
    losses: dict[int, float]
    """Step (1-based) -> the mean loss over the batch's tokens, as the run logs it."""
    weights: dict[str, torch.Tensor]
    """The weights after the last step, under their checkpoint names (the fused wqkv as wq, wk, wv)."""
    norms: list[list[float]]
    """Each stage's gradient norm before clipping, per update."""

    def global_norm(self, update: int) -> float:
        """The norm of update `update` (1-based) over the whole model: every stage's u-th update
        applies the same microbatches."""
        if not all(0 < update <= len(stage) for stage in self.norms):
            return math.inf  # a control that made fewer updates
        return math.sqrt(sum(stage[update - 1] ** 2 for stage in self.norms))


class LaggedGlobalClip:
    """`training.clipping = "lagged_global"`: update u of every stage, applying a batch fed at step
    t = step_of_update(u), has its gradient scaled by max_norm / (G + 1e-6) where that is below 1,
    G the global norm the row of step t - lag logs (the norm of update update_of_row(t - lag) over
    every stage), and by max_norm / (n + 1e-6) where that is smaller, n the stage's own norm of
    update u (a spike is clipped when it happens); before step lag + 1, and where G is not a
    number (an update skipped), each stage clips to max_norm / sqrt(stages) on its own."""

    def __init__(self, settings: Settings, optimizers: list[StageOptimizer], step_of_update, update_of_row, lag: int = 3) -> None:
        self.max_norm, self.optimizers, self.lag = settings.max_norm, optimizers, lag
        self.step_of_update, self.update_of_row = step_of_update, update_of_row
        for optimizer in optimizers:
            optimizer.lagged = self

    def clip(self, params: list[nn.Parameter], update: int) -> torch.Tensor:
        row = self.step_of_update(update) - self.lag
        update = self.update_of_row(row)  # 0: no update yet, a zero norm
        known = math.sqrt(sum(o.norms[update - 1] ** 2 for o in self.optimizers)) if row >= 1 and update else 0.0
        if row < 1 or not math.isfinite(known):
            return torch.nn.utils.clip_grad_norm_(params, self.max_norm / math.sqrt(len(self.optimizers)), foreach=True)
        norm = torch.nn.utils.clip_grad_norm_(params, math.inf, foreach=True)
        factor = min(1.0, self.max_norm / (known + 1e-6), self.max_norm / (float(norm) + 1e-6))
        for param in params:
            param.grad.mul_(factor)
        return norm


def one_thread(train):
    """Run `train` on one intra-op thread: on a busy 2-core machine this tiny model's matmuls take
    milliseconds each on two threads and microseconds on one."""
    @functools.wraps(train)
    def wrapper(*args, **kwargs):
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return train(*args, **kwargs)
        finally:
            torch.set_num_threads(threads)
    return wrapper


# --- PipeDream-2BW ---------------------------------------------------------------------------------

def expert_counts(model: nn.Module) -> torch.Tensor:
    """[blocks, experts]: the tokens each block routed to each expert since the counters were zeroed; zeroes them."""
    counts = torch.stack([block.tokens_per_expert_E.clone() for block in moe_blocks(model)])
    for block in moe_blocks(model):
        block.tokens_per_expert_E.zero_()
    return counts


@torch.no_grad()
def balance_load(model: nn.Module, counts: torch.Tensor, coeff: float) -> None:
    """torchtitan's auxiliary-loss-free rule (its optimizer pre-hook `_update_expert_bias`), per
    block: delta = coeff * sign(mean(count) - count), centred (delta - mean(delta)), added to the bias."""
    for block, row in zip(moe_blocks(model), counts.float()):
        delta = coeff * torch.sign(row.mean() - row)
        block.expert_bias_E.add_(delta - delta.mean())


def local_batch_parts(batch: list[Microbatch], settings: Settings) -> list[list[Microbatch]]:
    """Part g: every data rank's g-th accumulated local batch (a batch holds data rank d's local
    batches, in order, before data rank d + 1's)."""
    per_local, count = settings.local_batch_size // settings.microbatch_size, settings.local_batches
    chunks = [batch[i:i + per_local] for i in range(0, len(batch), per_local)]
    return [[mb for d in range(settings.data_ranks) for mb in chunks[d * count + g]] for g in range(count)]


@one_thread
def two_bw(settings: Settings, batches: list[list[Microbatch]], variant: str = "exact", bias_counts: str = "delayed",
           lagged_clip: int | None = None, skipped: frozenset[tuple[int, int]] = frozenset(), sync_start: int = 0,
           prediction: float = 0.0, delay: int = 1, **optimizer_options) -> Result:
    """W[k+1] = W[k] - Opt(grad f_k(W[k-1])), W[-1] = W[0]; each stage clips its own gradient.
    A `delay` of d > 1 steps (without Sync Start): W[k+1] = W[k] - Opt(grad f_k(W[k-d])),
    W[j] = W[0] for j < 0; "stale" then writes the update into W[k-d]; prediction takes it at
    W[k-d] + h d (W[k-d] - W[k-d-1]); error feedback's correction is c d (u_t - u_{t-1}).
    With experts the biases are part of W and move by the load-balancing rule from the counts of
    batch k routed at W[k-1] (the microbatches whose gradient the update applies).
    Controls: "stale" applies the update to W[k-1]; "no_delay" takes the gradient at W[k];
    "one_at_a_time" makes each accumulated local batch an update of its own (`local_batch_parts`,
    under the step's lr and loss normalisation);
    `bias_counts="next"` moves the biases by the counts of batch k+1 routed at W[k] (the batch
    the pipeline is forwarding when it steps; none after the last);
    `optimizer_options` (StageOptimizer's `error_feedback`, `whole_qkv`) change the optimizer;
    `lagged_clip` = lag clips by the global norm logged that many steps earlier (`LaggedGlobalClip`:
    update u applies the batch fed at step u, and the row of step t logs update t); each (stage, u)
    of `skipped` leaves that stage's weights and optimizer state as they are at update u (a
    non-finite gradient: its norm counts as 0), its lr schedule and expert biases moving on.
    Sync Start: the first `sync_start` steps take the gradient at W[k] and clip the global norm
    (`global_norm`); then the rule restarts as from fresh weights W[sync_start]
    (W[sync_start - 1] := W[sync_start]).
    Weight prediction (horizon h = `prediction` > 0): the gradient is taken at
    W[k-1] + h (W[k-1] - W[k-2]) instead of W[k-1], with W[-2] = W[-1] = W[0]."""
    assert delay == 1 or not sync_start
    optimizer_options.setdefault("ef_delay", delay)
    optimizer_options.setdefault("lr_delay", delay)
    model = build_model(settings)  # holds W[k]
    previous = copy.deepcopy(model)  # holds W[k-1] (W[k-d])
    past = []  # W[0..k]
    older = copy.deepcopy(model)  # holds W[k-2]
    predicted = copy.deepcopy(model)
    head_dim = settings.dim // settings.n_heads
    optimizers = [StageOptimizer(named, settings, head_dim, **optimizer_options) for named in stage_params(model, settings.stages)]
    if lagged_clip:
        LaggedGlobalClip(settings, optimizers, lambda update: update, lambda row: row, lagged_clip)
    moe = settings.family == "qwen3_moe"
    losses = {}
    for k, batch in enumerate(batches):
        if k == sync_start:
            previous.load_state_dict(model.state_dict())
        if delay > 1:
            past.append(copy.deepcopy(model.state_dict()))
            previous.load_state_dict(past[max(k - delay, 0)])
            older.load_state_dict(past[max(k - delay - 1, 0)])
        n, total = valid_tokens(batch), 0.0
        for part in local_batch_parts(batch, settings) if variant == "one_at_a_time" else [batch]:
            at = model if variant == "no_delay" or k < sync_start else previous
            if prediction:
                then, before = previous.state_dict(), older.state_dict()
                predicted.load_state_dict({name: value + prediction * delay * (value - before[name]) if value.is_floating_point() else value
                                           for name, value in then.items()})
                at = predicted
            at.zero_grad()
            if moe:
                expert_counts(at)
            for mb in part:
                loss = summed_loss(at(mb.tokens, positions=mb.positions, attention_masks=document_mask(mb.positions)), mb.labels) / n
                loss.backward()
                total += loss.item()
            if moe:
                counts = expert_counts(at)
                if bias_counts == "next":
                    counts = torch.zeros_like(counts)
                    if k + 1 < len(batches):
                        with torch.no_grad():
                            for mb in batches[k + 1]:
                                model(mb.tokens, positions=mb.positions, attention_masks=document_mask(mb.positions))
                        counts = expert_counts(model)
            latest = copy.deepcopy(model.state_dict())
            if variant == "stale":
                model.load_state_dict(previous.state_dict())
            if moe:
                balance_load(model, counts, settings.load_balance_coeff)
            for param, source in zip(model.parameters(), at.parameters()):
                param.grad = source.grad.clone()
            synchronous = global_norm(optimizers) if k < sync_start else None
            for stage, optimizer in enumerate(optimizers):
                if (stage, k + 1) in skipped:
                    optimizer.skip()
                else:
                    optimizer.step(k, synchronous)
            older.load_state_dict(previous.state_dict())
            previous.load_state_dict(latest)
        losses[k + 1] = total
    return Result(losses, weights(model), [o.norms for o in optimizers])


# --- PACI -------------------------------------------------------------------------------------------

class Stage(nn.Module):
    """The modules of one stage (`Settings.stages`), run in sequence."""

    def __init__(self, model: nn.Module, modules: tuple[str, ...]) -> None:
        super().__init__()
        self.model, self.modules_in_order = model, modules

    def forward(self, x, positions):
        mask = document_mask(positions)
        for name in self.modules_in_order:
            module = self.model.get_submodule(name)
            x = module(x, mask, positions) if name.startswith("layers.") else module(x)
        return x


class ForwardTimeValues:
    """While active, every parameter-holding module under `root` returns the value it had with
    the weights `snapshot` (name -> tensor, taken at the forward) but differentiates at its
    current weights: out_now + (out_then - out_now).detach(). `Float32Experts` does so per matmul
    (its `then`)."""

    def __init__(self, root: nn.Module) -> None:
        self.snapshot: dict[str, torch.Tensor] | None = None
        self.inside = False
        self.handles = []
        for prefix, module in root.named_modules():
            own = [name for name, _ in module.named_parameters(recurse=False)]
            if own:
                keys = {name: f"{prefix}.{name}" if prefix else name for name in own}
                if isinstance(module, Float32Experts):
                    self.handles.append(module.register_forward_pre_hook(self._experts_hook(keys)))
                else:
                    self.handles.append(module.register_forward_hook(self._hook(keys), with_kwargs=True))

    def _experts_hook(self, keys: dict[str, str]):
        def hook(module, args):
            module.then = None if self.snapshot is None else {name: self.snapshot[key] for name, key in keys.items()}
        return hook

    def _hook(self, keys: dict[str, str]):
        def hook(module, args, kwargs, output):
            if self.snapshot is None or self.inside:
                return None
            self.inside = True
            try:
                then = functional_call(module, {name: self.snapshot[key] for name, key in keys.items()}, args, kwargs)
            finally:
                self.inside = False
            return output + (then - output).detach()
        return hook


@one_thread
def paci(settings: Settings, batches: list[list[Microbatch]], drains: set[int], late: int = 0,
         backward_weights: str = "current", sync_start: int = 0, lagged_clip: int | None = None,
         prediction: float = 0.0, bias_counts: str = "forward") -> Result:
    """PACI on 2 stages: stage s keeps 1 - s microbatches in flight and steps after every `a` of
    its backwards, the stream drained after the steps in `drains`. Update u of a stage runs at
    the lr of scheduler step floor((u - 1) a / m). Controls: `late` steps that many backwards
    later; `backward_weights="forward"` runs a backward that crossed a local step at the
    forward's weights (a stash, as PipeDream keeps), not the current ones.
    Sync Start: the first `sync_start` steps are synchronous (each stage steps once per batch,
    u at lr step u - 1, the stream drained after each, once every stage has the batch's
    gradient: clipped by the global norm, `global_norm`); the rule above then counts its
    backwards and updates from there (update N + v at lr step N + floor((v - 1) a / m)).
    `lagged_clip` as in `two_bw` (without Sync Start): update u covers microbatches
    [(u - 1) a, u a), so it applies a batch fed at step floor((u a - 1) / m) + 1, and the row of
    step t logs update floor(t m / a). Weight prediction (h = `prediction` > 0): stage 0, whose
    microbatches cross 1 / a of its local steps on average, runs each forward at
    W + (h / a) (W - W_prev), W_prev its weights before its last step; its backward then reads
    the current weights as always; stage 1 crosses none. With experts, a stage's step first
    moves its blocks' biases by the counts of the microbatches whose backward it applies, each
    routed at its forward (`bias_counts="forward"`; the control "backward" counts the routing of
    stage 0's recomputation at the backward's weights and biases instead), and stage 0's
    backward routes as its forward did (the forward's biases)."""
    a, m = settings.accumulation or settings.microbatches, settings.microbatches
    drains = drains | set(range(1, sync_start + 1))
    model = build_model(settings)
    stages = [Stage(model, modules) for modules in settings.stages]
    optimizers = [StageOptimizer(named, settings, settings.dim // settings.n_heads) for named in stage_params(model, settings.stages)]
    if lagged_clip:
        LaggedGlobalClip(settings, optimizers, lambda update: (update * a - 1) // m + 1, lambda row: row * m // a, lagged_clip)
    mixed = ForwardTimeValues(model)
    counts, updates = [0, 0], [0, 0]
    names = [name for name, _ in model.named_parameters() if stage_of(name, settings.stages) == 0]
    before: dict[str, torch.Tensor] = {}  # stage 0's weights before its last step
    blocks = [[model.get_submodule(name).moe for name in modules if name.startswith("layers.")] if settings.family == "qwen3_moe" else []
              for modules in settings.stages]
    routed: list[list[torch.Tensor]] = [[], []]  # per stage: the counts of the backwards since its last step

    def stage_counts(stage: int) -> torch.Tensor:
        """The tokens stage `stage`'s blocks routed since the counters were zeroed; zeroes them."""
        counts = torch.stack([block.tokens_per_expert_E.clone() for block in blocks[stage]])
        for block in blocks[stage]:
            block.tokens_per_expert_E.zero_()
        return counts

    def step(stage: int, lr_step: int, synchronous: float | None = None) -> None:
        if stage == 0:
            before.update({n: p.detach().clone() for n, p in model.named_parameters() if stage_of(n, settings.stages) == 0})
        if blocks[stage]:
            with torch.no_grad():
                for block, row in zip(blocks[stage], sum(routed[stage]).float()):
                    delta = settings.load_balance_coeff * torch.sign(row.mean() - row)
                    block.expert_bias_E.add_(delta - delta.mean())
            routed[stage].clear()
        optimizers[stage].step(lr_step, synchronous)
        updates[stage] += 1

    completed: list[int] = []  # the stages that have their gradient of the synchronous batch

    def after_backward(stage: int) -> None:
        counts[stage] += 1
        if counts[stage] <= sync_start * m:
            if counts[stage] % m == 0:
                completed.append(stage)
            if len(completed) == len(optimizers):
                norm = global_norm(optimizers)
                for done in sorted(completed):
                    step(done, updates[done], norm)
                completed.clear()
            return
        count, update = counts[stage] - sync_start * m, updates[stage] - sync_start
        if count >= a + late and (count - late) % a == 0:
            step(stage, sync_start + update * a // m)

    in_flight: list[tuple] = []  # stage 0's: (index, weights then, output grad, microbatch, its counts and biases at the forward)

    def stage0_backward() -> None:
        _, then, grad, mb, forward_counts, forward_biases = in_flight.pop(0)
        state = {n: p for n, p in model.named_parameters()}
        same = all(torch.equal(then[n], state[n]) for n in names)
        biases_now = [block.expert_bias_E.clone() for block in blocks[0]]
        if bias_counts == "forward":
            with torch.no_grad():
                for block, bias in zip(blocks[0], forward_biases):
                    block.expert_bias_E.copy_(bias)
        if same or backward_weights == "current":
            mixed.snapshot = None if same else then
            try:
                out = stages[0](mb.tokens, mb.positions)
            finally:
                mixed.snapshot = None
            out.backward(grad)
        else:  # the control: forward and backward at the forward's weights, the gradient kept
            now = {n: state[n].detach().clone() for n in names}
            with torch.no_grad():
                for n in names:
                    state[n].copy_(then[n])
            stages[0](mb.tokens, mb.positions).backward(grad)
            with torch.no_grad():
                for n in names:
                    state[n].copy_(now[n])
        if blocks[0]:
            recomputed = stage_counts(0)
            routed[0].append(forward_counts if bias_counts == "forward" else recomputed)
            with torch.no_grad():
                for block, bias in zip(blocks[0], biases_now):
                    block.expert_bias_E.copy_(bias)
        after_backward(0)

    losses = {}
    for t, batch in enumerate(batches):
        n, total = valid_tokens(batch), 0.0
        for mb in batch:
            then = {name: p.detach().clone() for name, p in model.named_parameters() if stage_of(name, settings.stages) == 0}
            if prediction and updates[0]:
                then = {name: w + prediction / a * (w - before[name]) for name, w in then.items()}
            live = dict(model.named_parameters())
            now = {name: live[name].detach().clone() for name in then}
            if blocks[0]:
                stage_counts(0)
            with torch.no_grad():
                for name in then:
                    live[name].copy_(then[name])
                h = stages[0](mb.tokens, mb.positions)
                for name in then:
                    live[name].copy_(now[name])
            forward_counts = stage_counts(0) if blocks[0] else None
            forward_biases = [block.expert_bias_E.clone() for block in blocks[0]]
            h = h.detach().requires_grad_(True)
            if blocks[1]:
                stage_counts(1)
            loss = summed_loss(stages[1](h, mb.positions), mb.labels) / n
            loss.backward()
            total += loss.item()
            if blocks[1]:
                routed[1].append(stage_counts(1))
            after_backward(1)
            in_flight.append((t, then, h.grad, mb, forward_counts, forward_biases))
            while len(in_flight) > 1:  # stage 0 keeps one microbatch in flight
                stage0_backward()
        losses[t + 1] = total
        if t + 1 in drains:
            while in_flight:
                stage0_backward()
    return Result(losses, weights(model), [o.norms for o in optimizers])


@one_thread
def paci_stages(settings: Settings, batches: list[list[Microbatch]], drains: set[int], late: int = 0,
                backward_weights: str = "current", lr_delays: list[float] | None = None) -> Result:
    """PACI on any number of stages (dense, no Sync Start, prediction or lagged clipping): stage s
    keeps p-1-s microbatches in flight (its forward of microbatch k + p-1-s, then its backward of
    k, the stream drained after the steps in `drains`) and steps after every `a` of its
    backwards, update u at the lr of scheduler step floor((u - 1) a / m). A backward combines the
    activations its forward saved with the weights current then: the stage is re-run from its
    forward-time input under `ForwardTimeValues` (the forward's weights as the value, the current
    ones for the derivatives). With m or a below p - 1 a microbatch crosses several local steps of
    its stage. Stages run in any order their messages allow (each stage's weights change only by
    its own steps). Controls as in `paci`: `late`, `backward_weights="forward"`. With
    `settings.delay_rescheduling_steps` each stage's lr is rescheduled by its entry of `lr_delays`
    (`StageOptimizer`'s `lr_delay`, at most 1 meaning none)."""
    a, m = settings.accumulation or settings.microbatches, settings.microbatches
    model = build_model(settings)
    p = len(settings.stages)
    stages = [Stage(model, modules) for modules in settings.stages]
    lr_delays = lr_delays or [1.0] * p
    optimizers = [StageOptimizer(named, settings, settings.dim // settings.n_heads, lr_delay=max(1.0, lr_delays[s]))
                  for s, named in enumerate(stage_params(model, settings.stages))]
    names = [[name for name, _ in named] for named in stage_params(model, settings.stages)]
    live = dict(model.named_parameters())
    mixed = ForwardTimeValues(model)
    counts, updates = [0] * p, [0] * p
    activations: dict[tuple[int, int], torch.Tensor] = {}  # (stage, microbatch) -> its input from the stage before
    gradients: dict[tuple[int, int], torch.Tensor] = {}  # (stage, microbatch) -> the gradient at its output
    in_flight: dict[tuple[int, int], tuple] = {}  # (stage, microbatch) -> (input, weights at the forward)
    losses: dict[int, float] = {}
    order = [[] for _ in range(p)]  # each stage's actions: ("F" | "B", global microbatch), with drains
    for s in range(p):
        held = []
        for t in range(len(batches)):
            for k in range(t * m, t * m + m):
                order[s].append(("F", k))
                held.append(k)
                if len(held) > p - 1 - s:
                    order[s].append(("B", held.pop(0)))
            if t + 1 in drains:
                order[s] += [("B", k) for k in held]
                held.clear()
    microbatch = {t * m + j: (t, mb) for t, batch in enumerate(batches) for j, mb in enumerate(batch)}

    def forward(s: int, k: int) -> None:
        t, mb = microbatch[k]
        x = mb.tokens if s == 0 else activations.pop((s, k))
        in_flight[(s, k)] = (x, {name: live[name].detach().clone() for name in names[s]})
        if s < p - 1:
            with torch.no_grad():
                activations[(s + 1, k)] = stages[s](x, mb.positions)

    def backward(s: int, k: int) -> None:
        t, mb = microbatch[k]
        x, then = in_flight.pop((s, k))
        x = x if s == 0 else x.detach().requires_grad_(True)
        same = all(torch.equal(then[name], live[name]) for name in names[s])
        if backward_weights == "forward" and not same:  # the control: a stash, the forward's weights throughout
            now = {name: live[name].detach().clone() for name in names[s]}
            with torch.no_grad():
                for name in names[s]:
                    live[name].copy_(then[name])
        mixed.snapshot = None if same or backward_weights == "forward" else then
        try:
            out = stages[s](x, mb.positions)
        finally:
            mixed.snapshot = None
        if s == p - 1:
            loss = summed_loss(out, mb.labels) / valid_tokens(batches[t])
            loss.backward()
            losses[t + 1] = losses.get(t + 1, 0.0) + loss.item()
        else:
            out.backward(gradients.pop((s, k)))
        if backward_weights == "forward" and not same:
            with torch.no_grad():
                for name in names[s]:
                    live[name].copy_(now[name])
        if s > 0:
            gradients[(s - 1, k)] = x.grad
        counts[s] += 1
        if counts[s] >= a + late and (counts[s] - late) % a == 0:
            optimizers[s].step(updates[s] * a // m)
            updates[s] += 1

    position = [0] * p
    while any(position[s] < len(order[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            while position[s] < len(order[s]):
                kind, k = order[s][position[s]]
                if kind == "F" and (s == 0 or (s, k) in activations):
                    forward(s, k)
                elif kind == "B" and (s == p - 1 or (s, k) in gradients):
                    backward(s, k)
                else:
                    break
                position[s] += 1
                progressed = True
        assert progressed, "reference stalled"
    return Result(losses, weights(model), [o.norms for o in optimizers])
