"""The memory this node has for a run's processes, as the launcher's memory check and `eval`'s
see it: `AVAILABLE_ENV` when set (a stand-in, for tests and for nodes that over-report), else
the RAM available (/proc/meminfo MemAvailable)."""

from __future__ import annotations

import os

from titan_async.core.errors import UserError

AVAILABLE_ENV = "TITAN_ASYNC_MEMORY_AVAILABLE_GIB"
GIB = 2**30


def gib(value: float) -> str:
    """Bytes as GiB to 3 significant digits (215, 20.8, 0.392)."""
    return f"{value / GIB:.3g}"


def override() -> int | None:
    """The bytes `AVAILABLE_ENV` gives, or None when it is unset."""
    given = os.environ.get(AVAILABLE_ENV)
    if given is None:
        return None
    try:
        return round(float(given) * GIB)
    except ValueError:
        raise UserError(f"{AVAILABLE_ENV}={given!r}: expected a number of GiB") from None


def node_ram() -> tuple[int, str]:
    """The RAM available on this node (bytes) and, in words, where the number comes from."""
    given = override()
    if given is not None:
        return given, f"{gib(given)} GiB by {AVAILABLE_ENV}"
    total = _available_ram()
    return total, f"{gib(total)} GiB of available RAM"


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
