"""Run a function on the full logical matrices behind sharded tensors (FSDP2, TP, both), each on one owner rank."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from functools import lru_cache

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

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


def sharded_mesh_dims(layout: torch.Tensor) -> tuple[int, ...]:
    """The mesh dimensions (of size > 1) over which `layout` holds different parts of its matrix."""
    if not isinstance(layout, DTensor):
        return ()
    mesh = layout.device_mesh
    return tuple(d for d, p in enumerate(layout.placements) if isinstance(p, (Shard, _StridedShard)) and mesh.size(d) > 1)


def exchange_group(layout: torch.Tensor) -> dist.ProcessGroup | None:
    """The ranks among which `layout`'s matrix is split: one mesh dimension's group, or, split over
    several (FSDP x TP), the group `create_exchange_groups` made of them; a RuntimeError if it made none."""
    dims = sharded_mesh_dims(layout)
    if not dims:
        return None
    if len(dims) == 1:
        return layout.device_mesh.get_group(dims[0])
    ranks = _split_ranks(layout, dims)
    group = _flat_groups().get(ranks)
    if group is None:
        names = [layout.device_mesh.mesh_dim_names[d] for d in dims]
        raise RuntimeError(f"no process group over ranks {list(ranks)}, which split a matrix over mesh dimensions {names}: "
                           "create_exchange_groups makes it, called on every rank")
    return group


def create_exchange_groups(tensors: Iterable[torch.Tensor]) -> None:
    """Make the process group of every matrix that any rank holds split over several mesh
    dimensions (FSDP x TP, efsdp x ep), for `exchange_group`.

    Collective over the world whatever each rank holds: every rank calls this at the same point
    (when it builds its optimizers), with its own matrices or none (a pipeline stage without such
    matrices). The ranks agree on the groups by one all-gather and all make them, in one order.
    """
    if not dist.is_initialized():
        return
    made = _flat_groups()
    wanted = sorted({_split_ranks(t, dims) for t in tensors if len(dims := sharded_mesh_dims(t)) > 1})
    everyone: list[list[tuple[int, ...]] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, wanted)
    for ranks in sorted(set().union(*everyone) - made.keys()):
        group = dist.new_group(list(ranks))
        made[ranks] = group if dist.get_rank() in ranks else None


def _split_ranks(layout: DTensor, dims: tuple[int, ...]) -> tuple[int, ...]:
    """The global ranks (sorted) that hold parts of `layout`'s matrix: this rank's slice of its mesh along `dims`."""
    mesh = layout.device_mesh
    coordinate = mesh.get_coordinate()
    index = tuple(slice(None) if d in dims else c for d, c in enumerate(coordinate))
    return tuple(sorted(mesh.mesh[index].flatten().tolist()))


_FLAT_GROUPS: tuple[dist.ProcessGroup | None, dict[tuple[int, ...], dist.ProcessGroup | None]] = (None, {})


def _flat_groups() -> dict[tuple[int, ...], dist.ProcessGroup | None]:
    """Groups `create_exchange_groups` made in the current world: their ranks -> the group (None
    on ranks outside it). A new default process group starts an empty table."""
    global _FLAT_GROUPS
    if _FLAT_GROUPS[0] is not dist.group.WORLD:
        _FLAT_GROUPS = (dist.group.WORLD, {})
    return _FLAT_GROUPS[1]


def map_full_matrices(
    parts: Sequence[torch.Tensor], layouts: Sequence[torch.Tensor], fn: BatchFunction, costs: Sequence[float]
) -> list[torch.Tensor]:
    """This rank's part of fn's result for every matrix M_i.

    `parts[i]` is this rank's local part of M_i, distributed like `layouts[i]`: a plain tensor
    (M_i is `parts[i]`), or a DTensor with any Shard/_StridedShard/Replicate placements (FSDP2,
    HSDP, TP, FSDP x TP). Sharded matrices are gathered to one owner rank of the ranks that
    split them (`exchange_group`), owners balanced by `costs[i]` (what fn spends on M_i); then
    `fn` runs once on this rank, over every full matrix it holds (its own and the unsharded
    ones), and each rank's part goes back to it: two all-to-alls per (process group, dtype),
    however many matrices. Every rank of those groups must call this with the same matrices in
    the same order. Returns plain tensors.
    """
    held: dict[int, torch.Tensor] = {}
    batches: dict[tuple[int, torch.dtype], tuple[dist.ProcessGroup, list[int]]] = {}
    for i, (part, layout) in enumerate(zip(parts, layouts)):
        group = exchange_group(layout)
        if group is None:
            held[i] = part
            continue
        batches.setdefault((id(group), part.dtype), (group, []))[1].append(i)
    exchanges = []
    for group, indices in batches.values():
        exchange = _exchange(group, [layouts[i] for i in indices], [costs[i] for i in indices], parts[indices[0]].device)
        held.update(zip([indices[j] for j in exchange.mine], exchange.gather([parts[i] for i in indices])))
        exchanges.append((indices, exchange))
    computed = dict(zip(held, fn(list(held), list(held.values()))))
    results = [computed.get(i) for i in range(len(parts))]
    for indices, exchange in exchanges:
        for i, part in zip(indices, exchange.scatter([computed[indices[j]] for j in exchange.mine])):
            results[i] = part
    return results


@lru_cache(maxsize=None)
def _shard_indices(shape: tuple[int, ...], placements: tuple[Placement, ...], mesh_shape: tuple[int, ...],
                   coordinate: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Per tensor dimension, the global indices (on `device`) that the part at mesh `coordinate`
    holds, in its order: the part is M[i_0][:, i_1]... . Placements apply in mesh-dimension
    order, each splitting the previous part along its tensor dimension as `distribute_tensor`
    splits it."""
    index = [torch.arange(n, device=device) for n in shape]
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, _StridedShard):
            one_dim = _StridedShard(0, split_factor=placement.split_factor)
        elif isinstance(placement, Shard):
            one_dim = Shard(0)
        else:
            continue
        dim = placement.dim % len(shape)
        index[dim] = one_dim._select_split_tensor(index[dim], mesh_shape[mesh_dim], coordinate[mesh_dim], with_padding=False)
    return tuple(index)


