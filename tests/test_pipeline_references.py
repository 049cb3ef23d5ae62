"""The streaming schedules against hand-written references, on real multi-process pipelines.

A toy model (Linear + tanh stages, float64) is trained by titan_async's executor, stream and
transport on 2 and 4 gloo processes. The references below import nothing from titan_async:
- PipeDream-2BW: the loop W[k+1] = W[k] - Opt(grad f_k(W[k-1])), W[-1] = W[0], on the whole model;
- PACI: a per-stage simulation of its rule, with the backward written out by hand (stage s
  holds at most p-1-s microbatches in flight, steps after every `a` local backwards, and a
  backward multiplies by the weights current at that moment);
- PACI under full activation checkpointing (its authors' "mem" mode): the same simulation, but
  each block's backward first recomputes the block's output from the input its forward stored,
  with the current weights, so it is the block's gradient at the weights current at the backward.
Every update of every stage and every evaluation must agree to 1e-6 relative. A 2BW variant
that applies the update to the stale version must fail. Each run's communication log is also
replayed in the NCCL model (tests/nccl_model.py).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections import deque
from pathlib import Path

import pytest
import torch

import nccl_model
import toy_problem as toy

WORKER = Path(__file__).parent / "workers" / "toy_pipeline.py"
M, WINDOWS = toy.M, toy.WINDOWS


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_pipeline(tmp_path: Path, schedule: str, stages: int, optimizer: str, accumulation: int = M, variant: str = "exact",
                 checkpointing: str = "none"):
    """Train the toy pipeline on `stages` processes, its blocks under activation `checkpointing`
    ("none" or "full"), `M` microbatches per window (this module's, which a test may patch);
    returns (stage -> {"updates", "evaluations"}, communication logs)."""
    out, comm = tmp_path / "out", tmp_path / "comm"
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={stages}", f"--master-port={free_port()}"]
    run_worker([*launcher, str(WORKER), "pipeline", schedule, optimizer, str(accumulation), variant, checkpointing, str(out)],
               {"TITAN_ASYNC_COMM_LOG": str(comm), "TITAN_ASYNC_STREAM_MODEL": "1", "TOY_MICROBATCHES": str(M)})
    return {s: torch.load(out / f"stage{s}.pt") for s in range(stages)}, comm


def run_emulation(tmp_path: Path, schedule: str, stages: int, optimizer: str, accumulation: int, device: str, fsdp: str):
    """Train every stage of the toy pipeline in one process under one-rank FSDP2 on `device`
    ("reshard" or "hold": the worker's FSDP modes)."""
    out = tmp_path / "out"
    run_worker([sys.executable, str(WORKER), "emulate", schedule, optimizer, str(accumulation), str(stages), device, fsdp, str(out)],
               {"MASTER_PORT": str(free_port())})
    return {s: torch.load(out / f"stage{s}.pt") for s in range(stages)}


def run_worker(command: list[str], env: dict[str, str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1", **env})
    assert result.returncode == 0, result.stderr[-4000:]


# --- PipeDream-2BW: the delayed-gradient loop -------------------------------------------------

def forward_full(weights: list[list[tuple[torch.Tensor, torch.Tensor]]], x: torch.Tensor) -> torch.Tensor:
    for stage in weights:
        for weight, bias in stage:
            x = torch.tanh(x @ weight.T + bias)
    return x


def two_bw_reference(stages: int, optimizer_name: str) -> tuple[list[list[list[torch.Tensor]]], list[list[float]]]:
    """W[k+1] = W[k] - Opt(grad f_k(W[k-1])); returns each stage's flat weights after every step, and evaluations."""
    current = [[t.clone() for layer in toy.initial_stage(s) for t in layer] for s in range(stages)]
    previous = [[t.clone() for t in stage] for stage in current]
    params = [t.requires_grad_(True) for stage in current for t in stage]
    optimizer = toy.optimizer(optimizer_name, params)
    history, evaluations = [], []
    for step in range(WINDOWS):
        stale = [[t.detach().clone().requires_grad_(True) for t in stage] for stage in previous]
        layered = [list(zip(stage[0::2], stage[1::2])) for stage in stale]
        total = sum(toy.loss(forward_full(layered, x), y, M) for x, y in map(toy.microbatch, range(step * M, step * M + M)))
        grads = torch.autograd.grad(total, [t for stage in stale for t in stage])
        previous = [[t.detach().clone() for t in stage] for stage in current]
        for param, grad in zip(params, grads):
            param.grad = grad
        optimizer.step()
        history.append([[t.detach().clone() for t in stage] for stage in current])
        if step in toy.drains():
            evaluations.append(evaluate([[(w.detach(), b.detach()) for w, b in zip(stage[0::2], stage[1::2])] for stage in current], step))
    return [[h[s] for h in history] for s in range(stages)], evaluations


def evaluate(weights, step: int) -> list[float]:
    return [float(((forward_full(weights, x) - y) ** 2).mean()) for x, y in map(toy.microbatch, toy.evaluation_ids(step))]


# --- PACI: a per-stage simulation with a hand-written backward ---------------------------------

def stage_actions(stage: int, stages: int) -> list[tuple[str, int]]:
    """At most p-1-s microbatches in flight: a backward as soon as one more is held; drains empty the stage."""
    in_flight, actions = deque(), []
    for t in range(WINDOWS):
        for k in range(t * M, t * M + M):
            actions.append(("F", k))
            in_flight.append(k)
            if len(in_flight) > stages - 1 - stage:
                actions.append(("B", in_flight.popleft()))
        if t in toy.drains():
            actions += [("B", in_flight.popleft()) for _ in range(len(in_flight))]
            actions.append(("E", t))
    return actions


def paci_reference(stages: int, optimizer_name: str, accumulation: int, backward: str = "saved"):
    """Each stage's flat weights after every local step, and the evaluations after drains.

    `backward` says what a block's (the toy's Linear + tanh layer's) backward uses:
    - "saved": the activations its forward saved and the weights current at the backward (PACI);
    - "recomputed": its output recomputed from the input its forward stored, with the current
      weights, and those weights (PACI under full activation checkpointing, the "mem" mode);
    - "stashed": the activations and weights of its forward (weight stashing), a different rule
      which the pipeline must not match."""
    weights = [[t.clone() for layer in toy.initial_stage(s) for t in layer] for s in range(stages)]
    grads = [[torch.zeros_like(t) for t in stage] for stage in weights]
    optimizers = [toy.optimizer(optimizer_name, stage) for stage in weights]
    counts, history, evaluations = [0] * stages, [[] for _ in range(stages)], []
    activations, gradients, saved = {}, {}, {}
    queues = [deque(stage_actions(s, stages)) for s in range(stages)]
    while any(queues):
        before = sum(map(len, queues))
        for s in range(stages):
            if not queues[s]:
                continue
            kind, k = queues[s][0]
            if kind == "F" and (s == 0 or (s, k) in activations):
                x = toy.microbatch(k)[0] if s == 0 else activations.pop((s, k))
                saved[(s, k)] = []
                for weight, bias in zip(weights[s][0::2], weights[s][1::2]):
                    y = torch.tanh(x @ weight.T + bias)
                    saved[(s, k)].append((x, y, weight.clone()))
                    x = y
                if s == stages - 1:
                    gradients[(s, k)] = 2 * (x - toy.microbatch(k)[1]) / (x.numel() * M)
                else:
                    activations[(s + 1, k)] = x
            elif kind == "B" and (s, k) in gradients:
                g = gradients.pop((s, k))
                for layer in reversed(range(len(saved[(s, k)]))):
                    x, y, forward_weight = saved[(s, k)][layer]
                    weight, bias = weights[s][2 * layer], weights[s][2 * layer + 1]
                    if backward == "recomputed":
                        y = torch.tanh(x @ weight.T + bias)
                    gz = g * (1 - y * y)
                    grads[s][2 * layer] += gz.T @ x
                    grads[s][2 * layer + 1] += gz.sum(0)
                    g = gz @ (forward_weight if backward == "stashed" else weight)
                del saved[(s, k)]
                if s > 0:
                    gradients[(s - 1, k)] = g
                counts[s] += 1
                if counts[s] % accumulation == 0:
                    for param, grad in zip(weights[s], grads[s]):
                        param.grad = grad.clone()
                        grad.zero_()
                    optimizers[s].step()
                    history[s].append([t.clone() for t in weights[s]])
            elif kind == "E" and all(not q or q[0] == ("E", k) for q in queues):
                evaluations.append(evaluate([list(zip(stage[0::2], stage[1::2])) for stage in weights], k))
                for q in queues:
                    q.popleft()
                continue
            else:
                continue
            queues[s].popleft()
        assert sum(map(len, queues)) < before, "reference stalled"
    return history, evaluations


# --- comparison --------------------------------------------------------------------------------

def mismatch(pipelined, reference_history, reference_evaluations) -> float:
    """Largest relative difference over every update of every stage and every evaluation."""
    worst = 0.0
    for stage, result in pipelined.items():
        assert len(result["updates"]) == len(reference_history[stage]), stage
        for ours, theirs in zip(result["updates"], reference_history[stage]):
            for a, b in zip(ours, theirs):
                worst = max(worst, float((a - b).norm() / b.norm()))
    evaluations = pipelined[len(pipelined) - 1]["evaluations"]
    assert len(evaluations) == len(reference_evaluations)
    for ours, theirs in zip(evaluations, reference_evaluations):
        worst = max(worst, max(abs(a - b) / abs(b) for a, b in zip(ours, theirs)))
    return worst


@pytest.mark.parametrize("stages, optimizer", [(2, "sgd"), (4, "adamw")])
def test_2bw_pipeline_follows_the_delayed_gradient_rule(tmp_path, stages, optimizer):
    pipelined, comm = run_pipeline(tmp_path, "PipeDream2BW", stages, optimizer)
    assert mismatch(pipelined, *two_bw_reference(stages, optimizer)) < 1e-6
    nccl_model.assert_nccl_safe(comm, stages)


def test_2bw_rule_rejects_an_update_of_the_stale_version(tmp_path):
    pipelined, _ = run_pipeline(tmp_path, "PipeDream2BW", 2, "sgd", variant="stale")
    assert mismatch(pipelined, *two_bw_reference(2, "sgd")) > 1e-3


@pytest.mark.parametrize("stages, optimizer, accumulation", [(2, "adamw", M), (4, "sgd", 2)])
def test_paci_pipeline_follows_its_per_stage_rule(tmp_path, stages, optimizer, accumulation):
    pipelined, comm = run_pipeline(tmp_path, "PACI", stages, optimizer, accumulation)
    assert mismatch(pipelined, *paci_reference(stages, optimizer, accumulation)) < 1e-6
    assert mismatch(pipelined, *paci_reference(stages, optimizer, accumulation, backward="stashed")) > 1e-4
    nccl_model.assert_nccl_safe(comm, stages)


@pytest.mark.parametrize("microbatches", [1, 2])
def test_paci_with_fewer_microbatches_than_stages_follows_its_per_stage_rule(tmp_path, monkeypatch, microbatches):
    """p = 4 with m = a = 1 and m = a = 2: a microbatch of stage 0 crosses up to ceil(3 / a)
    local steps of its stage between forward and backward (3 and 2), and its gradients reach
    back several windows."""
    monkeypatch.setattr(sys.modules[__name__], "M", microbatches)
    pipelined, comm = run_pipeline(tmp_path, "PACI", 4, "sgd", microbatches)
    assert mismatch(pipelined, *paci_reference(4, "sgd", microbatches)) < 1e-6
    assert mismatch(pipelined, *paci_reference(4, "sgd", microbatches, backward="stashed")) > 1e-4
    nccl_model.assert_nccl_safe(comm, 4)


def test_paci_under_full_activation_checkpointing_follows_the_recomputed_rule(tmp_path):
    """Recomputing a block in the backward uses the weights current then, not the forward's."""
    pipelined, comm = run_pipeline(tmp_path, "PACI", 2, "adamw", 2, checkpointing="full")
    assert mismatch(pipelined, *paci_reference(2, "adamw", 2, backward="recomputed")) < 1e-6
    assert mismatch(pipelined, *paci_reference(2, "adamw", 2)) > 1e-4
    nccl_model.assert_nccl_safe(comm, 2)


def test_2bw_under_full_activation_checkpointing_follows_the_delayed_gradient_rule(tmp_path):
    """2BW switches to the forward's version before the backward, so recomputation changes nothing."""
    pipelined, _ = run_pipeline(tmp_path, "PipeDream2BW", 2, "sgd", checkpointing="full")
    assert mismatch(pipelined, *two_bw_reference(2, "sgd")) < 1e-6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fsdp", ["reshard", "hold"])
@pytest.mark.parametrize("schedule", ["PipeDream2BW", "PACI"])
def test_emulation_under_fsdp_on_cuda_follows_the_rules(tmp_path, schedule, fsdp):
    """Version switches and local steps write FSDP2 shards between a forward and a backward, on
    CUDA with NCCL (on CPU, with a model of FSDP's all-gather streams: tests/test_fsdp_write_order.py).
    Held gathered, 2BW switches between two gathered versions and gradients are reduced once per update."""
    emulated = run_emulation(tmp_path, schedule, 4, "adamw", 2, "cuda", fsdp)
    reference = two_bw_reference(4, "adamw") if schedule == "PipeDream2BW" else paci_reference(4, "adamw", 2)
    assert mismatch(emulated, *reference) < 1e-6
