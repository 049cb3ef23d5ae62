"""`titan-async report`: one self-contained HTML page, with its plots as PNGs beside it,
that shows how a run went without starting TensorBoard."""

from __future__ import annotations

import base64
import html
import json
import shutil
import statistics
import tomllib
from dataclasses import dataclass
from pathlib import Path

from matplotlib.figure import Figure

from titan_async import run_dir as runs
from titan_async.errors import UserError

TRAIN_LOSS = "loss_metrics/global_avg_loss"
VALIDATION_LOSS = "validation_metrics/loss"
THROUGHPUT = "throughput(tps)"
MEMORY = "memory/max_reserved(GiB)"
BUBBLE = "pipeline/bubble"
GROUP_TABLE = "optimizer_groups.txt"
TIMELINE = Path("pipeline") / "timeline.png"


@dataclass
class RunRecord:
    """What a run directory holds, read once."""

    directory: Path
    config_text: str
    config: dict
    launch: dict
    train: dict[int, dict]
    """Step -> training scalars (the last row logged for that step)."""
    validation: dict[int, dict]
    rank_bubbles: dict[int, dict[int, float]]
    """Pipeline rank -> step -> measured bubble, from pipeline/rankR.jsonl."""


def _json_rows(path: Path) -> list[dict]:
    """The JSON objects of a JSON-lines file; a line cut short by a killed run is skipped."""
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def read_run(directory: Path, argument: str = "--run-dir") -> RunRecord:
    """Read `directory`; UserError naming `argument` if it is not a run directory or has logged
    no training step."""
    launch = runs.load_launch(directory, argument)
    metrics_file = directory / "metrics.jsonl"
    rows = _json_rows(metrics_file) if metrics_file.is_file() else []
    train = {row["step"]: row for row in rows if row.get("kind") == "train"}
    if not train:
        raise UserError(f"{argument} {directory}: no training step logged yet ({metrics_file.name} is missing or empty)")
    bubbles = {}
    for path in sorted((directory / "pipeline").glob("rank*.jsonl")):
        per_step = {row["step"]: row["bubble"] for row in _json_rows(path) if row.get("bubble") is not None}
        if per_step:
            bubbles[int(path.stem.removeprefix("rank"))] = per_step
    config_text = (directory / runs.CONFIG_FILE).read_text()
    return RunRecord(
        directory=directory,
        config_text=config_text,
        config=tomllib.loads(config_text),
        launch=launch,
        train=train,
        validation={row["step"]: row for row in rows if row.get("kind") == "validation"},
        rank_bubbles=bubbles,
    )


