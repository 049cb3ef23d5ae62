"""Muon's work per pipeline stage: what the busiest rank of the stage's FSDP group computes and moves."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from titan_async.optim.full_matrix import assign_owners
from titan_async.optim.newton_schulz import flops
from titan_async.optim.routing import Route


@dataclass(frozen=True)
class StageCost:
    """One pipeline stage's Muon step on its busiest FSDP rank, against its training FLOPs per rank."""

    stage: int
    layers: int
    matrices: int
    """Muon matrices of the stage (a fused QKV weight counts once)."""
    newton_schulz_flops: int
    """FLOPs of the orthogonalisations the busiest rank owns (owners balanced by FLOPs)."""
    received_bytes: int
    """What that rank receives in Muon's two all-to-alls: the other shards of the matrices it
    owns, then its own rows of the other ranks' results."""
    training_flops: int
    """Forward and backward FLOPs of the stage per FSDP rank per step: 6 x matmul weights x
    tokens, plus causal attention, 6 x layers x tokens x seq_len x dim."""


def module_of(name: str) -> str:
    """The stage-list entry a parameter belongs to: `layers.N` or its top-level module."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" else parts[0]


def stage_costs(
    routes: list[Route],
    stage_modules: list[list[str]],
    *,
    fsdp: int,
    ns_steps: int,
    ns_dtype: torch.dtype,
    state_bytes: int,
    tokens: int,
    seq_len: int,
    dim: int,
) -> list[StageCost]:
    """A `StageCost` per stage of `stage_modules` for the whole model's `routes`.

    `tokens` is tokens per FSDP rank per step; `ns_dtype` the iteration dtype (it picks the form,
    see `flops`); `state_bytes` the size of one momentum element (what Muon's all-to-alls carry).
    """
    costs = []
    for index, modules in enumerate(stage_modules):
        mine = [r for r in routes if module_of(r.name) in modules]
        muon = [r for r in mine if r.optimizer == "muon"]
        ns = [sum(flops(shape, ns_steps, ns_dtype) for shape in r.blocks.shapes(tuple(r.param.shape))) for r in muon]
        owners = assign_owners(ns, fsdp)
        loads = [sum(f for f, o in zip(ns, owners) if o == rank) for rank in range(fsdp)]
        busiest = loads.index(max(loads)) if loads else 0
        received = 0
        for route, owner in zip(muon, owners):
            rows, *rest = route.param.shape  # FSDP shards dim 0: rows, or the experts of a 3-D stack
            shard = math.ceil(rows / fsdp) * math.prod(rest)
            received += shard * (fsdp - 1) if owner == busiest else shard
        matmul = sum(r.param.numel() for r in mine if r.param.ndim == 2 and r.reason != "embedding")
        layers = sum(m.startswith("layers.") for m in modules)
        costs.append(
            StageCost(
                stage=index,
                layers=layers,
                matrices=len(muon),
                newton_schulz_flops=max(loads, default=0),
                received_bytes=received * state_bytes,
                training_flops=6 * matmul * tokens + 6 * layers * tokens * seq_len * dim,
            )
        )
    return costs
