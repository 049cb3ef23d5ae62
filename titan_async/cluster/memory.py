"""Memory and bubble arithmetic behind `titan-async plan`: plain numbers in, bytes out.

Per GPU, every pipeline rank's memory is made of these components (bytes); how they add up
to its peak ("total") is said under optimizer_step:

- weights: the rank's stage parameters other than MoE experts in the parameter dtype
  (training.dtype): under TP each matrix (every 2-D weight: linears, embedding, output head)
  is split TP ways and the norm weights are whole on every TP rank (`tp_local`), and FSDP
  shards that TP shard over FSDP x CP. Replicas (DDP, HSDP) hold the same shards as their
  FSDP group, which shards over data_parallel_shard_degree only: a rank's memory is that of
  its FSDP group whatever the replicate degree.
- expert_weights: the MoE experts' 3-D weights (experts x rows x cols), sharded by FSDP like
  every other weight (no expert or tensor parallelism: `plan` refuses those for MoE).
- weight_versions: PipeDream2BW (and gradient_delay = 1) keeps a second weight version:
  one more copy of the local weights, experts included (d more for a delay of d steps,
  fewer microbatches than stages or gradient_delay = d; for plain parameters the other
  buffers, under FSDP2 side shards beside FSDP's own, and on a pipeline stage as many gathered
  copies, `gathered_versions`), and of the MoE blocks' expert biases
  (float32, whole on every rank: a batch routes with the biases of its own version).
- gradients: the sharded gradient, parameter dtype. Under FSDP it exists only from the
  reduce-scatter to the optimizer's zero_grad: in forward and backward the unsharded
  gradients (fsdp_buffers) stand in for it.
- optimizer: AdamW keeps 2 moments per parameter; Muon 1 momentum buffer per hidden
  matrix and AdamW's 2 moments for everything else; parameter dtype.
- error_feedback: one update-sized buffer per parameter when enabled.
- fsdp_buffers: FSDP2's unsharded parameters (compute dtype) and unsharded gradients
  (reduce dtype); under TP "unsharded" is the rank's TP shard (`tp_local`). On a pipeline
  every unit of a stage stays unsharded and its gradient accumulates unsharded between
  reductions (torch's schedules disable gradient sync and resharding until the last backward
  of a step; the streaming stages hold their units gathered, titan_async.parallel.fsdp_stage):
  stage parameters x (compute + reduce bytes), and PipeDream2BW keeps its other version
  gathered too (+ stage parameters x compute bytes) on every stage but the last, which runs
  each backward right after its forward and so never needs the older version gathered beside
  the newer. Without PP: the largest unit
  gathered twice (current and prefetched) plus its unsharded gradient.
  FSDP's flat communication buffers come on top (`fsdp_flat_buffer_bytes`).
- p2p_buffers: the streaming schedules' transport (titan_async.pipeline.transport): per
  direction of each edge at most w + 1 = p - rank receives posted ahead and as many sends
  outstanding, each one microbatch's stage-boundary tensor (tokens x dim, compute dtype; under
  sequence parallelism a (B, L / tp, D) shard).
  A sent activation is the stage output its microbatch keeps for its backward, so the
  outputs of in-flight microbatches are these send buffers. torch's own schedules' receive
  buffers are not estimated (0).
- stage_inputs: the received activations in-flight microbatches keep (`stage_input_bytes`).
- nccl_buffers: GPU only (`nccl_buffer_bytes`): NCCL's buffers of the streaming transport's
  per-edge communicators. gloo (CPU) has none.
- activations: microbatches held between forward and backward x activations of one
  microbatch (see `block_activation_bytes`; an MoE block's experts see top_k x its tokens,
  `moe_activation_bytes`), plus transients: the logits of the last
  stage and, with full recomputation, one block recomputed for one microbatch.
- optimizer_step: scratch of one optimizer step (`optimizer_step_bytes`): Muon's momenta,
  gathered full matrices, Newton-Schulz work buffers and updates, and the weight copy error
  feedback makes around AdamW. Muon orthogonalises each full logical matrix on one owner rank
  of the group that holds its pieces (FSDP x CP x TP, `Setup.muon_group`). It is alive only
  during the step, while the microbatches in flight across it keep their activations
  (`held_at_step`) and FSDP keeps only a pipeline stage's gathered weights
  (`fsdp_step_bytes`), so the peak ("total") is state + transport buffers +
  max(activations + fsdp_buffers, those at the step + optimizer_step), with FSDP's sharded
  gradients in the second term only.

The first six are what a meta-device dry run allocates (`STATE_COMPONENTS`); the
others exist only while training runs, so they are estimates only. tools/bench_plan_memory.py
compares the total with the tensor bytes a CPU run keeps alive at its peak.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

import torch

from titan_async.optim.full_matrix import assign_owners
from titan_async.optim.newton_schulz import flops, gram_form
from titan_async.pipeline.actions import gradient_delay
from titan_async.pipeline.in_flight import rank_chunks
from titan_async.pipeline.split import check_microbatches, schedule_stages

STATE_COMPONENTS = ("weights", "expert_weights", "weight_versions", "gradients", "optimizer", "error_feedback")
TRANSPORT_COMPONENTS = ("p2p_buffers", "stage_inputs", "nccl_buffers")
COMPONENTS = (*STATE_COMPONENTS, "fsdp_buffers", *TRANSPORT_COMPONENTS, "activations", "optimizer_step")
"""Every component of a rank's memory; "total" is not their sum (see the module docstring)."""
NCCL_BUFFSIZE = 4 * 2**20
"""NCCL_BUFFSIZE's default: the buffer NCCL allocates per channel for each peer it connects to."""
NCCL_P2P_CHANNELS = 2
"""Channels NCCL opens per peer for point-to-point operations (assumed; NCCL picks them by topology)."""
COMPARED_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "PipeDream2BW", "PACI")
"""Schedules whose predicted bubble `plan` prints for every config."""
INTERLEAVED_CHUNKS = 2
STREAMING_SCHEDULES = {"pipedream2bw", "paci"}