def series(rows: dict[int, dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the rows that logged `key`, in step order."""
    steps = [step for step in sorted(rows) if rows[step].get(key) is not None]
    return steps, [rows[step][key] for step in steps]


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


def draw_plots(record: RunRecord, folder: Path) -> list[tuple[str, str, Path]]:
    """Write the run's PNGs into `folder`; returns (section id, caption, file) of each."""
    plots = []
    loss_lines = [("training loss", *series(record.train, TRAIN_LOSS))]
    if record.validation:
        loss_lines.append(("validation loss", *series(record.validation, VALIDATION_LOSS)))
    line_chart(folder / "loss.png", "loss", "cross-entropy", loss_lines)
    plots.append(("loss", "Training loss and validation loss per step", folder / "loss.png"))
    line_chart(folder / "throughput.png", "throughput", "tokens/s per device",
               [("tokens/s per device", *series(record.train, THROUGHPUT))])
    plots.append(("throughput", "Tokens per second per device (torchtitan's throughput(tps))", folder / "throughput.png"))
    if record.rank_bubbles:
        lines = [(f"rank {rank}", sorted(b), [b[s] for s in sorted(b)]) for rank, b in sorted(record.rank_bubbles.items())]
        line_chart(folder / "bubble.png", "pipeline bubble", "idle share of the step", lines)
        plots.append(("pipeline", "Measured pipeline bubble per rank", folder / "bubble.png"))
    if (record.directory / TIMELINE).is_file():
        shutil.copyfile(record.directory / TIMELINE, folder / "timeline.png")
        plots.append(("pipeline", "Pipeline timeline of the traced steps: forwards blue, backwards green, optimizer steps red",
                      folder / "timeline.png"))
    return plots


def summary(record: RunRecord) -> list[tuple[str, str]]:
    """(label, value) rows: steps, losses, throughput, memory, bubble, stop."""
    last = max(record.train)
    configured = record.config.get("training", {}).get("steps", "?")
    world = record.launch.get("world_size", record.launch.get("nproc_per_node", 1))
    _, train_losses = series(record.train, TRAIN_LOSS)
    rows = [
        ("run directory", str(record.directory)),
        ("steps logged", f"{last} of {configured}"),
        ("processes", str(world)),
        ("first training loss", f"{train_losses[0]:.4f}"),
        ("final training loss", f"{train_losses[-1]:.4f} (step {last})"),
    ]
    val_steps, val_losses = series(record.validation, VALIDATION_LOSS)
    if val_steps:
        rows.append(("final validation loss", f"{val_losses[-1]:.4f} (step {val_steps[-1]})"))
        rows.append(("best validation loss", f"{min(val_losses):.4f}"))
    _, tps = series(record.train, THROUGHPUT)
    if tps:
        median = statistics.median(tps[1:] or tps)
        rows.append(("tokens/s per device (median, first step excluded)", f"{median:,.0f}"))
        rows.append(("tokens/s whole job (median x processes)", f"{median * world:,.0f}"))
    _, memory = series(record.train, MEMORY)
    if memory:
        rows.append(("peak memory reserved", f"{max(memory):.2f} GiB"))
    _, bubble = series(record.train, BUBBLE)
    if bubble:
        rows.append(("mean pipeline bubble", f"{statistics.fmean(bubble):.1%}"))
    stop = runs.early_stop(record.directory)
    if stop is not None:
        cause = {"signal": "a signal", "nonfinite": "non-finite losses or gradients"}.get(stop["reason"], stop["reason"])
        rows.append(("stopped early", f"at step {stop['step']} by {cause}, with a checkpoint"))
    return rows


def html_table(header: list[str] | None, rows: list[list[str]]) -> str:
    head = "" if header is None else "<thead><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr></thead>"
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table>{head}<tbody>{body}</tbody></table>"


def _number(value: float | None, form: str = "{:.4f}") -> str:
    return "" if value is None else form.format(value)


def step_table(record: RunRecord) -> str:
    """Every logged step's scalars as an HTML table: the plotted series as numbers."""
    lr_keys = sorted({key for row in record.train.values() for key in row if key.startswith("lr/")})
    rows = []
    for step in sorted(record.train):
        row, validation = record.train[step], record.validation.get(step, {})
        rows.append([
            str(step), _number(row.get(TRAIN_LOSS)), _number(validation.get(VALIDATION_LOSS)),
            _number(row.get("grad_norm")), _number(row.get(THROUGHPUT), "{:,.0f}"),
            *(_number(row.get(key), "{:.4g}") for key in lr_keys),
        ])
    return html_table(["step", "training loss", "validation loss", "grad norm", "tokens/s", *lr_keys], rows)


PAGE_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
h1 { font-size: 1.6em; } h2 { border-bottom: 1px solid #ccc; padding-bottom: .2em; margin-top: 1.6em; }
table { border-collapse: collapse; font-size: .9em; }
td, th { border: 1px solid #ddd; padding: .25em .6em; text-align: right; }
td:first-child, th:first-child { text-align: left; }
pre { background: #f6f6f6; padding: 1em; overflow-x: auto; font-size: .85em; line-height: 1.25; }
figure { margin: 1em 0; } img { max-width: 100%; }
"""


def html_figure(caption: str, path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return (f'<figure><img alt="{html.escape(caption)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{html.escape(caption)} ({html.escape(path.name)})</figcaption></figure>")


def render_html(record: RunRecord, plots: list[tuple[str, str, Path]]) -> str:
    """The page: summary, plots, per-step table, optimizer groups and resolved config."""
    parts = [
        '<section id="summary"><h2>Summary</h2>',
        html_table(None, [list(row) for row in summary(record)]),
        "</section>",
    ]
    titles = {"loss": "Loss", "throughput": "Throughput", "pipeline": "Pipeline"}
    for section in titles:
        figures = [html_figure(caption, path) for sid, caption, path in plots if sid == section]
        if figures:
            parts.append(f'<section id="{section}"><h2>{titles[section]}</h2>{"".join(figures)}</section>')
    parts.append(f'<section id="steps"><h2>Per-step metrics</h2><details><summary>{len(record.train)} logged steps'
                 f"</summary>{step_table(record)}</details></section>")
    groups = record.directory / GROUP_TABLE
    if groups.is_file():
        parts.append(f'<section id="optimizer-groups"><h2>Optimizer parameter groups</h2>'
                     f"<pre>{html.escape(groups.read_text())}</pre></section>")
    parts.append(f'<section id="config"><h2>Resolved config ({runs.CONFIG_FILE})</h2>'
                 f"<pre>{html.escape(record.config_text)}</pre></section>")
    return html_page(f"titan-async run {record.directory.resolve().name}", parts)


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


def write_report(directory: Path, out: Path | None = None) -> Path:
    """Write the report of the run in `directory` to `out` (default RUN/report/report.html),
    its PNGs into the same folder, and return the HTML path.

    Raises UserError if `directory` is not a run directory, has logged no training step,
    or `out` is a directory.
    """
    record = read_run(directory)
    out = page_path(out or directory / "report" / "report.html")
    runs.write_atomic(out, render_html(record, draw_plots(record, out.parent)))
    return out
