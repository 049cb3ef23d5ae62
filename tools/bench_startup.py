"""How long `titan-async` takes to answer commands that train nothing: --help, --version, an
argument error and a config error (of `config show` and of `train`), and the whole of a
2-process pipeline run of 4 tiny steps (start-up, launch of the workers, shut-down), in a fresh
interpreter each time, min/median/max over repetitions; with --baseline REV, the same commands
of git revision REV (a temporary worktree), alternated with this checkout's in the same
invocation, and the ratio of the medians.

    python tools/bench_startup.py [--reps 5] [--baseline REV]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FRESH_RUN_DIR = "<a new run directory>"
COMMANDS = {
    "--help": ["--help"],
    "--version": ["--version"],
    "argument error": ["train", "--nproc-per-node", "0"],
    "config error": ["config", "show", "--set", "training.stepz=1"],
    "train: config error": ["train", "--run-dir", os.path.join(tempfile.gettempdir(), "titan-async-bench-startup"), "--set", "training.stepz=1"],
    "train: 2 processes": ["train", "--config", "debug_cpu_pp2", "--nproc-per-node", "2", "--run-dir", FRESH_RUN_DIR] + [
        f"--set={s}" for s in ("model.dim=64", "model.n_layers=4", "model.n_heads=4", "training.seq_len=64",
                               "training.local_batch_size=8", "training.steps=4", "checkpoint.enable=false",
                               "validation.enable=false", "metrics.enable_tensorboard=false")],
}


def seconds(checkout: Path, args: list[str]) -> float:
    args = [str(Path(tempfile.mkdtemp()) / "run") if arg == FRESH_RUN_DIR else arg for arg in args]
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "titan_async.cli", *args], cwd=checkout, env=env, capture_output=True)
    return time.perf_counter() - start


def spread(values: list[float]) -> str:
    return f"{min(values):.2f} / {statistics.median(values):.2f} / {max(values):.2f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--baseline", help="a git revision to measure alongside, e.g. HEAD~3 or main")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        checkouts = {"this checkout": REPO}
        if args.baseline:
            baseline = Path(scratch) / "baseline"
            subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(baseline), args.baseline],
                           check=True, capture_output=True)
            checkouts = {f"baseline {args.baseline}": baseline, **checkouts}
        try:
            times = {(name, label): [] for name in COMMANDS for label in checkouts}
            for _ in range(args.reps):
                for name, command in COMMANDS.items():
                    for label, checkout in checkouts.items():
                        times[name, label].append(seconds(checkout, command))
        finally:
            if args.baseline:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(baseline)], capture_output=True)
    print(f"{args.reps} repetitions each, min / median / max")
    for name in COMMANDS:
        cells = [f"{label}: {spread(times[name, label])}" for label in checkouts]
        if args.baseline:
            medians = [statistics.median(times[name, label]) for label in checkouts]
            cells.append(f"speed-up {medians[0] / medians[1]:.1f}x")
        print(f"{name:20} " + "; ".join(cells))


if __name__ == "__main__":
    main()
