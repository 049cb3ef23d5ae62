"""JSON-lines files a run appends to (metrics.jsonl, pipeline/stage<s>.jsonl): a run killed
mid-write leaves the last line cut short, and rows appended to it would merge with the fragment
and be lost. A writer that (re)starts first sets that fragment aside, so the file ends at its
last complete row."""

from __future__ import annotations

import json
from pathlib import Path

SET_ASIDE_SUFFIX = ".truncated"
"""`<file>.truncated` beside the file keeps the fragments set aside from it, one a line."""

_BLOCK = 1 << 16


def set_aside_path(path: Path) -> Path:
    return path.with_name(path.name + SET_ASIDE_SUFFIX)


def set_aside_cut_line(path: Path) -> bytes | None:
    """Make `path` end at its last complete row before rows are appended to it: a last line that
    is not a JSON object (a write cut short) is appended to `set_aside_path(path)` (kept, never
    lost) and only then cut from `path`; a last row cut just before its newline gets the newline.
    Returns the fragment set aside, or None."""
    if not path.is_file():
        return None
    with path.open("r+b") as handle:
        size = handle.seek(0, 2)
        start = _last_line_start(handle, size)
        handle.seek(start)
        line = handle.read()
        if _is_row(line):
            if line and not line.endswith(b"\n"):
                handle.write(b"\n")
            return None
        with set_aside_path(path).open("ab") as aside:
            aside.write(line if line.endswith(b"\n") else line + b"\n")
        handle.truncate(start)
    return line


def _last_line_start(handle, size: int) -> int:
    """The offset of the file's last line: just after the newline before it, else 0."""
    handle.seek(max(size - 1, 0))
    end = size - 1 if handle.read(1) == b"\n" else size  # the last line's own newline is no boundary
    while end > 0:
        begin = max(end - _BLOCK, 0)
        handle.seek(begin)
        newline = handle.read(end - begin).rfind(b"\n")
        if newline >= 0:
            return begin + newline + 1
        end = begin
    return 0


def _is_row(line: bytes) -> bool:
    if not line:
        return True  # an empty file ends at its last complete row
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:  # JSONDecodeError, and UnicodeDecodeError of bytes cut inside a character
        return False
