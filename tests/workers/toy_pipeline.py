"""A toy streaming pipeline built from titan_async's executor, stream, transport and weight policies.

`toy_pipeline.py pipeline SCHEDULE OPTIMIZER ACCUMULATION VARIANT CHECKPOINTING OUT` under
torchrun (gloo): one stage per rank over the point-to-point transport. VARIANT "stale" applies
2BW's update to the stale version (W[k+1] = W[k-1] - Opt(g)), a wrong rule the references must
reject. CHECKPOINTING "full" wraps each block of the stage in torchtitan's full activation
checkpointing, as the trainer does (`activation_checkpoint.mode = "full"`); "none" does not.

`toy_pipeline.py emulate SCHEDULE OPTIMIZER ACCUMULATION STAGES DEVICE FSDP OUT` in one process:
every stage here (the single-process emulation), each layer and stage under FSDP2 on a
one-rank mesh (NCCL on CUDA), so version switches and local steps write FSDP shards. FSDP
"reshard": FSDP reshards after every forward and backward and reduces every backward (as
configured); "hold": the stages hold their units gathered and reduce once per update, as
the stages of a real pipeline do (`FsdpStage.hold_gathered`), so 2BW keeps both versions
gathered.

Both train the toy problem's batches (tests/toy_problem.py), drain after its DRAIN_AFTER
windows and at the end, evaluate after each drain, and write OUT/stage<S>.pt: the stage's weights
after every update and (last stage) the evaluation losses.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torchtitan.distributed.activation_checkpoint import FullAC

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import toy_problem as toy  # noqa: E402

from titan_async.core import comm_log, streams  # noqa: E402
from titan_async.pipeline.executor import Microbatch, StageExecutor  # noqa: E402
from titan_async.pipeline.stream import StreamEngine  # noqa: E402
from titan_async.pipeline.trace import Timeline  # noqa: E402
from titan_async.pipeline.transport import LocalTransport, P2PTransport, edge_groups  # noqa: E402
from titan_async.pipeline.versions import OneStepDelay, TwoVersions, make_policy, preserved_versions  # noqa: E402

M = toy.M


class ToyStage(torch.nn.Module):
    """Blocks of Linear + tanh with the problem's initial weights of `stage`, held in `layers`
    as torchtitan's models hold their transformer blocks (its activation checkpointing wraps each)."""

    def __init__(self, stage: int) -> None:
        super().__init__()
        blocks = []
        for weight, bias in toy.initial_stage(stage):
            linear = torch.nn.Linear(toy.DIM, toy.DIM, dtype=torch.float64)
            with torch.no_grad():
                linear.weight.copy_(weight)
                linear.bias.copy_(bias)
            blocks.append(torch.nn.Sequential(linear, torch.nn.Tanh()))
        self.layers = torch.nn.Sequential(*blocks)

    def forward(self, x):
        return self.layers(x)


def checkpointed(module: torch.nn.Module, checkpointing: str) -> torch.nn.Module:
    """`module` with each block under torchtitan's full activation checkpointing when
    `checkpointing` is "full" (as the trainer applies it), unchanged when "none"."""
    if checkpointing == "full":
        FullAC.Config().build().apply(module)
    elif checkpointing != "none":
        raise ValueError(f"unknown checkpointing {checkpointing!r}")
    return module


def stale_apply_update(self, batch, optimizer_step):
    self.updates += 1
    self.active = -1
    self.activate(batch)
    with preserved_versions(self.params):
        optimizer_step()
    self.active = batch % 2


def build_stage(stage: int, stages: int, module: torch.nn.Module, schedule: str, optimizer_name: str, accumulation: int, transport,
                hold_gathered: bool = False):
    """(executor, optimizer step, recorded updates) of one stage."""
    params = list(module.parameters())
    optimizer = toy.optimizer(optimizer_name, params)
    updates = []

    def optimizer_step():
        optimizer.step()
        optimizer.zero_grad()
        updates.append([(t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone() for t in params])

    policy = make_policy(schedule, module, M, accumulation, hold_gathered)
    executor = StageExecutor(module, stage, stages, transport, policy, lambda out, target: toy.loss(out, target, M), Timeline(stage, False))
    return executor, optimizer_step, updates


def train(executors, steps, stages: int, device: torch.device) -> list[list[float]]:
    """Windows, drains and evaluations; returns the last stage's evaluation losses."""
    engine = StreamEngine(executors, stages, M, steps)

    def batch(ids):
        return [Microbatch(args=(x.to(device),), kwargs={}, target=y.to(device)) for x, y in map(toy.microbatch, ids)]

    evaluations = []
    for t in range(toy.WINDOWS):
        engine.run_window(t, batch(range(t * M, t * M + M)), {})
        if t in toy.drains():
            engine.drain()
            for executor in executors:
                if isinstance(executor.policy, OneStepDelay):
                    executor.policy.activate(t + 2)
                ids = toy.evaluation_ids(t)
                losses = executor.evaluate(batch(ids), {}, ids[0])
                if executor.is_last:
                    evaluations.append([float(loss) * M for loss in losses])
    return evaluations


def pipeline(schedule: str, optimizer_name: str, accumulation: int, variant: str, checkpointing: str, out: Path) -> None:
    comm_log.install_from_environment()
    streams.enable_model_from_environment()
    dist.init_process_group("gloo")
    stage, stages, device = dist.get_rank(), dist.get_world_size(), torch.device("cpu")
    if variant == "stale":
        TwoVersions.apply_update = stale_apply_update
    transport = P2PTransport(edge_groups(dist.group.WORLD, {s: s for s in range(stages)}, device), stage, stages, device)
    executor, step, updates = build_stage(stage, stages, checkpointed(ToyStage(stage), checkpointing), schedule, optimizer_name, accumulation, transport)
    evaluations = train([executor], {stage: step}, stages, device)
    torch.save({"updates": updates, "evaluations": evaluations}, out / f"stage{stage}.pt")
    dist.destroy_process_group()


def emulate(schedule: str, optimizer_name: str, accumulation: int, stages: int, device: torch.device, fsdp: str, out: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if device.type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    mesh = init_device_mesh(device.type, (1,))
    mailbox, built = {}, []
    for stage in range(stages):
        module = ToyStage(stage).to(device)
        for linear in [m for m in module.modules() if isinstance(m, torch.nn.Linear)]:
            fully_shard(linear, mesh=mesh, reshard_after_forward=True)
        fully_shard(module, mesh=mesh, reshard_after_forward=True)
        transport = LocalTransport(mailbox, stage)
        built.append(build_stage(stage, stages, module, schedule, optimizer_name, accumulation, transport, fsdp == "hold"))
    evaluations = train([b[0] for b in built], {s: b[1] for s, b in enumerate(built)}, stages, device)
    for stage, (_, _, updates) in enumerate(built):
        torch.save({"updates": updates, "evaluations": evaluations if stage == stages - 1 else []}, out / f"stage{stage}.pt")
    dist.destroy_process_group()


def main() -> None:
    torch.set_num_threads(1)
    mode, schedule, optimizer_name, accumulation, *rest = sys.argv[1:]
    out = Path(rest[-1])
    out.mkdir(parents=True, exist_ok=True)
    if mode == "pipeline":
        pipeline(schedule, optimizer_name, int(accumulation), rest[0], rest[1], out)
    else:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        emulate(schedule, optimizer_name, int(accumulation), int(rest[0]), torch.device(rest[1]), rest[2], out)


if __name__ == "__main__":
    main()
