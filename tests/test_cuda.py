"""What only a CUDA GPU runs: FlexAttention's backward, float8 kernels, NCCL, compiled models, Muon's
bfloat16 Newton-Schulz default.

Each test is skipped on a machine without CUDA. References: dense SDPA in float64 with a
hand-written per-document causal mask; bfloat16 training of the same model on the same data;
the same trainer with plain parameters instead of FSDP2; the delayed-gradient rule of
`training.gradient_delay = 1`, also for a mixture-of-experts model.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torchtitan.models.common.attention import FlexAttention

from conftest import CONFIGS, REPO, fresh_environment, losses, metrics, sets
from test_attention import reference_mask
from test_fsdp_schedules import train as train_layout
from test_moe import MOE, expert_biases
from test_muon import muon_update
from test_schedules import EXACT, STEPS, assert_close_weights, assert_same_run, final_weights, train
from titan_async.model.llama import ModelSection, build_model_spec
from titan_async.optim.newton_schulz_batched import orthogonalize_batched

ONE_PROCESS = ("--config", str(CONFIGS / "debug_cpu.toml"), "--nproc-per-node", "1")

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (FlexAttention backward, float8, NCCL)")
FLOAT8 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="float8 matrix multiplies need a CUDA GPU of compute capability 8.9 or later",
)


def relative_error(result: torch.Tensor, reference: torch.Tensor) -> float:
    return float((result.detach().double() - reference.detach()).norm() / reference.detach().norm())


def dense_attention(q, k, v, mask):
    """float64 SDPA on (B, L, N, H) tensors, K/V heads repeated for grouped-query attention."""
    groups = q.size(2) // k.size(2)
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.repeat_interleave(groups, 2).transpose(1, 2),
        v.repeat_interleave(groups, 2).transpose(1, 2), attn_mask=mask,
    ).transpose(1, 2)
    return out, (q, k, v)


@CUDA
def test_flex_attention_matches_dense_sdpa_forward_and_backward():
    """The model's FlexAttention and block mask (documents crossing 128-token blocks) against SDPA."""
    torch.manual_seed(0)
    spec = build_model_spec(ModelSection(dim=256, n_layers=1, n_heads=4, n_kv_heads=2), tokenizer_vocab_size=256)
    flex_configs = [config for _, config, _, _ in spec.model.traverse(FlexAttention.Config)]
    assert flex_configs, "the model does not use FlexAttention on CUDA"
    documents = [[100, 200, 84], [1, 130, 17, 236]]
    positions = torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in documents]).cuda()
    with torch.device("meta"):
        model = spec.model.build()
    block_mask = model.get_attention_masks(positions)
    batch, seq_len, heads, kv_heads, head_dim = 2, 384, 4, 2, 64
    q = torch.randn(batch, seq_len, heads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(batch, seq_len, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    upstream = torch.randn(batch, seq_len, heads, head_dim, device="cuda", dtype=torch.float64)

    out = flex_configs[0].build()(q, k, v, attention_masks=block_mask, enable_gqa=True)
    (out.double() * upstream).sum().backward()
    mask = reference_mask(positions.cpu()).cuda()
    expected, leaves = dense_attention(q, k, v, mask)
    (expected * upstream).sum().backward()

    errors = {name: relative_error(t, ref) for name, t, ref in
              [("out", out, expected), *((f"d{n}", x.grad, r.grad) for n, x, r in zip("qkv", (q, k, v), leaves))]}
    assert all(error < 2e-2 for error in errors.values()), errors
    causal_only, _ = dense_attention(q, k, v, torch.ones(seq_len, seq_len, dtype=torch.bool, device="cuda").tril())
    assert relative_error(out, causal_only) > 10 * errors["out"], "documents do not change the result: the check is blind"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: ns_dtype auto is float32 elsewhere")
def test_muon_iterates_in_bfloat16_by_default_on_cuda():
    """ns_dtype "auto" on a CUDA parameter is the bfloat16 iteration, measurably not float32's."""
    torch.manual_seed(0)
    gradient = torch.randn(256, 512, device="cuda")
    update = muon_update(gradient)
    scale = 0.2 * math.sqrt(512)
    bfloat16, float32 = (orthogonalize_batched(gradient[None], 5, dtype)[0] * scale for dtype in (torch.bfloat16, torch.float32))
    assert relative_error(update, bfloat16) < 1e-6
    assert relative_error(update, float32) > 1e-4


COMPILED = ("training.steps=12", "model.dim=256", "training.seq_len=256", "training.mixed_precision_param=bfloat16",
            "compile.enable=true", "checkpoint.enable=false", "validation.enable=false", "lr_scheduler.total_steps=12")


@pytest.fixture(scope="module")
def bfloat16_compiled(tmp_path_factory):
    return train(tmp_path_factory.mktemp("bf16") / "run", *COMPILED)


@FLOAT8
def test_float8_rowwise_compiled_tracks_bfloat16(tmp_path, bfloat16_compiled):
    float8 = train(tmp_path / "fp8", *COMPILED, "model.float8=rowwise")
    log = (float8 / "logs" / "rank0.log").read_text()
    assert "Float8 training active with recipe rowwise" in log and "Swapped to Float8Linear" in log
    assert "Compiling each TransformerBlock with torch.compile" in log
    reference, result = losses(bfloat16_compiled), losses(float8)
    assert sorted(reference) == sorted(result) == list(range(1, 13))
    for step in reference:
        assert abs(result[step] - reference[step]) <= 0.02 * reference[step], (step, result[step], reference[step])
    assert result != reference
    assert result[12] < result[1] - 0.5


WITHOUT_FSDP = (
    "import sys; from titan_async.core import platform; platform.configure(); from titan_async.config import assemble; "
    "assemble.plain_parameters = lambda run, world_size: True; "
    "from titan_async.cli import main; main(sys.argv[1:])"
)
"""`titan-async` with FSDP left out of the synchronous path (as the weight-version paths do)."""


@pytest.fixture(scope="module")
def synchronous_cuda(tmp_path_factory):
    """Plain synchronous training (FSDP2 on one NCCL rank), shared by the PACI comparison."""
    return train(tmp_path_factory.mktemp("sync") / "fsdp")


@pytest.fixture(scope="module")
def emulated_2bw_cuda(tmp_path_factory):
    return train(tmp_path_factory.mktemp("2bw") / "2bw", "parallelism.pipeline_parallel_schedule=PipeDream2BW",
                 "parallelism.pipeline_parallel_microbatch_size=1", "parallelism.emulated_stages=2")


@CUDA
def test_fsdp2_on_one_nccl_rank_trains_like_plain_parameters(tmp_path, synchronous_cuda):
    sharded = synchronous_cuda
    plain = tmp_path / "plain"
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_FSDP, "train", "--config", str(CONFIGS / "debug_cpu.toml"), "--run-dir", str(plain), *sets(*EXACT)],
        capture_output=True, text=True, timeout=600, cwd=REPO, env=fresh_environment(),
    )
    assert result.returncode == 0, result.stderr[-5000:]
    assert "Applied FSDP to the model" in (sharded / "logs" / "rank0.log").read_text()
    assert "Applied FSDP to the model" not in (plain / "logs" / "rank0.log").read_text()
    assert_same_run(plain, sharded)
    assert_close_weights(final_weights(sharded), final_weights(plain))


