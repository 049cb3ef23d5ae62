"""Run a function on the full logical matrix behind each FSDP-sharded tensor, on one owner rank."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

MatrixFunction = Callable[[int, torch.Tensor], torch.Tensor]
"""fn(i, full matrix i) -> a tensor of the same shape and dtype."""


def assign_owners(sizes: Sequence[int], ranks: int) -> list[int]:
    """An owner rank per item: largest first, each to the least-loaded rank (ties to the lower index)."""
    load = [0] * ranks
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        owner = min(range(ranks), key=lambda r: (load[r], r))
        owners[i] = owner
        load[owner] += sizes[i]
    return owners


def map_full_matrices(
    parts: Sequence[torch.Tensor], layouts: Sequence[torch.Tensor], fn: MatrixFunction
) -> list[torch.Tensor]:
    """This rank's rows of fn(i, M_i) for every matrix M_i.

    `parts[i]` is this rank's local part of M_i, distributed like `layouts[i]`: a plain tensor
    (M_i is `parts[i]`), or a DTensor sharded on dim 0 over one mesh dimension and replicated
    over any others (FSDP2, HSDP). Sharded matrices are gathered to one owner rank of their
    mesh dimension (owners balanced by size), `fn` runs there, and the rows go back to their
    ranks: two all-to-alls per (process group, dtype), however many matrices. Every rank of
    those groups must call this with the same matrices in the same order. Returns plain tensors.
    """
    results: list[torch.Tensor | None] = [None] * len(parts)
    batches: dict[tuple[int, torch.dtype], tuple[dist.ProcessGroup, list[int]]] = {}
    for i, (part, layout) in enumerate(zip(parts, layouts)):
        mesh_dim = _row_sharded_mesh_dim(layout)
        if mesh_dim is None:
            results[i] = fn(i, part)
            continue
        group = layout.device_mesh.get_group(mesh_dim)
        batches.setdefault((id(group), part.dtype), (group, []))[1].append(i)
    for group, indices in batches.values():
        shapes = [tuple(layouts[i].shape) for i in indices]
        local = _exchange(group, [parts[i] for i in indices], shapes, lambda j, m: fn(indices[j], m))
        for i, rows in zip(indices, local):
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


def _exchange(
    group: dist.ProcessGroup, parts: list[torch.Tensor], shapes: list[tuple[int, ...]], fn: MatrixFunction
) -> list[torch.Tensor]:
    """Gather each row-sharded matrix to its owner, apply `fn`, return this rank's rows of the results."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    rows = [shape[0] for shape in shapes]
    cols = [shape[1] for shape in shapes]
    chunks = [math.ceil(r / world) for r in rows]
    local_rows = [max(0, min(c, r - me * c)) for r, c in zip(rows, chunks)]
    for j, part in enumerate(parts):
        if part.shape != (local_rows[j], cols[j]):
            raise ValueError(f"expected a local shard of shape {(local_rows[j], cols[j])}, got {tuple(part.shape)}")
    sizes = [c * n for c, n in zip(chunks, cols)]
    owners = assign_owners([r * n for r, n in zip(rows, cols)], world)
    order = sorted(range(len(parts)), key=lambda j: (owners[j], j))
    mine = [j for j in order if owners[j] == me]
    send_splits = [sum(sizes[j] for j in order if owners[j] == r) for r in range(world)]
    piece = send_splits[me]

    padded = [F.pad(parts[j], (0, 0, 0, chunks[j] - local_rows[j])).reshape(-1) for j in order]
    gathered = torch.empty(piece * world, dtype=parts[0].dtype, device=parts[0].device)
    dist.all_to_all_single(gathered, torch.cat(padded), [piece] * world, send_splits, group=group)

    by_source = gathered.view(world, piece)
    outputs = []
    offset = 0
    for j in mine:
        full = by_source[:, offset : offset + sizes[j]].reshape(world * chunks[j], cols[j])[: rows[j]]
        result = fn(j, full).to(parts[0].dtype)
        outputs.append(F.pad(result, (0, 0, 0, world * chunks[j] - rows[j])).reshape(world, sizes[j]))
        offset += sizes[j]
    scattered_out = torch.cat(outputs, dim=1).reshape(-1) if outputs else gathered.new_empty(0)
    scattered = torch.empty(sum(send_splits), dtype=parts[0].dtype, device=parts[0].device)
    dist.all_to_all_single(scattered, scattered_out, send_splits, [piece] * world, group=group)

    local: list[torch.Tensor | None] = [None] * len(parts)
    offset = 0
    for j in order:
        local[j] = scattered[offset : offset + sizes[j]].view(chunks[j], cols[j])[: local_rows[j]]
        offset += sizes[j]
    return local
