"""The resolved parameter-group table: which parameter, which optimizer, which effective lr."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from rich.text import Text
from torch.optim import Optimizer

from titan_async.optim.blocks import ExpertBlocks
from titan_async.optim.error_feedback import ErrorFeedback
from titan_async.optim.muon import Muon

TABLE_FILE = "optimizer_groups.txt"


@dataclass(frozen=True)
class GroupRow:
    """One parameter (or one Muon block of it) as its optimizer sees it."""

    name: str
    shape: tuple[int, ...]
    optimizer: str
    lr: float
    """Peak lr including Muon's per-block scaling (the lr schedule multiplies it)."""
    error_feedback: float | None
    """Error-feedback coefficient, None without error feedback."""


def param_group_rows(optimizers: Iterable[Optimizer]) -> list[GroupRow]:
    """Rows for every parameter of `optimizers` (a torchtitan container or a list of optimizers)."""
    rows = []
    for optimizer in optimizers:
        coefficient = optimizer.coefficient if isinstance(optimizer, ErrorFeedback) else None
        base = optimizer.base if isinstance(optimizer, ErrorFeedback) else optimizer
        kind = type(base).__name__
        for group in base.param_groups:
            lr = float(group.get("initial_lr", group["lr"]))
            for name, param in zip(group["param_names"], group["params"]):
                if isinstance(base, Muon) and isinstance(base.blocks[param], ExpertBlocks):
                    (_, shape, scale), *_ = base.lr_scales(param, group)  # every expert has the same shape
                    rows.append(GroupRow(f"{name}[per expert]", tuple(param.shape), kind, lr * scale, coefficient))
                elif isinstance(base, Muon):
                    for block, shape, scale in base.lr_scales(param, group):
                        label = f"{name}[{block}]" if block else name
                        rows.append(GroupRow(label, shape, kind, lr * scale, coefficient))
                else:
                    rows.append(GroupRow(name, tuple(param.shape), kind, lr, coefficient))
    return rows


def _all_ranks(rows: list[GroupRow]) -> list[GroupRow]:
    """Rows of every rank (pipeline stages hold different parameters), each name once."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return rows
    gathered: list[list[GroupRow] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rows)
    unique = {}
    for rank_rows in gathered:
        for row in rank_rows:
            unique.setdefault(row.name, row)
    return list(unique.values())


def render_table(rows: list[GroupRow]) -> Table:
    """A rich table of `rows`, with a per-optimizer summary as caption."""
    table = Table(title="Optimizer parameter groups")
    table.add_column("parameter", overflow="fold")
    table.add_column("shape", justify="right")
    table.add_column("optimizer")
    table.add_column("lr", justify="right")
    table.add_column("error feedback")
    totals: dict[str, list[int]] = {}
    for row in sorted(rows, key=lambda row: row.optimizer != "Muon"):
        ef = "-" if row.error_feedback is None else f"c={row.error_feedback:g}"
        table.add_row(Text(row.name), "x".join(map(str, row.shape)), row.optimizer, f"{row.lr:.4g}", ef)
        count = totals.setdefault(row.optimizer, [0, 0])
        count[0] += 1
        count[1] += math.prod(row.shape)
    table.caption = ", ".join(f"{kind}: {n} rows, {numel:,} parameters" for kind, (n, numel) in totals.items())
    return table


def write_param_group_table(optimizers: Iterable[Optimizer], dump_folder: str | Path) -> Path | None:
    """Print the table on rank 0 and save it as `optimizer_groups.txt` in `dump_folder`.

    Collective when torch.distributed is initialised: every rank must call it. Returns the
    file's path on rank 0, None elsewhere.
    """
    rows = _all_ranks(param_group_rows(optimizers))
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    table = render_table(rows)
    Console().print(table)
    path = Path(dump_folder) / TABLE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as file:
        Console(file=file, width=160, color_system=None).print(table)
    return path