@dataclass(frozen=True)
class MuonMatrix:
    """One tensor Muon updates: its full shape and the shapes of the blocks it orthogonalises
    separately (several blocks of a fused matrix are copied out of it and merged back; a 3-D
    MoE expert tensor is a stack of one block per expert, views of it)."""

    shape: tuple[int, ...]
    blocks: tuple[tuple[int, int], ...]

    @property
    def elements(self) -> int:
        return math.prod(self.shape)

    @property
    def copied_blocks(self) -> bool:
        """Whether its blocks are copies: a fused 2-D matrix split in several."""
        return len(self.shape) == 2 and len(self.blocks) > 1


@dataclass(frozen=True)
class StageShape:
    """One pipeline stage: its modules and parameter counts (unsharded)."""

    index: int
    modules: tuple[str, ...]
    params: int
    matrix_params: int
    """Parameters Muon takes (2-D hidden matrices); the rest gets AdamW."""
    layers: int
    largest_unit: int
    """Parameters of its largest FSDP unit (a block, the embedding, or norm + output head) on one
    TP rank (`stage_shapes`' `tp`)."""
    last: bool
    muon_matrices: tuple[MuonMatrix, ...] = ()
    """Its Muon matrices in parameter order (the order Muon stacks their blocks in)."""
    replicated: int = 0
    """Parameters every TP rank holds whole (the norm weights); TP splits the others."""
    expert_params: int = 0
    """Parameters of its MoE experts' 3-D weights (included in `params` and `matrix_params`)."""
    expert_biases: int = 0
    """Elements of its MoE blocks' expert biases (float32 buffers, not parameters)."""


@dataclass(frozen=True)
class Setup:
    """How every rank trains, as far as memory is concerned."""

    dim: int
    kv_dim: int
    ffn_dim: int
    vocab_size: int
    tokens: int
    """Tokens of one microbatch's stage-boundary tensor on one rank (after the context and
    sequence parallel splits)."""
    param_bytes: int
    compute_bytes: int
    reduce_bytes: int
    weight_shards: int
    """Ranks FSDP shards each TP shard over (FSDP x CP; 1 without FSDP)."""
    fsdp: bool
    fsdp_degree: int
    unsharded_for_step: bool
    """FSDP units stay unsharded across the actions of a step (pipeline schedules)."""
    version_copies: int
    """Extra copies of the local weights the weight-version policy keeps (0, or 2BW's delay d; 2
    with weight prediction: 2BW's two predictions besides the latest weights, PACI's W_prev and
    prediction)."""
    gathered_versions: int
    """Extra gathered copies of the stage weights (PipeDream2BW under FSDP2 on a pipeline: d)."""
    optimizer: Literal["adamw", "muon"]
    error_feedback: bool
    activation_checkpoint: Literal["none", "selective", "full"]
    copies_on_last_stage: bool = True
    """Whether the last stage keeps `version_copies` too (not under PACI's weight prediction: its
    microbatches cross no local step)."""
    nesterov: bool = True
    ns_steps: int = 5
    ns_dtype: Literal["float32", "bfloat16"] = "bfloat16"
    """Newton-Schulz iteration dtype on the planned device (optimizer.muon.ns_dtype resolved)."""
    muon_group: int = 1
    """Ranks whose pieces of a matrix Muon gathers to one owner, FSDP x CP x TP (1: matrices are whole)."""
    tp: int = 1
    """tensor_parallel_degree."""
    sequence_parallel: bool = True
    """Under TP, activations between blocks are split along the sequence (parallelism.enable_sequence_parallel)."""
    replicas: int = 1
    """data_parallel_replicate_degree: copies of the FSDP group, each holding the same shards."""
    gpu: bool = True
    """Planned for GPUs (NCCL); False for CPU processes (gloo)."""
    num_experts: int = 0
    """Routed experts per MoE block (0: a dense model)."""
    top_k: int = 0
    """Experts each token is routed to."""
    moe_hidden_dim: int = 0
    """Hidden size of each expert's SwiGLU."""
    expert_bytes: int = 2
    """Bytes per element of the experts' grouped matmuls: 2 (torchtitan's bfloat16), or the compute
    dtype's with `model.expert_precision = "full"`."""
    ep: int = 1
    """expert_parallel_degree: data ranks of a stage that split the experts and exchange the routed
    tokens by all-to-all (1: each rank routes its own tokens)."""
    weight_prediction: bool = False
    """training.weight_prediction > 0: PACI's stages before the last run each forward on predicted weights."""

    @property
    def gathered(self) -> int:
        """Tokens each TP rank sees inside a block per boundary token: the sequence parallel
        shard's all-gather makes tp of one (1 without sequence parallelism or TP)."""
        return self.tp if self.sequence_parallel else 1


