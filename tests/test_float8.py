"""The float8 recipe the configs ship (rowwise) is the one that runs, emulated on CPU."""

from __future__ import annotations

import torch

from titan_async.core import platform

platform.configure()

from titan_async.model.llama import ModelSection, build_model_spec  # noqa: E402

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max


def fake_quantize(t: torch.Tensor, dim: int | None) -> torch.Tensor:
    """Round `t` to float8 e4m3 with one power-of-two scale per row along `dim` (None: one for the tensor)."""
    amax = t.abs().amax(dim=dim, keepdim=True) if dim is not None else t.abs().amax()
    scale = torch.exp2(torch.floor(torch.log2(E4M3_MAX / amax)))
    return (t * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() / scale


def test_rowwise_float8_linear_matches_hand_written_rowwise_quantization():
    torch.manual_seed(0)
    spec = build_model_spec(ModelSection(dim=64, n_layers=1, n_heads=4, float8="rowwise"), tokenizer_vocab_size=256, fsdp=False)
    model = spec.model.build()
    model.init_weights(buffer_device=None)
    linear = model.layers["0"].attention.wo
    assert type(linear).__name__ == "Float8Linear"
    x = torch.randn(8, 64) * torch.logspace(-2, 2, 8).unsqueeze(1)  # rows of very different ranges
    with torch.no_grad():
        out = linear(x)
        rowwise = fake_quantize(x, -1) @ fake_quantize(linear.weight, -1).T
        tensorwise = fake_quantize(x, None) @ fake_quantize(linear.weight, None).T
    assert torch.allclose(out, rowwise, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(out[0], tensorwise[0], rtol=0.02, atol=0)  # the smallest row: one scale loses it
