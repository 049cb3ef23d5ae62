"""Does the stream model have teeth? Remove each ordering call site of the project in turn (every
stream wait, event record and wait, work wait, fence) and show that a check run under the stream
model (`titan_async.core.stream_model`) then fails; prints the sites and the check that caught each.

    python tools/stream_mutations.py [--site N ...] [--list]

Each mutant is a copy of `titan_async/` with the site's call removed (`x.wait()` kept as `x`,
any other line replaced by `pass`), put first on
PYTHONPATH for the check. A site counts as caught only when its check reports a stream race (the
model naming both sides), not when it fails some other way. The unmutated checks must pass first.
Exit status 0 when every site is caught.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHECKS = REPO / "tests" / "workers" / "stream_model_checks.py"

TINY_RUN = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "training.seq_len=32", "training.local_batch_size=8",
            "validation.enable=false", "checkpoint.enable=false", "lr_scheduler.warmup_steps=1", "training.steps=3",
            "parallelism.pipeline_parallel_microbatch_size=1"]
RUNS = {
    "pp2_fsdp2_2bw": ("debug_cpu_pp2_fsdp2", 4, ["parallelism.pipeline_parallel_schedule=PipeDream2BW",
                                                  "training.clipping=lagged_global", "training.max_norm=0.1"]),
    "pp2_fsdp2_paci": ("debug_cpu_pp2_fsdp2", 4, ["parallelism.pipeline_parallel_schedule=PACI", "parallelism.paci.accumulation=3",
                                                   "training.weight_prediction=2"]),
    "pp2_2bw": ("debug_cpu_pp2", 2, ["parallelism.pipeline_parallel_schedule=PipeDream2BW"]),
}
"""Training runs under the stream model: config, processes, settings (besides TINY_RUN)."""


@dataclass(frozen=True)
class Site:
    path: str
    line: str
    check: str
    """`checks:NAME` (tests/workers/stream_model_checks.py) or `run:NAME` (RUNS)."""


SITES = [
    Site("titan_async/train/late_read.py", "self.side.wait_stream(written_on)", "checks:late_all_reduce"),
    Site("titan_async/train/late_read.py", "self.work.wait()", "checks:late_all_reduce"),
    Site("titan_async/train/late_read.py", "self.copied.record()", "checks:late_read"),
    Site("titan_async/train/late_read.py", "self.copied.synchronize()", "checks:late_read"),
    Site("titan_async/parallel/fsdp_stage.py", "ctx.all_gather_copy_in_stream.wait_stream(current)", "run:pp2_fsdp2_paci"),
    Site("titan_async/pipeline/transport.py", "dist.irecv(header, self.peer, group=self.group).wait()", "run:pp2_2bw"),
    Site("titan_async/pipeline/transport.py", "work.wait()", "run:pp2_2bw"),
]
"""Every ordering call site of the project. Not listed: the transport's waits on its sends
(`_Outbound`), which bound the sends in flight (memory) and order nothing: the process group
holds a send's tensor until it completes, and nothing writes a tensor once it is sent."""


def mutant(site: Site, root: Path, occurrence: int) -> Path:
    """A copy of the package under `root` with the `occurrence`-th line `site.line` made `pass`."""
    shutil.copytree(REPO / "titan_async", root / "titan_async", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "train_configs", root / "titan_async" / "train_configs")  # the package's configs (pyproject)
    path = root / site.path
    lines = path.read_text().splitlines(keepends=True)
    found = [i for i, line in enumerate(lines) if line.strip() == site.line]
    index = found[occurrence]
    indent = lines[index][: len(lines[index]) - len(lines[index].lstrip())]
    kept = site.line.removesuffix(".wait()") if site.line.endswith(").wait()") else "pass"
    lines[index] = f"{indent}{kept}  # mutated\n"
    path.write_text("".join(lines))
    return root


def occurrences(site: Site) -> int:
    lines = (REPO / site.path).read_text().splitlines()
    count = sum(line.strip() == site.line for line in lines)
    if count == 0:
        raise ValueError(f"{site.path}: no line {site.line!r}: update SITES")
    return count


def run_check(check: str, pythonpath: Path | None, workdir: Path) -> tuple[bool, str]:
    """(passed, what it said) for `check` with `pythonpath` first on the path."""
    env = {**os.environ, "TITAN_ASYNC_STREAM_MODEL": "1"}
    if pythonpath is not None:
        env["PYTHONPATH"] = f"{pythonpath}{os.pathsep}{env.get('PYTHONPATH', '')}"
    kind, name = check.split(":")
    if kind == "checks":
        command = [sys.executable, str(CHECKS), name]
    else:
        config, nproc, settings = RUNS[name]
        command = [sys.executable, "-m", "titan_async.cli", "train", "--config", config, "--nproc-per-node", str(nproc),
                   "--run-dir", str(workdir / "run"), *[a for s in TINY_RUN + settings for a in ("--set", s)]]
        shutil.rmtree(workdir / "run", ignore_errors=True)
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=workdir, env=env)
    output = result.stdout + result.stderr
    return result.returncode == 0, output


def race_line(output: str) -> str | None:
    for line in output.splitlines():
        if "StreamRace: stream race: " in line:
            return line.split("stream race: ", 1)[1].strip()
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--site", type=int, action="append", help="only these sites (numbers of --list)")
    parser.add_argument("--list", action="store_true", help="list the sites and their checks")
    args = parser.parse_args(argv)
    mutations = [(site, k) for site in SITES for k in range(occurrences(site))]
    if args.list:
        for number, (site, k) in enumerate(mutations):
            print(f"{number:2d}  {site.path}: {site.line}  (#{k + 1})  <- {site.check}")
        return 0
    chosen = [mutations[n] for n in args.site] if args.site else mutations
    uncaught = 0
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        for check in sorted({site.check for site, _ in chosen}):
            passed, output = run_check(check, None, scratch)
            if not passed:
                print(f"the unmutated check {check} fails:\n{output[-3000:]}")
                return 1
        for site, k in chosen:
            root = scratch / "mutant"
            shutil.rmtree(root, ignore_errors=True)
            started = time.time()
            passed, output = run_check(site.check, mutant(site, root, k), scratch)
            race = None if passed else race_line(output)
            uncaught += race is None
            verdict = f"caught by {site.check}: {race}" if race else (
                "NOT CAUGHT" if passed else f"failed without a race:\n{output[-2000:]}")
            print(f"{site.path}: {site.line} (#{k + 1}) [{time.time() - started:.0f} s] {verdict}", flush=True)
    print(f"{len(chosen) - uncaught} of {len(chosen)} ordering call sites caught")
    return 1 if uncaught else 0


if __name__ == "__main__":
    sys.exit(main())
