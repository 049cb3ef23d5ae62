"""Run a function on the full logical matrices behind FSDP-sharded tensors, each on one owner rank."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

BatchFunction = Callable[[list[int], list[torch.Tensor]], list[torch.Tensor]]
"""fn(indices, full matrices M_i for those indices) -> one tensor per matrix, of its shape."""


def assign_owners(costs: Sequence[float], ranks: int) -> list[int]:
    """An owner rank per item: costliest first, each to the least-loaded rank (ties to the lower index)."""
    load = [0.0] * ranks
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        owner = min(range(ranks), key=lambda r: (load[r], r))
        owners[i] = owner
        load[owner] += costs[i]
    return owners


def map_full_matrices(
    parts: Sequence[torch.Tensor], layouts: Sequence[torch.Tensor], fn: BatchFunction, costs: Sequence[float]
) -> list[torch.Tensor]:
    """This rank's rows of fn's result for every matrix M_i.

    `parts[i]` is this rank's local part of M_i, distributed like `layouts[i]`: a plain tensor
    (M_i is `parts[i]`), or a DTensor sharded on dim 0 over one mesh dimension and replicated
    over any others (FSDP2, HSDP). Sharded matrices are gathered to one owner rank of their
    mesh dimension, owners balanced by `costs[i]` (what fn spends on M_i); then `fn` runs once
    on this rank, over every full matrix it holds (its own and the unsharded ones), and the rows
    go back to their ranks: two all-to-alls per (process group, dtype), however many matrices.
    Every rank of those groups must call this with the same matrices in the same order.
    Returns plain tensors.
    """
    held: dict[int, torch.Tensor] = {}
    batches: dict[tuple[int, torch.dtype], tuple[dist.ProcessGroup, list[int]]] = {}
    for i, (part, layout) in enumerate(zip(parts, layouts)):
        mesh_dim = _row_sharded_mesh_dim(layout)
        if mesh_dim is None:
            held[i] = part
            continue
        group = layout.device_mesh.get_group(mesh_dim)
        batches.setdefault((id(group), part.dtype), (group, []))[1].append(i)
    exchanges = []
    for group, indices in batches.values():
        exchange = _Exchange(group, [tuple(layouts[i].shape) for i in indices], [costs[i] for i in indices])
        held.update(zip([indices[j] for j in exchange.mine], exchange.gather([parts[i] for i in indices])))
        exchanges.append((indices, exchange))
    computed = dict(zip(held, fn(list(held), list(held.values()))))
    results = [computed.get(i) for i in range(len(parts))]
    for indices, exchange in exchanges:
        for i, rows in zip(indices, exchange.scatter([computed[indices[j]] for j in exchange.mine])):
            results[i] = rows
    return results


def _row_sharded_mesh_dim(layout: torch.Tensor) -> int | None:
    """The mesh dimension `layout` is sharded on (rows), or None if it is not sharded."""
    if not isinstance(layout, DTensor):
        return None
    sharded = [d for d, p in enumerate(layout.placements) if not p.is_replicate()]
    if not sharded:
        return None
    if len(sharded) > 1 or not layout.placements[sharded[0]].is_shard(0):
        raise ValueError(
            f"a matrix of shape {tuple(layout.shape)} has placements {layout.placements}; "
            "only Shard(0) on one mesh dimension (FSDP2) is supported"
        )
    return sharded[0]


class _Exchange:
    """Row-sharded matrices of one process group: gathered whole to their owners, results sent back.

    Rows are split as FSDP2 splits them (chunks of ceil(rows / world), the last ones short or
    empty); `mine` lists the matrices this rank owns, in the order `gather` returns them.
    """

    def __init__(self, group: dist.ProcessGroup, shapes: list[tuple[int, ...]], costs: list[float]) -> None:
        self.group = group
        self.world, me = dist.get_world_size(group), dist.get_rank(group)
        self.rows = [shape[0] for shape in shapes]
        self.cols = [shape[1] for shape in shapes]
        self.chunks = [math.ceil(r / self.world) for r in self.rows]
        self.local_rows = [max(0, min(c, r - me * c)) for r, c in zip(self.rows, self.chunks)]
        self.sizes = [c * n for c, n in zip(self.chunks, self.cols)]
        owners = assign_owners(costs, self.world)
        self.order = sorted(range(len(shapes)), key=lambda j: (owners[j], j))
        self.mine = [j for j in self.order if owners[j] == me]
        self.send_splits = [sum(self.sizes[j] for j in self.order if owners[j] == r) for r in range(self.world)]
        self.piece = self.send_splits[me]

    def gather(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """The full matrices of `mine`, from every rank's local rows `parts` (one per shape)."""
        for j, part in enumerate(parts):
            if part.shape != (self.local_rows[j], self.cols[j]):
                raise ValueError(
                    f"expected a local shard of shape {(self.local_rows[j], self.cols[j])}, got {tuple(part.shape)}"
                )
        self.dtype, self.device = parts[0].dtype, parts[0].device
        padded = [F.pad(parts[j], (0, 0, 0, self.chunks[j] - self.local_rows[j])).reshape(-1) for j in self.order]
        gathered = torch.empty(self.piece * self.world, dtype=self.dtype, device=self.device)
        dist.all_to_all_single(gathered, torch.cat(padded), [self.piece] * self.world, self.send_splits, group=self.group)
        by_source = gathered.view(self.world, self.piece)
        full, offset = [], 0
        for j in self.mine:
            full.append(by_source[:, offset : offset + self.sizes[j]].reshape(-1, self.cols[j])[: self.rows[j]])
            offset += self.sizes[j]
        return full

    def scatter(self, results: list[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's rows of every matrix's result, given the results for `mine` (after `gather`)."""
        outputs = [
            F.pad(result.to(self.dtype), (0, 0, 0, self.world * self.chunks[j] - self.rows[j])).reshape(self.world, self.sizes[j])
            for j, result in zip(self.mine, results)
        ]
        sent = torch.cat(outputs, dim=1).reshape(-1) if outputs else torch.empty(0, dtype=self.dtype, device=self.device)
        received = torch.empty(sum(self.send_splits), dtype=self.dtype, device=self.device)
        dist.all_to_all_single(received, sent, self.send_splits, [self.piece] * self.world, group=self.group)
        local: list[torch.Tensor | None] = [None] * len(self.rows)
        offset = 0
        for j in self.order:
            local[j] = received[offset : offset + self.sizes[j]].view(self.chunks[j], self.cols[j])[: self.local_rows[j]]
            offset += self.sizes[j]
        return local
