"""Staleness scaling study: what sets the cost of the one-step delay at 20 tokens per parameter.

Cells (CELLS) vary the number of optimizer steps at a fixed token budget (the batch: 1,024,
4,096 and 16,384 tokens per step on the 279K-parameter llama of `staleness_study.py --regime
tokens20`) and the model size (a 541K-parameter llama). In each cell, for AdamW and Muon:
1. a small lr sweep of the synchronous run (3 lrs a factor 2 apart around the cell's guess,
   grown until the best is bracketed);
2. at the best lr, the delayed arms: delay 1, delay 1 + EF, delay 1 + weight prediction;
3. synchronous runs at BUDGETS of the tokens (each its own full lr schedule), which give the
   synchronous final loss as a function of the token budget: token efficiency is read from it.
SEEDS_OF_CELL adds seeds of the synchronous and delayed arms, after every cell's seed-0 runs.

Every finished run is appended at once to RECORD (docs/results/staleness_scaling/runs.jsonl:
its cell, name, settings, wall seconds and validation curve), and a run found there is never
trained again: the study stops anywhere (a session's end) and continues, with the same command,
on a fresh checkout. The `tokens20` cell's runs come from docs/results/staleness_tokens20.

    .venv/bin/python tools/staleness_scaling.py [--cells b64,b16,b4,540k] [--parallel 2] [--dry-run]
    .venv/bin/python tools/staleness_scaling.py --report-only    # tables, fit and README only
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from pathlib import Path

from staleness_study import Arm, Regime, Settings, best_lr, job, load_curves
from titan_async.experiments.jobs import ROOT, git_state, run_job

OUT = ROOT / "docs" / "results" / "staleness_scaling"
RECORD = OUT / "runs.jsonl"
RUNS = ROOT / "runs" / "staleness_scaling"
TOKENS20 = ROOT / "docs" / "results" / "staleness_tokens20"
BUDGETS = (0.5, 0.7)
"""Shares of the cell's token budget at which the synchronous arm also runs (BUDGETS and 1.0
give the synchronous loss against tokens)."""
VALIDATION_SEQUENCES = 512
"""Held-out sequences of every evaluation in every cell (validation batches x batch), so that
every cell validates on the same tokens."""
DELAYED = (Arm("adamw", 1, False), Arm("muon", 1, False), Arm("adamw", 1, True), Arm("muon", 1, True),
           Arm("adamw", 1, False, corrector="predict"), Arm("muon", 1, False, corrector="predict"))


@dataclass(frozen=True)
class Cell:
    """One model and batch size at 20 tokens per parameter, with the centres of its lr sweeps
    (Muon's AdamW groups run at `adamw_lr` throughout the cell)."""

    name: str
    regime: Regime
    adamw_lr: float
    muon_lr: float

    def settings(self, adamw_lr: float, muon_lr: float, budget: float = 1.0) -> Settings:
        """The cell's run settings at these lrs and `budget` x its tokens (steps a multiple of the
        10 evaluations, warm-up 5% of them)."""
        steps = self.regime.steps if budget == 1.0 else 10 * round(budget * self.regime.steps / 10)
        base = self.regime.settings(adamw_lr, muon_lr, self.adamw_lr)
        return replace(base, steps=steps, validation_freq=steps // 10, warmup_steps=max(1, round(0.05 * steps)),
                       validation_steps=VALIDATION_SEQUENCES // self.regime.batch)


def _regime(dim: int, batch: int) -> Regime:
    """The tokens20 llama (4 layers, 4 heads, vocab 512, seq 256) at `dim` and `batch` sequences."""
    return Regime(dim, 4, 4, 512, 64, 256, batch, 20.0, 18_000.0)


CELLS = {
    "b64": Cell("b64", _regime(64, 64), 1.2e-2, 2e-2),
    "b16": Cell("b16", _regime(64, 16), 6e-3, 1e-2),
    "b4": Cell("b4", _regime(64, 4), 3e-3, 1e-2),
    "540k": Cell("540k", _regime(96, 32), 6e-3, 1e-2),
}
"""b64, b16, b4: the 279,104-parameter llama at 16,384, 4,096 and 1,024 tokens per step (350,
1,370 and 5,460 steps); 540k: dim 96, 541,536 parameters at 8,192 tokens per step (1,330 steps,
about b16's). b16 is `staleness_study.py --regime tokens20`, whose sweep and arms are imported.
A run costs about parameters x tokens: a 1M-parameter cell (12 times b16's cost per run, about 80
minutes two at a time) did not fit the study's budget of about 10 hours."""
SEEDS_OF_CELL = {"b64": (0, 1), "b16": (0, 1), "b4": (0, 1), "540k": (0,)}
"""Seeds of the synchronous and delayed arms (seed 0 first): the extra ones train after every
cell's seed-0 runs."""


@dataclass(frozen=True)
class Run:
    """One training run of a cell: an arm at an lr and a share of the cell's tokens."""

    cell: Cell
    arm: Arm
    lr: float
    budget: float = 1.0
    sweep: bool = False

    @property
    def name(self) -> str:
        if self.sweep:
            return f"tune-{self.arm.optimizer}-lr{self.lr:g}"
        return self.arm.name + (f"-budget{self.budget:g}" if self.budget != 1.0 else "")

    @property
    def key(self) -> str:
        return f"{self.cell.name}/{self.name}"

    def settings(self, best: dict[str, float]) -> Settings:
        lrs = {**best, self.arm.optimizer: self.lr}
        return self.cell.settings(lrs.get("adamw", self.cell.adamw_lr), lrs.get("muon", self.cell.muon_lr), self.budget)


def load_record(path: Path = RECORD) -> dict[str, dict]:
    """Finished runs by key (`cell/name`); a torn last line (a stop while writing) is ignored."""
    found = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue
            found[f"{entry['cell']}/{entry['run']}"] = entry
    return found


_record_lock = threading.Lock()


def append_record(entry: dict, path: Path = RECORD) -> None:
    """Append one finished run (one line, flushed and synced)."""
    with _record_lock:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps(entry) + "\n")
            f.flush()
            os.fsync(f.fileno())


def entry_of(run: Run, settings: Settings, validation: list[tuple[int, float]], wall_s: float | None, source: str) -> dict:
    return {
        "cell": run.cell.name, "run": run.name, "optimizer": run.arm.optimizer, "delay": run.arm.delay, "ef": run.arm.ef,
        "corrector": run.arm.corrector, "seed": run.arm.seed, "lr": run.lr, "budget": run.budget, "sweep": run.sweep,
        "steps": settings.steps, "tokens": settings.steps * settings.seq_len * settings.batch,
        "parameters": run.cell.regime.parameters, "batch_tokens": settings.seq_len * settings.batch,
        "wall_s": wall_s, "source": source, "validation": validation,
    }


def import_tokens20(record: dict[str, dict]) -> None:
    """Record the b16 cell's sweep (final losses only) and arms (validation curves) from the
    committed tokens20 study, once."""
    cell = CELLS["b16"]
    if any(key.startswith("b16/") for key in record):
        return
    with open(TOKENS20 / "tuning.csv", newline="") as f:
        tuning = list(csv.DictReader(f))
    best = {}
    for row in tuning:
        run = Run(cell, Arm(row["optimizer"], 0, False), float(row["lr"]), sweep=True)
        settings = run.settings({})
        best.setdefault(row["optimizer"], []).append((float(row["final_validation_loss"]), float(row["lr"])))
        append_record(entry_of(run, settings, [(settings.steps, float(row["final_validation_loss"]))], None, "staleness_tokens20/tuning.csv"))
    lrs = {opt: min(pairs)[1] for opt, pairs in best.items()}
    curves: dict[str, list[tuple[int, float]]] = {}
    with open(TOKENS20 / "curves.csv", newline="") as f:
        for row in csv.DictReader(f):
            if row["kind"] == "validation":
                curves.setdefault(row["arm"], []).append((int(row["step"]), float(row["loss"])))
    for seed in (0, 1):
        for arm in [Arm(o, 0, False, seed) for o in ("adamw", "muon")] + [a.at(seed) for a in DELAYED]:
            if arm.name in curves:
                run = Run(cell, arm, lrs[arm.optimizer])
                append_record(entry_of(run, run.settings(lrs), sorted(curves[arm.name]), None, "staleness_tokens20/curves.csv"))


def sweep_runs(cell: Cell, record: dict[str, dict]) -> tuple[list[Run], dict[str, float] | None]:
    """The sweep runs still to train and, once every optimizer's best lr is bracketed (or its
    grid has grown twice), the best lrs."""
    todo, best = [], {}
    for optimizer, centre in (("adamw", cell.adamw_lr), ("muon", cell.muon_lr)):
        grid = [centre / 2, centre, centre * 2]
        while True:
            runs = [Run(cell, Arm(optimizer, 0, False), lr, sweep=True) for lr in grid]
            missing = [r for r in runs if r.key not in record]
            if missing:
                todo += missing
                break
            losses = {r.lr: record[r.key]["validation"][-1][1] for r in runs}
            lr = best_lr(losses)
            if len(grid) < 5 and lr == grid[-1]:
                grid.append(2 * lr)
            elif len(grid) < 5 and lr == grid[0]:
                grid.insert(0, lr / 2)
            else:
                best[optimizer] = lr
                break
    return todo, (best if len(best) == 2 else None)


def cell_runs(cell: Cell, best: dict[str, float], extra_seeds: bool) -> list[Run]:
    """The cell's runs at its best lrs, in order of use: the delayed arms at seed 0 (plain, EF,
    prediction) and the budget runs; with `extra_seeds`, the synchronous and delayed arms at the
    cell's other seeds instead."""
    if extra_seeds:
        return [Run(cell, Arm(o, d, False, seed), best[o]) for seed in SEEDS_OF_CELL[cell.name][1:]
                for d in (0, 1) for o in ("adamw", "muon")]
    runs = [Run(cell, arm, best[arm.optimizer]) for arm in DELAYED]
    return runs + [Run(cell, Arm(o, 0, False), best[o], budget) for budget in BUDGETS for o in ("adamw", "muon")]


def pending(cells: list[Cell], record: dict[str, dict]) -> Iterator[Run]:
    """The runs to train: cell by cell, a cell's sweep, then its seed-0 arms once the sweep has
    chosen its lrs (meanwhile the next cell's); then every cell's extra seeds."""
    for extra_seeds in (False, True):
        for cell in cells:
            todo, best = sweep_runs(cell, record)
            if best is None:
                yield from () if extra_seeds else todo
                continue
            yield from (r for r in cell_runs(cell, best, extra_seeds) if r.key not in record)


def train(run: Run, best: dict[str, float], parallel: int) -> dict:
    """Train `run` in RUNS and return its record entry."""
    settings = run.settings(best)
    run_dir = RUNS / run.cell.name / run.name
    wall = run_job(job(run.arm, settings, run_dir), parallel)
    validation = load_curves(run_dir / "metrics.jsonl").validation
    if not validation or validation[-1][0] != settings.steps:
        raise RuntimeError(f"{run.key} did not validate at its last step {settings.steps} (log: {run_dir}.log)")
    return entry_of(run, settings, validation, wall, f"trained at {git_state()}, load average {os.getloadavg()[0]:.1f}")


def best_of(cell: Cell, record: dict[str, dict]) -> dict[str, float]:
    return sweep_runs(cell, record)[1] or {}


def run_study(cells: list[Cell], parallel: int) -> None:
    """Train pending runs, `parallel` at a time, until none is left; each finished run is
    recorded at once, and the queue is worked out again from the record (a finished sweep
    decides the next runs)."""
    running: dict[Future, Run] = {}
    with ThreadPoolExecutor(max_workers=parallel) as pool:
        while True:
            record = load_record()
            busy = {r.key for r in running.values()}
            for run in pending(cells, record):
                if len(running) >= parallel:
                    break
                if run.key in busy:
                    continue
                busy.add(run.key)
                running[pool.submit(train, run, best_of(run.cell, record), parallel)] = run
                print(f"{time.strftime('%H:%M:%S')} start {run.key}", flush=True)
            if not running:
                return
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                run = running.pop(future)
                entry = future.result()
                append_record(entry)
                print(f"{time.strftime('%H:%M:%S')} done {run.key}: {entry['wall_s']:.0f} s, "
                      f"final validation loss {entry['validation'][-1][1]:.4f}", flush=True)


def dry_run(cells: list[Cell]) -> str:
    lines = []
    for cell in cells:
        r = cell.regime
        settings = cell.settings(cell.adamw_lr, cell.muon_lr)
        lines.append(f"{cell.name}: {r.parameters:,} parameters, {settings.steps} steps x {r.seq_len * r.batch:,} tokens "
                     f"= {settings.steps * r.seq_len * r.batch:,} tokens; sweep centres AdamW {cell.adamw_lr:g}, Muon {cell.muon_lr:g}")
    record = load_record()
    lines.append(f"recorded runs: {len(record)}; next: " + ", ".join(r.key for r in pending(cells, record)))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cells", default=",".join(CELLS), help=f"cells in order of priority (of {', '.join(CELLS)})")
    p.add_argument("--parallel", type=int, default=2, help="runs at a time (each gets cores // parallel threads)")
    p.add_argument("--dry-run", action="store_true", help="print the cells and the next runs; train nothing")
    p.add_argument("--report-only", action="store_true", help="rebuild the results from the record, training nothing")
    args = p.parse_args(argv)
    unknown = [c for c in args.cells.split(",") if c not in CELLS]
    if unknown:
        p.error(f"--cells: unknown cell {unknown[0]!r}; expected some of {', '.join(CELLS)}")
    args.cells = [CELLS[c] for c in args.cells.split(",")]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import_tokens20(load_record())
    if args.dry_run:
        print(dry_run(args.cells))
        return
    if not args.report_only:
        run_study(args.cells, args.parallel)


if __name__ == "__main__":
    sys.exit(main())