def tp_local(params: float, replicated: float, setup: Setup) -> float:
    """Parameters one TP rank holds of `params`, `replicated` of which it holds whole."""
    return (params - replicated) / setup.tp + replicated


def adamw_params(stage: StageShape, setup: Setup) -> float:
    """Parameters of `stage` one rank's AdamW steps (all of them, or Muon's leftovers), after TP and FSDP."""
    adamw = stage.params - (stage.matrix_params if setup.optimizer == "muon" else 0)
    return tp_local(adamw, stage.replicated, setup) / setup.weight_shards


def state_bytes(stage: StageShape, setup: Setup) -> dict[str, float]:
    """Per-GPU bytes of the state a rank of `stage` keeps between steps (`STATE_COMPONENTS`);
    Muon's matrices are all split by TP; experts (never under TP) are split by FSDP only."""
    local = tp_local(stage.params, stage.replicated, setup) / setup.weight_shards
    weights = local * setup.param_bytes
    experts = stage.expert_params / setup.weight_shards * setup.param_bytes
    if setup.optimizer == "muon":
        moments = stage.matrix_params / setup.tp / setup.weight_shards + 2 * adamw_params(stage, setup)
    else:
        moments = 2 * local
    return {
        "weights": weights - experts,
        "expert_weights": experts,
        "weight_versions": (weights + 4 * stage.expert_biases) * (setup.version_copies if setup.copies_on_last_stage or not stage.last else 0),
        "gradients": weights,
        "optimizer": moments * setup.param_bytes,
        "error_feedback": weights if setup.error_feedback else 0.0,
    }


def fsdp_buffer_bytes(stages: list[StageShape], setup: Setup) -> float:
    """FSDP2's unsharded parameters and gradients on one rank (see the module docstring), plus
    its flat communication buffers (`fsdp_flat_buffer_bytes`)."""
    if not setup.fsdp:
        return 0.0
    if setup.unsharded_for_step:
        unsharded = _fsdp_params(stages, setup) * ((1 + setup.gathered_versions) * setup.compute_bytes + setup.reduce_bytes)
    else:
        unsharded = max(s.largest_unit for s in stages) * (2 * setup.compute_bytes + setup.reduce_bytes)
    return unsharded + fsdp_flat_buffer_bytes(stages, setup)


def fsdp_flat_buffer_bytes(stages: list[StageShape], setup: Setup) -> float:
    """FSDP2's flat communication buffers (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py),
    one unit at a time: the all-gather output its parameters are copied out of (compute dtype),
    or the reduce-scatter input its gradients are copied into (reduce dtype; FSDP drops the
    previous unit's before it makes the next). Sized by the largest unit; 0 without FSDP."""
    if not setup.fsdp:
        return 0.0
    return max(s.largest_unit for s in stages) * max(setup.compute_bytes, setup.reduce_bytes)


def fsdp_step_bytes(stages: list[StageShape], setup: Setup) -> float:
    """What FSDP2 keeps through an optimizer step: the gathered parameters (and 2BW's gathered
    second version) of a pipeline stage, which stays gathered; gradients were reduce-scattered
    and their unsharded copies freed before the step. Without a pipeline every unit is
    resharded by then: 0."""
    if not (setup.fsdp and setup.unsharded_for_step):
        return 0.0
    return _fsdp_params(stages, setup) * (1 + setup.gathered_versions) * setup.compute_bytes


def _fsdp_params(stages: list[StageShape], setup: Setup) -> float:
    """Parameters of `stages` one rank's FSDP gathers and reduces: those of its TP rank, and under
    EP only its own experts (1/ep of them; experts are never under TP)."""
    return sum(tp_local(s.params, s.replicated, setup) - s.expert_params * (1 - 1 / setup.ep) for s in stages)


