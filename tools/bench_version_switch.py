"""What a PipeDream-2BW version switch moves under FSDP2: bytes copied (copy_, clone, _to_copy,
counted by a torch dispatch mode) per switch between the two versions, of the gathered
parameters on a stage that holds its units gathered (a pipeline stage) and of the shards on one
that does not (`training.gradient_delay = 1`, the single-process emulation), for the llama
model at the given sizes under FSDP2 on one gloo rank. 1.00 passes = each switched byte copied once.

    python tools/bench_version_switch.py [--dim 64] [--layers 4] [--heads 4] [--vocab 2048] [--switches 4]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from titan_async.core import platform

platform.configure()

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from titan_async.model.llama import ModelSection, build_model_spec  # noqa: E402
from titan_async.pipeline.versions import make_policy  # noqa: E402

COPIES = {"copy_", "clone", "_to_copy", "copy"}


class CopiedBytes(TorchDispatchMode):
    """Bytes written by copy ops while active."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in COPIES:
            local = out.to_local() if isinstance(out, DTensor) else out
            self.bytes += local.numel() * local.element_size()
        return out


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _model(args: argparse.Namespace, mesh) -> torch.nn.Module:
    section = ModelSection(dim=args.dim, n_layers=args.layers, n_heads=args.heads, attention="dense")
    model = build_model_spec(section, args.vocab).model.build()
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _switches(policy, count: int) -> list[int]:
    """Bytes copied by each of `count` switches between versions 0 and 1 (version 1 active)."""
    copied = []
    for batch in range(count):
        with CopiedBytes() as counter:
            policy.activate(batch % 2)
        copied.append(counter.bytes)
    return copied


def gathered_switches(args: argparse.Namespace, mesh) -> tuple[int, list[int]]:
    """(bytes of the gathered parameters, bytes copied per switch) on a stage held gathered, with
    both versions gathered as 2BW's first window leaves them (the forwards' gathers done by `unshard`)."""
    model = _model(args, mesh)
    policy = make_policy("PipeDream2BW", model, microbatches=1, accumulation=None, hold_gathered=True)
    for batch in (0, 1):
        policy.activate(batch)
        for module in policy.stage.modules:
            module.unshard()
    return _nbytes(p.unsharded_param for group in policy.stage.groups for p in group.fsdp_params), _switches(policy, args.switches)


def shard_switches(args: argparse.Namespace, mesh) -> tuple[int, list[int]]:
    """(bytes of the shards, bytes copied per switch) on a stage FSDP reshards as configured."""
    model = _model(args, mesh)
    policy = make_policy("PipeDream2BW", model, microbatches=1, accumulation=None)
    policy.copies()  # the side shard, which the first update would make
    return _nbytes(p.to_local() for p in model.parameters()), _switches(policy, args.switches)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--switches", type=int, default=4, help="switches measured per kind (default: 4)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        dist.init_process_group("gloo", init_method=f"file://{Path(folder) / 'init'}", rank=0, world_size=1)
        try:
            mesh = init_device_mesh("cpu", (1,))
            rows = {"gathered (held stage)": gathered_switches(args, mesh), "shards (FSDP resharding)": shard_switches(args, mesh)}
        finally:
            dist.destroy_process_group()
    print(f"llama dim {args.dim}, {args.layers} layers, vocab {args.vocab}, FSDP2 on 1 rank; {args.switches} switches each")
    print(f"{'switch':<26}{'switched bytes':>16}{'copied per switch':>20}{'passes':>8}")
    for name, (switched, copied) in rows.items():
        per_switch = max(copied)
        print(f"{name:<26}{switched:>16,}{per_switch:>20,}{per_switch / switched:>8.2f}")


if __name__ == "__main__":
    main()
