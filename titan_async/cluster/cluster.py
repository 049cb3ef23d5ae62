"""The GPUs a plan is made for, read from plan's arguments without torch: the CLI checks them
before it imports torch, so a bad argument is answered at once."""

from __future__ import annotations

import re
from dataclasses import dataclass

from titan_async.core.errors import UserError

_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]+)\s*$")


def parse_size(text: str) -> int:
    """Bytes in a size such as "80GiB", "141GB" or "512MiB"; ValueError otherwise."""
    match = _SIZE.match(text)
    unit = match and _UNITS.get(match.group(2).lower())
    if not unit or float(match.group(1)) <= 0:
        raise ValueError(f"expected a positive size with a unit ({', '.join(_UNITS)}), e.g. 80GiB")
    return int(float(match.group(1)) * unit)


@dataclass(frozen=True)
class Cluster:
    """The GPUs a plan is made for."""

    nodes: int
    gpus_per_node: int
    gpu_memory: int

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @classmethod
    def parse(cls, nodes: int, gpus_per_node: int, gpu_memory: str) -> Cluster:
        """UserError naming the argument for counts below 1 or an unreadable memory size."""
        for flag, value in (("--nodes", nodes), ("--gpus-per-node", gpus_per_node)):
            if value < 1:
                raise UserError(f"{flag} {value}: must be at least 1")
        try:
            memory = parse_size(gpu_memory)
        except ValueError as err:
            raise UserError(f"--gpu-memory {gpu_memory!r}: {err}") from None
        return cls(nodes, gpus_per_node, memory)