def block_activation_bytes(setup: Setup, mode: str | None = None) -> float:
    """Bytes one transformer block keeps per stage-boundary token for its backward (eager
    torchtitan llama3).

    none: each RMSNorm keeps two float32 copies of its input (cast and normalized), 4 dim x
    4 bytes; in the compute dtype, the two normalized outputs (2 dim), q, k, v after RoPE
    (dim + 2 kv_dim), the attention output (dim) and SwiGLU's w1 and w3 outputs, the SiLU
    output and their product (4 ffn_dim). Matches the tensors autograd saves on CPU
    (tests/test_plan.py), apart from the seq x seq mask the dense CPU attention keeps.
    selective (torchtitan's per-op policy: attention and every second matmul saved): the
    block input, the wqkv, attention, w1 and w2 outputs (4 dim + 2 kv_dim + ffn_dim).
    full: the block input (dim).
    Under TP with g = `Setup.gathered` tokens per boundary token: the norms run on the
    boundary shard; the linears keep their all-gathered input (g x dim per normalized output);
    q, k, v, the attention output and the SwiGLU tensors are head- or column-split (g / tp);
    selective saves the rowwise w2's partial output whole (g x dim) and, with sequence
    parallelism, the two reduce-scatter outputs (2 dim).
    Float8 linears count like the compute dtype: torchao's rowwise recipes save the
    high-precision inputs for their backward.
    """
    mode = mode or setup.activation_checkpoint
    c, d, g = setup.compute_bytes, setup.dim, setup.gathered
    split = g / setup.tp
    if mode == "full":
        return c * d
    if setup.num_experts:
        return moe_block_activation_bytes(setup, mode)
    if mode == "selective":
        scattered = 2 * d if setup.tp > 1 and setup.sequence_parallel else 0
        return c * (d + split * (2 * d + 2 * setup.kv_dim + setup.ffn_dim) + g * d + scattered)
    return 16 * d + c * (2 * g * d + split * (2 * d + 2 * setup.kv_dim + 4 * setup.ffn_dim))


def moe_block_activation_bytes(setup: Setup, mode: str) -> float:
    """Bytes one block of the qwen3_moe family (eager torchtitan, no TP: `plan` refuses TP with
    MoE) keeps per stage-boundary token for its backward, for `mode` none or selective.

    none: the two RMSNorms' float32 copies (16 dim) and the QK norms' (8 (dim + kv_dim)); in the
    compute dtype the two normalized outputs, q, k, v after RoPE and the attention output
    (4 dim + 2 kv_dim); the router's float32 scores (4 E; on GPUs also the float32 copy of its
    input that autocast makes, 4 dim); and top_k routed tokens (`routed_token_bytes`).
    selective: the attention half as for llama3 (the same tensors: its policy saves them) and
    the router and experts as none (an upper bound). Matches the tensors autograd saves on
    CPU in bfloat16 (tests/test_plan_moe.py), apart from RoPE's tables and the per-head
    statistics; the bfloat16 copies of the expert weights a float32 model makes are per
    microbatch, not per token (`expert_weight_copy_bytes`)."""
    c, d, kv = setup.compute_bytes, setup.dim, setup.kv_dim
    router = 4 * setup.num_experts + (4 * d if setup.gpu and c < 4 else 0)
    attention = 16 * d + 8 * (d + kv) + c * (4 * d + 2 * kv)
    return attention + router + setup.top_k * routed_token_bytes(setup)


def routed_token_bytes(setup: Setup) -> float:
    """Bytes an MoE block keeps for each (token, expert) pair it routes: the experts' SwiGLU in
    their matmul dtype of e = `expert_bytes` (w1 and w3 outputs, the SiLU output and the product:
    4 hidden x e), their input (the gathered token, cast to e bytes once per matmul when the model
    computes in another dtype: twice), the float32 expert output scaled by its routing score
    (4 dim), and three int64 indices of the dispatch."""
    e = setup.expert_bytes
    inputs = 1 if e == setup.compute_bytes else 2
    return 4 * e * setup.moe_hidden_dim + e * setup.dim * inputs + 4 * setup.dim + 24


def expert_weight_copy_bytes(setup: Setup) -> float:
    """Bytes an MoE block keeps per microbatch whatever its tokens: experts multiplying in another
    dtype than the model computes in (torchtitan's bfloat16 in a float32 model) keep their three
    weights' cast copies (3 x E x hidden x dim x e) for the backward; 0 otherwise or for dense blocks."""
    if not setup.num_experts or setup.expert_bytes == setup.compute_bytes:
        return 0.0
    return 3 * setup.num_experts * setup.moe_hidden_dim * setup.dim * setup.expert_bytes


def microbatch_activation_bytes(stage: StageShape, setup: Setup) -> float:
    """Bytes one in-flight microbatch keeps on `stage`: its blocks (with MoE, also the expert
    weights' bfloat16 copies, `expert_weight_copy_bytes`, unless recomputed) and, on the last
    stage, the final norm (two float32 copies), the output head's (all-gathered) input and the
    float32 log-softmax that cross-entropy saves (tokens x vocab x 4, vocabulary split by TP)."""
    per_token = stage.layers * block_activation_bytes(setup)
    if stage.last:
        g = setup.gathered
        per_token += 8 * setup.dim + setup.compute_bytes * g * setup.dim + 4 * _logit_columns(setup)
    copies = 0.0 if setup.activation_checkpoint == "full" else stage.layers * expert_weight_copy_bytes(setup)
    return setup.tokens * per_token + copies


def _logit_columns(setup: Setup) -> float:
    """Logits one rank computes per stage-boundary token: the output head is split by vocabulary
    under TP (torchtitan keeps the logits vocab-sharded into the loss)."""
    return setup.gathered * setup.vocab_size / setup.tp


def transient_activation_bytes(stages: list[StageShape], setup: Setup) -> float:
    """Peak scratch on top of held activations: the last stage's (vocab-sharded) logits (compute
    dtype) and their float32 copy; with full recomputation, one block recomputed for one microbatch."""
    scratch = 0.0
    if any(s.last for s in stages):
        scratch += setup.tokens * _logit_columns(setup) * (setup.compute_bytes + 4)
    if setup.activation_checkpoint == "full" and any(s.layers for s in stages):
        scratch += setup.tokens * block_activation_bytes(setup, "none") + expert_weight_copy_bytes(setup)
    return scratch


