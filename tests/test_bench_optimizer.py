"""tools/bench_optimizer.py: the Newton-Schulz comparison on the debug model's shapes, the 10B
projection and the per-stage cost model under it (no timing is checked)."""

from __future__ import annotations

import importlib.util
import re

import torch
import torch.nn as nn

from conftest import CONFIGS, REPO
from titan_async.optim.blocks import WholeMatrix
from titan_async.optim.muon_cost import stage_costs
from titan_async.optim.newton_schulz import flops
from titan_async.optim.routing import Route

_SPEC = importlib.util.spec_from_file_location("bench_optimizer", REPO / "tools" / "bench_optimizer.py")
bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench)


def test_newton_schulz_mode_prints_every_method_and_its_differences(capsys):
    bench.main(["--newton-schulz", "--config", str(CONFIGS / "debug_cpu.toml"), "--reps", "1"])
    out = capsys.readouterr().out
    assert "4 x (256, 256), 2 x (768, 256), 1 x (256, 768)" in out
    for name in bench.NEWTON_SCHULZ_METHODS:
        row = next(line for line in out.splitlines() if line.startswith(name))
        gaussian, ill_conditioned = (float(x) for x in row.split()[-2:])
        assert gaussian < 1e-5 and ill_conditioned < 1e-3, row


def test_projection_covers_every_stage_of_the_10b_config(capsys):
    args = bench.argparse.Namespace(
        config=CONFIGS / "10b_2bw_muon.toml", nodes=8, gpus_per_node=8,
        ns_tflops=600.0, ns_tflops_float32=47.0, train_tflops=464.0, link_gbs=300.0,
    )
    bench.projection(args)
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if re.match(r"\s+\d+\s", line)]
    assert [int(row[0]) for row in rows] == list(range(8))
    assert sum(int(row[1]) for row in rows) == 40
    share = re.search(r"largest stage\): ([\d.]+)% with bfloat16 Newton-Schulz, ([\d.]+)% with float32", out)
    assert share and 0 < float(share.group(1)) < float(share.group(2)) < 100


def route(name: str, shape: tuple[int, ...], optimizer: str = "muon", reason: str = "hidden matrix") -> Route:
    return Route(name, nn.Parameter(torch.empty(shape, device="meta")), optimizer, reason, WholeMatrix())


def test_stage_costs_by_hand():
    routes = [
        route("tok_embeddings.weight", (100, 8), "adamw", "embedding"),
        route("layers.0.a.weight", (16, 8)),
        route("layers.0.b.weight", (8, 8)),
        route("layers.0.norm.weight", (8,), "adamw", "not a matrix"),
        route("layers.1.a.weight", (7, 8)),
        route("lm_head.weight", (100, 8), "adamw", "output head"),
    ]
    first, second = stage_costs(
        routes, [["tok_embeddings", "layers.0"], ["layers.1", "norm", "lm_head"]],
        fsdp=2, ns_steps=5, ns_dtype=torch.bfloat16, state_bytes=4, tokens=10, seq_len=5, dim=8,
    )
    # stage 0: (16, 8) to rank 0, (8, 8) to rank 1; rank 0 receives the other half of (16, 8)
    # (8 rows x 8) and its own half of (8, 8) (4 rows x 8)
    assert (first.layers, first.matrices) == (1, 2)
    assert first.newton_schulz_flops == flops((16, 8), 5, torch.bfloat16)
    assert first.received_bytes == (8 * 8 + 4 * 8) * 4
    assert first.training_flops == 6 * (16 * 8 + 8 * 8) * 10 + 6 * 1 * 10 * 5 * 8
    # stage 1: (7, 8) in chunks of 4 rows; the head counts in the training FLOPs only
    assert (second.matrices, second.received_bytes) == (1, 4 * 8 * 4)
    assert second.training_flops == 6 * (7 * 8 + 100 * 8) * 10 + 6 * 1 * 10 * 5 * 8
