"""Timeline of a rank's pipeline actions: busy time, bubble fraction, Chrome trace, Gantt chart."""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path

import torch


class Timeline:
    """Compute intervals of one rank, in seconds (wall clock, comparable across local ranks).

    Waiting for a neighbour is not recorded, so the idle share of a window is its bubble.
    On CUDA the intervals are those of the GPU, measured with CUDA events (wall-clock time
    around a launch measures only the enqueueing); they are read once per window, in
    `end_window`, which waits for the window's last kernel (one host sync per step).
    """

    def __init__(self, rank: int, keep_events: bool, device: torch.device | None = None) -> None:
        self.rank = rank
        self.keep_events = keep_events
        self.cuda = device is not None and device.type == "cuda"
        self.events: list[tuple[str, float, float]] = []
        self.pending: list[tuple[str, object, object]] = []
        self.window_start = 0.0
        self.window_start_event = None
        self.busy = 0.0
        self.last_bubble: float | None = None

    def _now(self):
        if not self.cuda:
            return time.time()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start_window(self) -> None:
        self.window_start, self.busy, self.pending = time.time(), 0.0, []
        self.window_start_event = self._now()

    @contextmanager
    def action(self, name: str):
        start = self._now()
        yield
        end = self._now()
        if self.cuda:
            self.pending.append((name, start, end))
            return
        self.busy += end - start
        if self.keep_events:
            self.events.append((name, start, end))

    def end_window(self) -> float:
        """The window's idle share (its bubble); also kept as `last_bubble`."""
        end = self._now()
        if self.cuda:
            end.synchronize()
            origin = self.window_start_event
            for name, start, stop in self.pending:
                self.busy += start.elapsed_time(stop) / 1e3
                if self.keep_events:
                    offset = self.window_start + origin.elapsed_time(start) / 1e3
                    self.events.append((name, offset, offset + start.elapsed_time(stop) / 1e3))
            self.pending = []
            elapsed = origin.elapsed_time(end) / 1e3
        else:
            elapsed = end - self.window_start
        self.last_bubble = max(0.0, 1.0 - self.busy / elapsed) if elapsed > 0 else 0.0
        return self.last_bubble

    def write(self, path: Path) -> None:
        """Chrome/Perfetto trace events of this rank (one thread per rank)."""
        events = [
            {"name": name, "ph": "X", "pid": 0, "tid": self.rank, "ts": start * 1e6, "dur": (end - start) * 1e6}
            for name, start, end in self.events
        ]
        path.write_text(json.dumps({"traceEvents": events}))


def merge_traces(paths: list[Path], output: Path) -> list[dict]:
    """Merge per-rank trace files into one Chrome trace; returns the events."""
    events = [e for p in sorted(paths) for e in json.loads(p.read_text())["traceEvents"]]
    output.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return events


def draw_gantt(events: list[dict], output: Path, title: str) -> None:
    """PNG Gantt chart: one row per rank, forwards blue, backwards green, optimizer steps red."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"F": "tab:blue", "B": "tab:green", "O": "tab:red"}
    origin = min(e["ts"] for e in events)
    ranks = sorted({e["tid"] for e in events})
    fig, ax = plt.subplots(figsize=(14, 1 + 0.6 * len(ranks)))
    for event in events:
        kind = next((c for c in event["name"] if c in colours), "O")
        ax.broken_barh(
            [((event["ts"] - origin) / 1e3, event["dur"] / 1e3)],
            (event["tid"] - 0.4, 0.8),
            facecolors=colours[kind],
            edgecolor="white",
            linewidth=0.3,
        )
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(output, dpi=120)
    plt.close(fig)