def held_microbatches(schedule: str, rank: int, ranks: int, microbatches: int, stages_per_rank: int) -> int:
    """Microbatches (chunks, with several stages per rank) a pipeline rank holds at its peak.

    torch's schedules: counted on the action lists torch builds (`pipeline.in_flight`: +1 at
    each F, -1 at the B or W that frees it), which gives GPipe/LoopedBFS all m v of them, 1F1B
    min(m, p - rank) and Interleaved1F1B min(m v, (v - 1) p + 2 (p - 1 - rank) + 1) (torch's
    warm-up), and the zero-bubble and V-shaped schedules what their lists hold (at p = 8, m = 32:
    ZBVZeroBubble 16 and DualPipeV 17 on every rank, InterleavedZeroBubble 16, its W running
    late). The streaming schedules: min(m, p - rank).
    """
    if schedule.lower() in STREAMING_SCHEDULES:
        return min(microbatches, ranks - rank)
    return sum(rank_chunks(schedule, rank, ranks, microbatches, stages_per_rank).values())


def transport_bytes(schedule: str, rank: int, ranks: int, setup: Setup) -> float:
    """Bytes of the streaming transport's live buffers on pipeline rank `rank` (module docstring)."""
    if schedule.lower() not in STREAMING_SCHEDULES or ranks < 2:
        return 0.0
    directions = 2 * ((rank > 0) + (rank < ranks - 1))
    return directions * (ranks - rank) * setup.tokens * setup.dim * setup.compute_bytes


def nccl_buffer_bytes(schedule: str, rank: int, ranks: int, setup: Setup) -> float:
    """NCCL's buffers of the streaming transport's per-edge communicators on pipeline rank `rank`
    (GPU only; 0 for gloo): one communicator per direction of each edge, 2 per neighbour, each
    NCCL_P2P_CHANNELS x NCCL_BUFFSIZE on this rank (assumed: NCCL sizes channels by topology,
    and NCCL_BUFFSIZE set lower shrinks them). The communicators FSDP and torch's own schedules
    share are not counted."""
    if not setup.gpu or schedule.lower() not in STREAMING_SCHEDULES or ranks < 2:
        return 0.0
    communicators = 2 * ((rank > 0) + (rank < ranks - 1))
    return communicators * NCCL_P2P_CHANNELS * NCCL_BUFFSIZE


def stage_input_bytes(stage: StageShape, held: float, setup: Setup) -> float:
    """The received activations (tokens x dim, compute dtype) that the `held` in-flight
    microbatches of a stage other than the first keep until their backward (its input gradient
    is computed into them). In float32 the first block's RMSNorm keeps this very tensor as its
    float32 input, which `block_activation_bytes` counts, so it is 0 there."""
    if stage.index == 0 or (setup.compute_bytes == 4 and stage.layers):
        return 0.0
    return held * setup.tokens * setup.dim * setup.compute_bytes


def _stacks(matrices: tuple[MuonMatrix, ...]) -> list[tuple[int, int, int]]:
    """(blocks, narrow side, wide side) of each stack Muon orthogonalises, in the order it meets
    them (titan_async.optim.newton_schulz_batched.orthogonalize_all)."""
    counts: dict[tuple[int, int], int] = {}
    for matrix in matrices:
        for rows, cols in matrix.blocks:
            key = (min(rows, cols), max(rows, cols))
            counts[key] = counts.get(key, 0) + 1
    return [(count, narrow, wide) for (narrow, wide), count in counts.items()]


def newton_schulz_bytes(count: int, narrow: int, wide: int, setup: Setup) -> float:
    """Peak bytes of one stack's Newton-Schulz iteration, its result included
    (`orthogonalize_batched`): the stacked blocks (parameter dtype), the iterate and the result
    or spare (2 x the stack, iteration dtype), and narrow x narrow buffers per block, 2 in the
    standard form and 4 in the Gram form (float32 only, for wide blocks)."""
    ns_bytes = torch.finfo(getattr(torch, setup.ns_dtype)).bits // 8
    elements = count * narrow * wide
    squares = 4 if gram_form((narrow, wide), setup.ns_steps, getattr(torch, setup.ns_dtype)) else 2
    return elements * (setup.param_bytes + 2 * ns_bytes) + squares * count * narrow * narrow * ns_bytes


def muon_step_bytes(owned: tuple[MuonMatrix, ...], local_elements: float, setup: Setup) -> float:
    """Scratch of one Muon step (titan_async.optim.muon.Muon.updates) on a rank that orthogonalises
    the full matrices `owned` and holds `local_elements` of Muon parameters, parameter dtype:
    the Nesterov momenta (local), under FSDP the gathered full matrices, the blocks copied out of
    fused matrices, then the largest of: the iteration of each stack on top of the results of
    the stacks before it; all results and their lr-scaled copies (2 x owned); under FSDP the
    exchange back (the updates, their padded and concatenated copies: 3 x owned, and the local
    rows received)."""
    p = setup.param_bytes
    full = sum(m.elements for m in owned) * p
    base = (local_elements * p if setup.nesterov else 0.0) + (full if setup.muon_group > 1 else 0.0)
    split = sum(m.elements for m in owned if m.copied_blocks) * p
    peak, done = 2 * full + split, 0.0
    for count, narrow, wide in _stacks(owned):
        peak = max(peak, split + done + newton_schulz_bytes(count, narrow, wide, setup))
        done += count * narrow * wide * p
    if setup.muon_group > 1:
        peak = max(peak, 3 * full + local_elements * p)
    return base + peak


