"""How one parameter (a matrix, or a stack of expert matrices) splits into the matrices Muon
orthogonalises separately."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class MatrixBlocks(Protocol):
    """A parameter matrix viewed as independent blocks; `merge(split(m))` equals `m`."""

    names: tuple[str, ...]

    def split(self, matrix: torch.Tensor) -> list[torch.Tensor]:
        """The blocks of `matrix`, in `names` order."""
        ...

    def merge(self, blocks: list[torch.Tensor]) -> torch.Tensor:
        """The matrix whose blocks are `blocks`."""
        ...

    def shapes(self, shape: tuple[int, int]) -> list[tuple[int, int]]:
        """Block shapes of a matrix of `shape`."""
        ...


@dataclass(frozen=True)
class WholeMatrix:
    """The matrix is one block."""

    names: tuple[str, ...] = ("",)

    def split(self, matrix: torch.Tensor) -> list[torch.Tensor]:
        return [matrix]

    def merge(self, blocks: list[torch.Tensor]) -> torch.Tensor:
        return blocks[0]

    def shapes(self, shape: tuple[int, int]) -> list[tuple[int, int]]:
        return [tuple(shape)]


@dataclass(frozen=True)
class FusedQKVBlocks:
    """torchtitan's fused `wqkv.weight`: rows laid out as (n_kv_heads, heads_per_kv + 2, head_dim).

    Per KV group the first `heads_per_kv` head slices are Q, then one K and one V
    (see `FusedQKVLinear` in torchtitan/models/common/attention.py).
    """

    heads_per_kv: int
    head_dim: int
    names: tuple[str, ...] = ("q", "k", "v")

    def _grouped(self, matrix: torch.Tensor) -> torch.Tensor:
        return matrix.reshape(-1, self.heads_per_kv + 2, self.head_dim, matrix.size(1))

    def split(self, matrix: torch.Tensor) -> list[torch.Tensor]:
        grouped = self._grouped(matrix)
        cols = matrix.size(1)
        hpk = self.heads_per_kv
        return [
            grouped[:, :hpk].reshape(-1, cols),
            grouped[:, hpk].reshape(-1, cols),
            grouped[:, hpk + 1].reshape(-1, cols),
        ]

    def merge(self, blocks: list[torch.Tensor]) -> torch.Tensor:
        q, k, v = blocks
        cols = q.size(1)
        shape = (-1, 1, self.head_dim, cols)
        grouped = torch.cat(
            [q.reshape(-1, self.heads_per_kv, self.head_dim, cols), k.reshape(shape), v.reshape(shape)], dim=1
        )
        return grouped.reshape(-1, cols)

    def shapes(self, shape: tuple[int, int]) -> list[tuple[int, int]]:
        rows, cols = shape
        kv_rows = rows // (self.heads_per_kv + 2)
        return [(kv_rows * self.heads_per_kv, cols), (kv_rows, cols), (kv_rows, cols)]


@dataclass(frozen=True)
class ExpertBlocks:
    """A mixture-of-experts weight (experts, rows, cols): each expert's matrix is one block."""

    experts: int

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f"expert{i}" for i in range(self.experts))

    def split(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return list(tensor.unbind(0))

    def merge(self, blocks: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(blocks)

    def shapes(self, shape: tuple[int, int, int]) -> list[tuple[int, int]]:
        return [tuple(shape[1:])] * shape[0]
