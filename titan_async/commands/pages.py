"""Self-contained HTML pages with PNG line charts: the parts `report` and `compare` share."""

from __future__ import annotations

import base64
import html
from pathlib import Path

from matplotlib.figure import Figure

from titan_async.core.errors import UserError

PAGE_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
h1 { font-size: 1.6em; } h2 { border-bottom: 1px solid #ccc; padding-bottom: .2em; margin-top: 1.6em; }
table { border-collapse: collapse; font-size: .9em; }
td, th { border: 1px solid #ddd; padding: .25em .6em; text-align: right; }
td:first-child, th:first-child { text-align: left; }
pre { background: #f6f6f6; padding: 1em; overflow-x: auto; font-size: .85em; line-height: 1.25; }
figure { margin: 1em 0; } img { max-width: 100%; }
"""


def line_chart(path: Path, title: str, ylabel: str, lines: list[tuple[str, list[float], list[float]]], xlabel: str = "step") -> None:
    """One line chart of (label, x, y) lines, saved as a PNG."""
    figure = Figure(figsize=(8, 3.6), layout="constrained")
    axes = figure.add_subplot()
    for label, steps, values in lines:
        axes.plot(steps, values, marker="o" if len(steps) <= 30 else None, markersize=3, label=label)
    axes.set(title=title, xlabel=xlabel, ylabel=ylabel)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.savefig(path, dpi=110)


def html_table(header: list[str] | None, rows: list[list[str]]) -> str:
    head = "" if header is None else "<thead><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr></thead>"
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table>{head}<tbody>{body}</tbody></table>"


def html_figure(caption: str, path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return (f'<figure><img alt="{html.escape(caption)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{html.escape(caption)} ({html.escape(path.name)})</figcaption></figure>")


def html_page(title: str, body: list[str]) -> str:
    """A self-contained HTML page: `title` as heading, then the `body` parts."""
    title = html.escape(title)
    return "\n".join([
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{title}</title>'
        f"<style>{PAGE_STYLE}</style></head><body><h1>{title}</h1>",
        *body,
        "</body></html>\n",
    ])


def page_path(out: Path) -> Path:
    """`out`, with its folder created; UserError if it is a directory."""
    if out.is_dir():
        raise UserError(f"--out {out}: is a directory; give the HTML file to write")
    out.parent.mkdir(parents=True, exist_ok=True)
    return out