def _owned_matrices(stage: StageShape, setup: Setup) -> list[tuple[MuonMatrix, ...]]:
    """The matrices each rank of the Muon group owns (owners balanced by Newton-Schulz FLOPs,
    as `titan_async.optim.full_matrix.map_full_matrices` assigns them)."""
    dtype = getattr(torch, setup.ns_dtype)
    costs = [sum(flops(block, setup.ns_steps, dtype) for block in m.blocks) for m in stage.muon_matrices]
    owners = assign_owners(costs, setup.muon_group)
    return [tuple(m for m, o in zip(stage.muon_matrices, owners) if o == rank) for rank in range(setup.muon_group)]


def optimizer_step_bytes(stages: list[StageShape], setup: Setup) -> float:
    """Peak scratch of the optimizer steps of a rank's stages (each stage's optimizers step one
    after another): Muon's (`muon_step_bytes`, on the rank owning the most), and with error
    feedback around AdamW the copy of AdamW's local weights it makes each step to measure the
    update (titan_async.optim.error_feedback). Fused AdamW itself needs no scratch."""
    peak = 0.0
    for stage in stages:
        if setup.error_feedback:
            peak = max(peak, adamw_params(stage, setup) * setup.param_bytes)
        if setup.optimizer == "muon" and stage.muon_matrices:
            local = stage.matrix_params / setup.tp / setup.weight_shards
            peak = max(peak, *(muon_step_bytes(owned, local, setup) for owned in _owned_matrices(stage, setup)))
    return peak


def held_at_step(schedule: str, held: float) -> float:
    """Microbatches in flight across an optimizer step: a streaming stage steps right after the
    backward that completes a batch, with the others it holds at its peak still in flight; the
    other schedules step after every backward."""
    return max(held - 1, 0) if schedule.lower() in STREAMING_SCHEDULES else 0.0


def rank_memory(stages: list[StageShape], held: list[float], setup: Setup, schedule: str = "", rank: int = 0,
                ranks: int = 1, emulated: bool = False) -> dict[str, float]:
    """Per-GPU bytes of every component (`COMPONENTS`) and their peak "total", for pipeline rank
    `rank` of `ranks` running `schedule`, holding `stages` with `held[i]` microbatches in flight
    on stage i (the single-process emulation, `emulated`, sends nothing between ranks). The
    peak is the state and the transport's buffers plus the larger of two phases: forward and
    backward (activations and FSDP's buffers) and the optimizer step (its scratch, the
    activations of the microbatches in flight across it, what FSDP keeps through it and its
    sharded gradients)."""
    if rank == ranks - 1:
        setup = replace(setup, gathered_versions=0)  # see the module docstring's fsdp_buffers
    memory = dict.fromkeys(COMPONENTS, 0.0)
    for stage in stages:
        for key, value in state_bytes(stage, setup).items():
            memory[key] += value
    memory["fsdp_buffers"] = fsdp_buffer_bytes(stages, setup)
    if not emulated:
        memory["p2p_buffers"] = transport_bytes(schedule, rank, ranks, setup)
        memory["nccl_buffers"] = nccl_buffer_bytes(schedule, rank, ranks, setup)
        memory["stage_inputs"] = sum(stage_input_bytes(s, n, setup) for s, n in zip(stages, held))
    held_bytes = [microbatch_activation_bytes(s, setup) for s in stages]
    memory["activations"] = sum(n * b for n, b in zip(held, held_bytes)) + transient_activation_bytes(stages, setup)
    memory["optimizer_step"] = optimizer_step_bytes(stages, setup)
    at_step = sum(held_at_step(schedule, n) * b for n, b in zip(held, held_bytes)) + memory["optimizer_step"]
    at_step += fsdp_step_bytes(stages, setup)
    fixed = sum(memory[key] for key in (*STATE_COMPONENTS, *TRANSPORT_COMPONENTS))
    if setup.fsdp:  # see the module docstring's gradients
        fixed -= memory["gradients"]
        at_step += memory["gradients"]
    memory["total"] = fixed + max(memory["activations"] + memory["fsdp_buffers"], at_step)
    return memory


def reductions_per_step(schedule: str, microbatches: int, accumulation_steps: int = 1, accumulation: int | None = None) -> float:
    """Gradient reductions per optimizer step on a pipeline stage, with m microbatches per local
    batch and K = `accumulation_steps` local batches per step: torch's schedules finalize FSDP at
    the end of each flush, K per step (`windows_per_step`); PipeDream2BW reduces once per step;
    PACI once per local step of a = `accumulation` backwards, K m / a (a unset: K m)."""
    if schedule.lower() == "paci":
        window = window_microbatches(schedule, microbatches, accumulation_steps)
        return window / (accumulation or window)
    return windows_per_step(schedule, accumulation_steps)


