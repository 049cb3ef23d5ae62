"""Does a worker forked by the launcher start able to use CUDA? Runs what `titan-async train`
runs before it starts workers (the config check and the whole trainer config: data, tokenizer,
float8 capability), then has torch's elastic agent start `--nproc-per-node` workers the way the
launcher does (`launch.start_method`); each selects cuda:0 (one GPU cannot host two NCCL ranks,
so the workers use no process group) and allocates, and reports whether it was forked after a
CUDA call. Exit status 0 when every worker allocated.

    python tools/gpu/fork_start.py [--config debug_cpu_pp2] [--set model.float8=rowwise ...]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import uuid
from pathlib import Path


def allocate_on_the_gpu() -> str:
    """One worker: its start, and on CUDA an allocation on cuda:0."""
    import torch

    from titan_async.core import platform

    line = f"local rank {os.environ['LOCAL_RANK']}: forked after a CUDA call: {'yes' if platform.forked_after_cuda() else 'no'}"
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
        line += f"; allocated {torch.ones(1 << 20, device='cuda').sum().item():.0f} floats on {torch.cuda.get_device_name()}"
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="debug_cpu_pp2")
    parser.add_argument("--set", action="append", default=["model.float8=rowwise"])
    parser.add_argument("--nproc-per-node", type=int, default=2)
    args = parser.parse_args()
    from titan_async.core import platform

    print(f"device type: {platform.configure()}", flush=True)  # before torchtitan is imported
    from titan_async.cli import _config_path
    from titan_async.config.assemble import trainer_config
    from titan_async.config.run_config import load_run_config
    from titan_async.run import launch

    run = load_run_config(_config_path(args.config), args.set)
    run.check(args.nproc_per_node)
    trainer_config(run, Path(tempfile.mkdtemp()) / "run", args.nproc_per_node)
    method = launch.start_method()
    print(f"start method: {method}", flush=True)

    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=args.nproc_per_node, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", start_method=method, max_restarts=0)
    reports = elastic_launch(config, allocate_on_the_gpu)()
    for rank in sorted(reports):
        print(reports[rank])
    sys.exit(0 if all("forked after a CUDA call: no" in line for line in reports.values()) else 1)


if __name__ == "__main__":
    main()
