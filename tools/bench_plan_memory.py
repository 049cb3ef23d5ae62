"""`titan-async plan`'s memory per pipeline rank against the peak a short CPU run measures.

    python tools/bench_plan_memory.py --config debug_cpu_pp2_2bw --nproc 2 --set training.steps=3

Trains the config (checkpoints, validation and TensorBoard off) on `--nproc` local processes
and prints, per rank, the plan's peak for its pipeline rank as CPU processes (no NCCL buffers,
Newton-Schulz in its CPU dtype), the measured peak and their ratio; `--json` prints the same
with the plan's components, as one object.

Measured: the bytes of CPU tensor storages alive in each training process, at their peak. A
`TorchDispatchMode`, entered before the trainer is built, sees every tensor an operator returns
(model and optimizer state, forward, backward, optimizer steps, collectives, the pipeline
transport's buffers); each storage is counted once, and a weak reference to it takes its bytes
off when it is freed. `UntypedStorage.resize_`, which FSDP2 uses to free and re-allocate its
unsharded parameters and which no operator dispatches, is patched to count too. This counts
what the memory model describes, tensors, independently of it; the process's resident memory
(what `memory_gib` of pipeline/stage<s>.jsonl reports on CPU) is mostly the libraries' code and
heaps.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import weakref
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MEASURED_FILE = "live_tensor_peak_rank{rank}.json"
QUIET = ["checkpoint.enable=false", "validation.enable=false", "metrics.enable_tensorboard=false"]


def live_tensor_tracker():
    """A TorchDispatchMode counting the bytes of live CPU tensor storages (`current`, `peak`)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class LiveTensorBytes(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.sizes: dict[int, int] = {}
            self.refs: dict[int, weakref.ref] = {}
            self.current = self.peak = 0
            self.original_resize = torch.UntypedStorage.resize_

        def _count(self, storage: torch.UntypedStorage) -> None:
            key = storage._cdata
            if key not in self.sizes:
                self.sizes[key] = 0
                self.refs[key] = weakref.ref(storage, lambda _, key=key: self._forget(key))
            self._resize(key, storage.nbytes())

        def _resize(self, key: int, nbytes: int) -> None:
            self.current += nbytes - self.sizes[key]
            self.sizes[key] = nbytes
            self.peak = max(self.peak, self.current)

        def _forget(self, key: int) -> None:
            self.current -= self.sizes.pop(key, 0)
            self.refs.pop(key, None)

        def _track(self, tensor: torch.Tensor) -> None:
            if type(tensor) is not torch.Tensor and hasattr(tensor, "__tensor_flatten__"):  # DTensor: its local tensor
                names, _ = tensor.__tensor_flatten__()
                for name in names:
                    if isinstance(inner := getattr(tensor, name), torch.Tensor):
                        self._track(inner)
            elif tensor.device.type == "cpu":
                self._count(tensor.untyped_storage())

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for leaf in tree_leaves(out):
                if isinstance(leaf, torch.Tensor):
                    self._track(leaf)
            return out

        def __enter__(self):
            tracker = self

            def resize_(storage, size):
                result = tracker.original_resize(storage, size)
                if storage.device.type == "cpu":
                    tracker._count(storage)
                return result

            torch.UntypedStorage.resize_ = resize_
            return super().__enter__()

        def __exit__(self, *exc):
            torch.UntypedStorage.resize_ = self.original_resize
            return super().__exit__(*exc)

    return LiveTensorBytes()


def worker(run_dir: Path) -> int:
    """One training process of the run in `run_dir`, measured; its peak goes to run_dir/pipeline/."""
    from titan_async.core import platform

    platform.configure()
    from titan_async.run import worker as training

    rank = int(os.environ.get("RANK", "0"))
    tracker = live_tensor_tracker()
    with tracker:
        status = training.train(run_dir)
    folder = run_dir / "pipeline"
    folder.mkdir(exist_ok=True)
    (folder / MEASURED_FILE.format(rank=rank)).write_text(json.dumps({"rank": rank, "peak_bytes": tracker.peak}))
    return status


def train_measured(run, nproc: int, run_dir: Path) -> dict[int, int]:
    """Train `run` on `nproc` local processes into `run_dir`; rank -> measured peak bytes."""
    from titan_async.config.run_config import render_toml
    from titan_async.rundir import directory as runs

    run_dir.mkdir(parents=True, exist_ok=True)
    runs.save_launch(run_dir, render_toml(run), nproc)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               __file__, "--worker", str(run_dir)]
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    result = subprocess.run(command, cwd=REPO, env={**os.environ, "PYTHONPATH": path}, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"training failed with exit status {result.returncode}:\n{result.stderr[-4000:]}")
    files = sorted((run_dir / "pipeline").glob(MEASURED_FILE.format(rank="*")))
    return {row["rank"]: row["peak_bytes"] for row in (json.loads(f.read_text()) for f in files)}


def predicted(run, nproc: int) -> list[dict]:
    """`plan`'s rows for `run` on `nproc` CPU processes of one node."""
    from titan_async.commands.plan.command import make_plan
    from titan_async.cluster.estimate import Cluster

    return make_plan(run, Cluster.parse(1, nproc, "80GiB"), gpu=False)["ranks"]


def compare(rows: list[dict], measured: dict[int, int]) -> list[dict]:
    """Per process: its pipeline rank, the plan's peak for it, the measured peak and their ratio."""
    per_pp_rank = len(measured) // len(rows)
    result = []
    for rank, peak in sorted(measured.items()):
        memory = rows[rank // per_pp_rank]["memory"]
        result.append({"rank": rank, "pp_rank": rank // per_pp_rank, "predicted_bytes": memory["total"],
                       "measured_bytes": peak, "ratio": memory["total"] / peak, "components": memory})
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="debug_cpu_pp2_2bw", help="a TOML file or a shipped config's name")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    parser.add_argument("--nproc", type=int, default=2, help="training processes (GPUs of the plan)")
    parser.add_argument("--run-dir", type=Path, help="where to train (default: a temporary directory)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker)
    sys.path.insert(0, str(REPO))
    from titan_async.core import platform

    platform.configure()
    from titan_async.cli import _config_path
    from titan_async.config.run_config import load_run_config

    run = load_run_config(_config_path(args.config), args.set + QUIET)
    with tempfile.TemporaryDirectory() as scratch:
        measured = train_measured(run, args.nproc, args.run_dir or Path(scratch) / "run")
    rows = compare(predicted(run, args.nproc), measured)
    if args.json:
        print(json.dumps({"config": str(args.config), "ranks": rows}))
        return 0
    print(f"{'rank':>4} {'pp':>3} {'predicted MiB':>14} {'measured MiB':>13} {'ratio':>6}")
    for row in rows:
        print(f"{row['rank']:>4} {row['pp_rank']:>3} {row['predicted_bytes'] / 2**20:>14.2f} "
              f"{row['measured_bytes'] / 2**20:>13.2f} {row['ratio']:>6.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