@CUDA
def test_emulated_2bw_equals_delayed_gradient_on_cuda(tmp_path, emulated_2bw_cuda):
    delayed = train(tmp_path / "delay", "training.gradient_delay=1")
    emulated = emulated_2bw_cuda
    assert_same_run(delayed, emulated)
    assert_close_weights(final_weights(emulated), final_weights(delayed))


@CUDA
def test_emulated_2bw_moe_equals_delayed_gradient_on_cuda(tmp_path):
    """The mixture-of-experts blocks on CUDA (torch._grouped_mm in bfloat16, the token dispatch's
    device-to-host copies): 2BW's emulation with its per-stage load balancing against the delayed
    reference, expert biases included (test_moe.py's settings)."""
    reference = train_layout(tmp_path / "delay", *MOE, "training.gradient_delay=1", "training.local_batch_size=2",
                             "training.global_batch_size=8", layout=ONE_PROCESS)
    emulated = train_layout(tmp_path / "2bw", *MOE, "parallelism.pipeline_parallel_schedule=PipeDream2BW",
                            "parallelism.emulated_stages=2", layout=ONE_PROCESS)
    assert all(bias.abs().max() > 0 for bias in expert_biases(reference).values())
    assert_same_run(reference, emulated)
    assert_close_weights(final_weights(emulated), final_weights(reference))


@CUDA
def test_emulated_paci_trains_on_cuda(tmp_path, synchronous_cuda, emulated_2bw_cuda):
    """PACI emulated on 2 stages, a = m = 8, against the rules the CPU runs follow (the same
    settings as test_schedules.py's emulations; checked on CPU with the same three runs):
    step 1 is synchronous training's (initial weights, same data), and so is step 2, since the
    validation at step 1 drains the stream and applies stage 0's last local update; from step 3
    on the losses leave synchronous training's, and they are never 2BW's from step 2 on (2BW's
    step 2 still runs the initial weights). Delays: stage 0 crosses one local update in 8
    microbatches in a steady window (steps 3, 5, 6: after neither the start nor a drain),
    (p - 1 - s) / a = 1/8 at most 1; the last stage none; windows after a start or drain none."""
    run = train(tmp_path / "paci", "parallelism.pipeline_parallel_schedule=PACI",
                "parallelism.pipeline_parallel_microbatch_size=1", "parallelism.emulated_stages=2")
    paci, synchronous, delayed = losses(run), losses(synchronous_cuda), losses(emulated_2bw_cuda)
    assert sorted(paci) == sorted(synchronous) == sorted(delayed) == list(range(1, STEPS + 1))
    assert all(math.isfinite(loss) for loss in paci.values())
    assert paci[1] == pytest.approx(synchronous[1], rel=1e-5) and paci[2] == pytest.approx(synchronous[2], rel=1e-5)
    for step in range(2, STEPS + 1):
        assert paci[step] != pytest.approx(delayed[step], rel=1e-6), step
        if step >= 3:
            assert paci[step] != pytest.approx(synchronous[step], rel=1e-6), step
    steady = {"staleness/stage0": 1 / 8, "staleness_max/stage0": 1.0, "staleness/stage1": 0.0, "staleness_max/stage1": 0.0}
    rows = metrics(run)
    for step, row in rows.items():
        expected = steady if step in (3, 5, 6) else dict.fromkeys(steady, 0.0)
        assert {key: row[key] for key in steady} == pytest.approx(expected), step
    validation = metrics(run, "validation")
    assert validation[STEPS]["validation_metrics/loss"] < validation[1]["validation_metrics/loss"] - 0.05