def _coordinate(mesh: DeviceMesh, rank: int) -> tuple[int, ...]:
    """The mesh coordinate of global rank `rank`."""
    return tuple((mesh.mesh == rank).nonzero()[0].tolist())


def _grid(index: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """`index` as broadcastable advanced indices: M[_grid(index)] is the part, of shape (len(i_0), len(i_1), ...)."""
    n = len(index)
    return tuple(i.view([-1 if d == k else 1 for d in range(n)]) for k, i in enumerate(index))


_EXCHANGES: dict[tuple, _Exchange] = {}


def _exchange(group: dist.ProcessGroup, layouts: list[DTensor], costs: list[float], device: torch.device) -> _Exchange:
    """The `_Exchange` of these matrices, built once per (group, shapes, placements, costs, device)."""
    key = (group.group_name, tuple((tuple(l.shape), tuple(l.placements), tuple(l.device_mesh.mesh.flatten().tolist())) for l in layouts),
           tuple(costs), device)
    if key not in _EXCHANGES:
        _EXCHANGES[key] = _Exchange(group, layouts, costs, device)
    return _EXCHANGES[key]


class _Exchange:
    """Sharded matrices of one process group: gathered whole to their owners, results sent back.

    `parts[g][j]` is (global indices per dimension) the part of matrix j that group rank g
    holds; `mine` lists the matrices this rank owns, in the order `gather` returns them.
    """

    def __init__(self, group: dist.ProcessGroup, layouts: list[DTensor], costs: list[float], device: torch.device) -> None:
        self.group, self.device = group, device
        self.world, self.me = dist.get_world_size(group), dist.get_rank(group)
        self.shapes = [tuple(layout.shape) for layout in layouts]
        members = [dist.get_global_rank(group, g) for g in range(self.world)]
        self.parts = [
            [_shard_indices(tuple(layout.shape), tuple(layout.placements), tuple(layout.device_mesh.shape),
                            _coordinate(layout.device_mesh, rank), device) for layout in layouts]
            for rank in members
        ]
        self.sizes = [[_numel(index) for index in row] for row in self.parts]
        self.owners = assign_owners(costs, self.world)
        self.mine = [j for j in range(len(layouts)) if self.owners[j] == self.me]

    def _owned_by(self, rank: int) -> list[int]:
        return [j for j in range(len(self.shapes)) if self.owners[j] == rank]

    def gather(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """The full matrices of `mine`, from every rank's local parts `parts` (one per matrix)."""
        for j, part in enumerate(parts):
            expected = tuple(len(i) for i in self.parts[self.me][j])
            if tuple(part.shape) != expected:
                raise ValueError(f"expected a local part of shape {expected} of a {self.shapes[j]} matrix, got {tuple(part.shape)}")
        dtype, device = parts[0].dtype, self.device
        self.dtype = dtype
        sent = [parts[j].reshape(-1) for r in range(self.world) for j in self._owned_by(r)]
        send_splits = [sum(self.sizes[self.me][j] for j in self._owned_by(r)) for r in range(self.world)]
        receive_splits = [sum(self.sizes[g][j] for j in self.mine) for g in range(self.world)]
        received = _all_to_all(sent, send_splits, receive_splits, dtype, device, self.group)
        full = {j: torch.empty(self.shapes[j], dtype=dtype, device=device) for j in self.mine}
        offset = 0
        for g in range(self.world):
            for j in self.mine:
                index = self.parts[g][j]
                full[j][_grid(index)] = received[offset : offset + self.sizes[g][j]].view([len(i) for i in index])
                offset += self.sizes[g][j]
        return [full[j] for j in self.mine]

    def scatter(self, results: list[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's part of every matrix's result, given the results for `mine` (after `gather`)."""
        by_matrix = dict(zip(self.mine, results))
        sent = [by_matrix[j].to(self.dtype)[_grid(self.parts[g][j])].reshape(-1) for g in range(self.world) for j in self.mine]
        send_splits = [sum(self.sizes[g][j] for j in self.mine) for g in range(self.world)]
        receive_splits = [sum(self.sizes[self.me][j] for j in self._owned_by(r)) for r in range(self.world)]
        received = _all_to_all(sent, send_splits, receive_splits, self.dtype, self.device, self.group)
        local: dict[int, torch.Tensor] = {}
        offset = 0
        for r in range(self.world):
            for j in self._owned_by(r):
                size = self.sizes[self.me][j]
                local[j] = received[offset : offset + size].view([len(i) for i in self.parts[self.me][j]])
                offset += size
        return [local[j] for j in range(len(self.shapes))]


def _numel(index: tuple[torch.Tensor, ...]) -> int:
    size = 1
    for i in index:
        size *= len(i)
    return size


def _all_to_all(pieces: list[torch.Tensor], send_splits: list[int], receive_splits: list[int], dtype: torch.dtype,
                device: torch.device, group: dist.ProcessGroup) -> torch.Tensor:
    """One all-to-all of the concatenated `pieces` (in destination order) with uneven splits."""
    sent = torch.cat(pieces) if pieces else torch.empty(0, dtype=dtype, device=device)
    received = torch.empty(sum(receive_splits), dtype=dtype, device=device)
    dist.all_to_all_single(received, sent, receive_splits, send_splits, group=group)
    return received