def fsdp_traffic_bytes(schedule: str, stages: list[StageShape], setup: Setup, microbatches: int,
                       accumulation_steps: int = 1, accumulation: int | None = None) -> dict[str, float]:
    """Bytes one rank of a pipeline stage all-gathers, reduce-scatters and all-reduces across
    replicas per steady-state step (titan_async.parallel.fsdp_traffic counts the same). With
    n = `reductions_per_step`, P the rank's dense stage parameters (on one TP rank, `tp_local`)
    and X its experts' (1/ep of the stage's: EP splits the experts, FSDP shards each rank's over
    the f / ep ranks of its expert group), f the FSDP (shard) degree, r the replicas, c and g
    the compute and reduce dtype bytes:

        all_gather = n (P [f > 1] + X [f / ep > 1]) c, reduce_scatter the same in g bytes
        all_reduce = n (P + ep X) / f g                 (0 when r = 1)

    (a one-rank FSDP group moves nothing). Every reduction is followed by a gather: torch's
    schedules reshard at the end of each flush, PipeDream2BW gathers each version once (its
    other version stays gathered), PACI gathers again after each local step. Under PACI with
    weight prediction a stage that predicts (every stage but the last) gathers twice per forward
    instead, the predicted weights for the forward and the current ones after it
    (`pipeline.versions.PredictedAccumulation`), n_gather = 2 K m in steady state (its
    reduce-scatters stay n). The all-reduce is
    that of the reduce-scattered shard, counted as the bytes of the tensor all-reduced, as the
    runtime counts it; a ring all-reduce sends and receives 2 (r - 1) / r times that per rank.
    FSDP's padding of shards is left out. Drains for checkpoints and validation may add one
    gather of the latest 2BW version."""
    if not setup.fsdp:
        return {"all_gather": 0.0, "reduce_scatter": 0.0, "all_reduce": 0.0}
    stage_experts = sum(s.expert_params for s in stages)
    experts = stage_experts / setup.ep
    dense = _fsdp_params(stages, setup) - experts
    n = reductions_per_step(schedule, microbatches, accumulation_steps, accumulation)
    gathers = n
    if schedule.lower() == "paci" and setup.weight_prediction and not any(s.last for s in stages):
        gathers = 2 * window_microbatches(schedule, microbatches, accumulation_steps)
    sharded = dense * (setup.fsdp_degree > 1) + experts * (setup.fsdp_degree > setup.ep)
    return {
        "all_gather": gathers * sharded * setup.compute_bytes,
        "reduce_scatter": n * sharded * setup.reduce_bytes,
        "all_reduce": n * (dense + stage_experts) / setup.fsdp_degree * setup.reduce_bytes if setup.replicas > 1 else 0.0,
    }


def data_parallel_traffic_bytes(stages: list[StageShape], setup: Setup, microbatches: int) -> dict[str, float]:
    """Bytes one rank without a pipeline all-gathers, reduce-scatters and all-reduces across
    replicas per step of `microbatches` (K, gradient accumulation) forward-backward passes, with
    P, f, r, c and g as in `fsdp_traffic_bytes`: FSDP2 reshards after each forward (torchtitan's
    default without a pipeline), so every microbatch gathers the weights twice (forward and
    backward), and every backward reduces (torchtitan keeps gradient sync on while accumulating):

        all_gather = 2 K P c [f > 1], reduce_scatter = K P g [f > 1], all_reduce = K P / f g [r > 1]

    Dense models only (the advisor's layouts without a pipeline)."""
    if not setup.fsdp:
        return {"all_gather": 0.0, "reduce_scatter": 0.0, "all_reduce": 0.0}
    dense = _fsdp_params(stages, setup)
    sharded = dense * (setup.fsdp_degree > 1)
    return {
        "all_gather": 2 * microbatches * sharded * setup.compute_bytes,
        "reduce_scatter": microbatches * sharded * setup.reduce_bytes,
        "all_reduce": microbatches * dense / setup.fsdp_degree * setup.reduce_bytes if setup.replicas > 1 else 0.0,
    }


def tp_traffic_bytes(stages: list[StageShape], setup: Setup, microbatches: int) -> dict[str, float]:
    """Bytes one TP rank all-gathers and reduce-scatters per step for sequence parallelism, over
    the `microbatches` (K x m) each stage runs per step, each collective counted as its full
    (B, L, D) tensor in the compute dtype (tokens x tp x dim x c), as `fsdp_traffic_bytes` counts
    FSDP's. Per block and microbatch: the forward all-gathers the normalized input of attention
    and of the FFN and reduce-scatters their outputs (2 + 2), the backward does the reverse (2 + 2);
    recomputation repeats the forward's all-gathers (full: and reduce-scatters; selective keeps
    those). The embedding reduce-scatters its output (backward: all-gather), the last stage
    all-gathers the output head's input (backward: reduce-scatter). 0 without TP or sequence
    parallelism (its all-reduces are not counted)."""
    if setup.tp < 2 or not setup.sequence_parallel:
        return {"all_gather": 0.0, "reduce_scatter": 0.0}
    recomputed = {"full": (2, 2), "selective": (2, 0)}.get(setup.activation_checkpoint, (0, 0))
    gathers = scatters = 0
    for stage in stages:
        ends = ("tok_embeddings" in stage.modules) + stage.last
        gathers += stage.layers * (4 + recomputed[0]) + ends
        scatters += stage.layers * (4 + recomputed[1]) + ends
    tensor = setup.tokens * setup.tp * setup.dim * setup.compute_bytes * microbatches
    return {"all_gather": gathers * tensor, "reduce_scatter": scatters * tensor}


