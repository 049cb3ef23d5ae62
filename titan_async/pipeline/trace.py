"""Timeline of a rank's pipeline actions: busy time, bubble fraction, Chrome trace, Gantt chart."""

from __future__ import annotations

import json
import time
from collections import deque
from contextlib import contextmanager
from pathlib import Path

import torch

from titan_async.core import comm_log, streams

Mark = tuple[float, object]
"""A point in time: host seconds, and the event recorded on the current stream there."""


class Timeline:
    """Compute intervals of one rank, in seconds (wall clock, comparable across local ranks).

    Waiting for a neighbour is not recorded, so the idle share of a window is its bubble.
    Windows are contiguous: each runs from the previous one's end (or, after `restart`, from
    `start_window`) to its own, so host work between windows (logging, loading the next
    batch) that leaves the device idle counts in the bubble.

    The intervals are the device's, measured with events of the device's stream backend
    (`titan_async.core.streams`; on CUDA wall-clock time around a launch measures only the
    enqueueing, on the CPU an op has run when its call returns). Without a trace, `end_window`
    never waits for the device: it reads the windows whose last kernel has finished
    (`Event.query`), so a window's bubble is reported once the device has run it, a step or so
    late. With a trace (`keep_events`) it waits for the window's end, one host sync per step.
    """

    def __init__(self, rank: int, keep_events: bool, device: torch.device | None = None) -> None:
        self.rank = rank
        self.keep_events = keep_events
        self.streams = streams.for_device(device or torch.device("cpu"))
        self.events: list[tuple[str, float, float]] = []
        self.pending: list[tuple[str, Mark, Mark]] = []
        self.unread: deque[tuple[Mark, Mark, list[tuple[str, Mark, Mark]]]] = deque()
        self.origin: Mark | None = None
        self.last_bubble: float | None = None

    def _mark(self) -> Mark:
        event = self.streams.event(timing=True)
        event.record()
        return time.time(), event

    def _seconds(self, start: Mark, end: Mark) -> float:
        return start[1].elapsed_time(end[1]) / 1e3

    def start_window(self) -> None:
        """Open a window; it starts where the previous one ended unless `restart` came between."""
        if self.origin is None:
            self.origin = self._mark()
        self.pending = []

    def restart(self) -> None:
        """The stream was drained: the drain's actions join the trace (a drain is no window and
        has no bubble), and the next window starts when it is fed, not where the last ended."""
        if self.keep_events and self.pending and self.origin is not None:
            self._finished(self.pending[-1][2])
            self._trace(self.origin, self.pending)
        self.origin, self.pending = None, []

    @contextmanager
    def action(self, name: str):
        comm_log.note({"op": "compute", "action": name})
        start = self._mark()
        yield
        self.pending.append((name, start, self._mark()))

    def end_window(self) -> float | None:
        """Close the window; returns the bubble of the latest window read so far (`last_bubble`)."""
        end = self._mark()
        self.unread.append((self.origin, end, self.pending))
        self.origin, self.pending = end, []
        while self.unread and self._finished(self.unread[0][1]):
            self.last_bubble = self._read(*self.unread.popleft())
        return self.last_bubble

    def _finished(self, mark: Mark) -> bool:
        event = mark[1]
        if self.keep_events:
            event.synchronize()
            return True
        return event.query()

    def _read(self, origin: Mark, end: Mark, actions: list[tuple[str, Mark, Mark]]) -> float:
        """The idle share of one finished window; its actions join the trace when kept."""
        if self.keep_events:
            self._trace(origin, actions)
        busy = sum(self._seconds(start, stop) for _, start, stop in actions)
        elapsed = self._seconds(origin, end)
        return max(0.0, 1.0 - busy / elapsed) if elapsed > 0 else 0.0

    def _trace(self, origin: Mark, actions: list[tuple[str, Mark, Mark]]) -> None:
        """Keep `actions` (finished) as trace events, in host seconds from `origin`'s host time."""
        for name, start, stop in actions:
            offset = origin[0] + self._seconds(origin, start)
            self.events.append((name, offset, offset + self._seconds(start, stop)))

    def write(self, path: Path) -> None:
        """Chrome/Perfetto trace events of this rank (one thread per rank)."""
        events = [
            {"name": name, "ph": "X", "pid": 0, "tid": self.rank, "ts": start * 1e6, "dur": (end - start) * 1e6}
            for name, start, end in self.events
        ]
        path.write_text(json.dumps({"traceEvents": events}))


def trace_torch_stages(stages: list, timeline: Timeline) -> None:
    """Record the compute actions torch's schedules run on `stages` (PipelineStage objects) on
    `timeline`, named like the streaming executor's: `<stage>F<k>`, `<stage>B<k>` for a full
    backward, `<stage>I<k>` and `<stage>W<k>` for a split one, k the microbatch of the flush."""

    def timed(method, stage: int, kind):
        def traced(chunk: int, *args, **kwargs):
            letter = kind(args, kwargs) if callable(kind) else kind
            with timeline.action(f"{stage}{letter}{chunk}"):
                return method(chunk, *args, **kwargs)

        return traced

    def backward_kind(args, kwargs) -> str:
        full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
        return "B" if full else "I"

    for stage in stages:
        s = stage.stage_index
        stage.forward_one_chunk = timed(stage.forward_one_chunk, s, "F")
        stage.backward_one_chunk = timed(stage.backward_one_chunk, s, backward_kind)
        stage.backward_weight_one_chunk = timed(stage.backward_weight_one_chunk, s, "W")


def merge_traces(paths: list[Path], output: Path) -> list[dict]:
    """Merge per-rank trace files into one Chrome trace; returns the events."""
    events = [e for p in sorted(paths) for e in json.loads(p.read_text())["traceEvents"]]
    output.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return events


GANTT_COLOURS = {"F": "tab:blue", "B": "tab:green", "I": "limegreen", "W": "tab:olive", "O": "tab:red", "H": "lightgray",
                 "C": "tab:purple"}
"""Action letter -> colour: forwards, backwards (split: input, weight gradients), optimizer steps, host work,
exposed FSDP and replica collectives (simulated)."""


def draw_gantt(events: list[dict], output: Path, title: str) -> None:
    """PNG Gantt chart of Chrome trace events (`Timeline.write`): one row per rank."""
    draw_gantts([(title, events)], output)


def draw_gantts(panels: list[tuple[str, list[dict]]], output: Path) -> None:
    """PNG of one Gantt chart per (title, events) panel, stacked, on a shared time axis in ms from
    each panel's first event: one row per rank, forwards blue, backwards green (input gradients
    light green, weight gradients olive), optimizer steps red, host work grey, exposed collectives purple."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [len({e["tid"] for e in events}) for _, events in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(14, sum(1 + 0.6 * r for r in rows)), sharex=True, squeeze=False,
                             gridspec_kw={"height_ratios": rows})
    for ax, (title, events) in zip(axes[:, 0], panels):
        origin = min(e["ts"] for e in events)
        ranks = sorted({e["tid"] for e in events})
        for event in events:
            kind = next((c for c in event["name"] if c in GANTT_COLOURS), "O")
            ax.broken_barh([((event["ts"] - origin) / 1e3, event["dur"] / 1e3)], (event["tid"] - 0.4, 0.8),
                           facecolors=GANTT_COLOURS[kind], edgecolor="white", linewidth=0.3)
        ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
        ax.invert_yaxis()
        ax.set_title(title, fontsize=9)
    axes[-1, 0].set_xlabel("time (ms)")
    fig.tight_layout()
    fig.savefig(output, dpi=120)
    plt.close(fig)