def bubble(schedule: str, stages: int, microbatches: int) -> float:
    """Predicted idle share of a step: GPipe/1F1B (p-1)/(m+p-1), Interleaved1F1B with v = 2
    chunks (p-1)/(v m+p-1), the streaming schedules 0 in steady state."""
    if stages <= 1 or schedule.lower() in STREAMING_SCHEDULES:
        return 0.0
    chunks = INTERLEAVED_CHUNKS if schedule.lower() == "interleaved1f1b" else 1
    return (stages - 1) / (chunks * microbatches + stages - 1)


def windows_per_step(schedule: str, accumulation_steps: int = 1) -> int:
    """Flushes of a synchronous schedule per optimizer step, one per accumulated local batch, K
    (torchtitan's `train_step` runs `pp_schedule.step()` once per local batch); 1 for a
    streaming schedule, whose step is one window of the stream."""
    return 1 if schedule.lower() in STREAMING_SCHEDULES else accumulation_steps


def window_microbatches(schedule: str, microbatches: int, accumulation_steps: int = 1) -> int:
    """Microbatches of one flush or window: K m / `windows_per_step`, so a streaming window holds
    the K m microbatches of the step and a synchronous flush the m of one local batch."""
    return microbatches * accumulation_steps // windows_per_step(schedule, accumulation_steps)


def compare_schedules(stages: int, microbatches: int, accumulation_steps: int = 1, ranks: int = 0) -> list[dict[str, float | str]]:
    """Bubble (of each flush or window, `window_microbatches`) and throughput relative to 1F1B's
    formula, (1 - bubble) / (1 - bubble_1F1B), per schedule, with a note where `train` would
    refuse it on `ranks` pipeline ranks (torch's conditions, `split.check_microbatches`, on the
    schedule's default stages, `split.schedule_stages`; `ranks` default: `stages`) or where
    PipeDream2BW's gradients are delayed by more than one step
    (fewer microbatches than stages: d = ceil((p - 1) / m), whose staleness cost the bubble
    leaves out)."""
    baseline = 1 - bubble("1F1B", stages, microbatches)
    rows = []
    for name in COMPARED_SCHEDULES:
        mb = window_microbatches(name, microbatches, accumulation_steps)
        note = ""
        if name.lower() in STREAMING_SCHEDULES:
            delay = gradient_delay(stages, mb) if name == "PipeDream2BW" else 1
            note = f"gradient delay {delay} steps" if delay > 1 else ""
        else:
            try:
                check_microbatches(name, mb, schedule_stages(name, ranks or stages), ranks or stages)
            except ValueError:
                note = f"train refuses it: {mb} microbatches per flush for {stages} stages"
        rows.append({"name": name, "window": mb, "bubble": bubble(name, stages, mb),
                     "relative_throughput": (1 - bubble(name, stages, mb)) / baseline, "note": note})
    return rows


def gib(value: float) -> float:
    return value / 2**30


def active_params(stage: StageShape, setup: Setup) -> float:
    """Parameters a token computes with on `stage`: all but the MoE experts, and top_k / E of those."""
    if not setup.num_experts:
        return float(stage.params)
    return stage.params - stage.expert_params * (1 - setup.top_k / setup.num_experts)


def expert_newton_schulz(stages: list[StageShape], setup: Setup) -> dict[str, object]:
    """Muon's Newton-Schulz work on the expert matrices of a rank's `stages`: each expert's matrix
    is orthogonalised on its own, all blocks of one shape in one batched iteration. "stacks": per
    block shape (rows x cols as the parameter holds it), the expert matrices of that shape and the
    FLOPs of one; "busiest_owner_flops": the FLOPs of the rank of the Muon group that owns the
    most (whole expert tensors and other matrices alike, owners balanced by FLOPs), summed over
    the rank's stages."""
    dtype = getattr(torch, setup.ns_dtype)
    counts: dict[tuple[int, int], int] = {}
    for stage in stages:
        for matrix in stage.muon_matrices:
            if len(matrix.shape) == 3:
                for block in matrix.blocks:
                    counts[block] = counts.get(block, 0) + 1
    busiest = 0
    for stage in stages:
        owned = _owned_matrices(stage, setup)
        busiest += max((sum(flops(b, setup.ns_steps, dtype) for m in mine for b in m.blocks) for mine in owned), default=0)
    stacks = [{"rows": rows, "cols": cols, "matrices": n, "flops_each": flops((rows, cols), setup.ns_steps, dtype)}
              for (rows, cols), n in counts.items()]
    return {"stacks": stacks, "busiest_owner_flops": busiest}
