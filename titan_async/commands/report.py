"""`titan-async report`: one self-contained HTML page, with its plots as PNGs beside it,
that shows how a run went without starting TensorBoard."""

from __future__ import annotations

import html
import shutil
import statistics
from pathlib import Path

from titan_async.commands.pages import html_figure, html_page, html_table, line_chart, page_path
from titan_async.rundir import directory as runs
from titan_async.rundir.benchmarks import HEADER, read_results, table_rows
from titan_async.pipeline.config import sync_start_text
from titan_async.rundir.record import (
    BUBBLE, MEMORY, STALENESS, STALENESS_MAX, THROUGHPUT, TRAIN_LOSS, VALIDATION_LOSS, RunRecord, read_run, series,
    set_aside_fragments, stage_series, unlogged_steps,
)

GROUP_TABLE = "optimizer_groups.txt"
TIMELINE = Path("pipeline") / "timeline.png"
MISSING_SHOWN = 10
"""The most steps without a row that the summary names."""


def draw_plots(record: RunRecord, folder: Path) -> list[tuple[str, str, Path]]:
    """Write the run's PNGs into `folder`; returns (section id, caption, file) of each."""
    plots = []
    loss_lines = [("training loss", *series(record.train, TRAIN_LOSS))]
    if record.validation:
        loss_lines.append(("validation loss", *series(record.validation, VALIDATION_LOSS)))
        loss_lines += [(f"validation loss, {name}", *steps_losses) for name, steps_losses in source_series(record).items()]
    line_chart(folder / "loss.png", "loss", "cross-entropy", loss_lines)
    plots.append(("loss", "Training loss and validation loss per step", folder / "loss.png"))
    line_chart(folder / "throughput.png", "throughput", "tokens/s per device",
               [("tokens/s per device", *series(record.train, THROUGHPUT))])
    plots.append(("throughput", "Tokens per second per device (torchtitan's throughput(tps))", folder / "throughput.png"))
    if record.stage_bubbles:
        lines = [(f"stage {stage}", sorted(b), [b[s] for s in sorted(b)]) for stage, b in sorted(record.stage_bubbles.items())]
        line_chart(folder / "bubble.png", "pipeline bubble", "idle share of the step", lines)
        plots.append(("pipeline", "Measured pipeline bubble per stage (its first rank)", folder / "bubble.png"))
    staleness = _staleness_lines(record)
    if staleness:
        line_chart(folder / "staleness.png", "gradient staleness", "optimizer steps", staleness)
        plots.append(("pipeline", "Staleness of the applied gradients per stage, in optimizer steps between the weights a "
                      "gradient was taken at and those it updates: mean and largest since the previous logged step",
                      folder / "staleness.png"))
    if (record.directory / TIMELINE).is_file():
        shutil.copyfile(record.directory / TIMELINE, folder / "timeline.png")
        plots.append(("pipeline", "Pipeline timeline of the traced steps: forwards blue, backwards green, optimizer steps red",
                      folder / "timeline.png"))
    return plots


def source_series(record: RunRecord) -> dict[str, tuple[list[int], list[float]]]:
    """A token mixture's sources by name -> (steps, validation losses), as `validation_metrics/loss/<name>` logged them."""
    prefix = f"{VALIDATION_LOSS}/"
    names = sorted({key.removeprefix(prefix) for row in record.validation.values() for key in row if key.startswith(prefix)})
    return {name: series(record.validation, prefix + name) for name in names}


def _staleness_lines(record: RunRecord) -> list[tuple[str, list[int], list[float]]]:
    """(label, steps, values): each stage's mean and largest staleness (streaming runs only)."""
    lines = []
    for prefix, what in ((STALENESS, "mean"), (STALENESS_MAX, "largest")):
        lines += [(f"stage {stage} {what}", *steps_values) for stage, steps_values in stage_series(record.train, prefix).items()]
    return lines


def schedule_summary(config: dict) -> str:
    """The run's schedule in words: the pipeline schedule and its stages, or the delayed-gradient
    rule, or none; with Sync Start, its synchronous steps first."""
    p, t = config.get("parallelism", {}), config.get("training", {})
    stages = p.get("emulated_stages") or p.get("pipeline_parallel_degree", 1)
    if stages > 1:
        schedule = f"{p.get('pipeline_parallel_schedule')} on {stages} stages{' (emulated)' if p.get('emulated_stages') else ''}"
    else:
        schedule = "training.gradient_delay = 1" if t.get("gradient_delay") else "no pipeline, synchronous"
    sync_start = t.get("sync_start_steps", 0)
    return sync_start_text(sync_start, schedule) if sync_start else schedule


def summary(record: RunRecord) -> list[tuple[str, str]]:
    """(label, value) rows: steps, schedule, losses, throughput, memory, bubble, stop."""
    last = max(record.train)
    configured = record.config.get("training", {}).get("steps", "?")
    world = record.launch.get("world_size", record.launch.get("nproc_per_node", 1))
    _, train_losses = series(record.train, TRAIN_LOSS)
    rows = [
        ("run directory", str(record.directory)),
        ("steps logged", f"{last} of {configured}"),
        *_record_gaps(record),
        ("processes", str(world)),
        ("schedule", schedule_summary(record.config)),
        ("first training loss", f"{train_losses[0]:.4f}"),
        ("final training loss", f"{train_losses[-1]:.4f} (step {last})"),
    ]
    val_steps, val_losses = series(record.validation, VALIDATION_LOSS)
    if val_steps:
        rows.append(("final validation loss", f"{val_losses[-1]:.4f} (step {val_steps[-1]})"))
        rows.append(("best validation loss", f"{min(val_losses):.4f}"))
    for name, (steps, source_losses) in source_series(record).items():
        rows.append((f"final validation loss, {name}", f"{source_losses[-1]:.4f} (step {steps[-1]})"))
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


def _record_gaps(record: RunRecord) -> list[tuple[str, str]]:
    """Rows on what metrics.jsonl lacks: the logging steps without a row, and the rows cut short
    by a killed run that were set aside."""
    rows = []
    expected, missing = unlogged_steps(record)
    if missing:
        shown = ", ".join(map(str, missing[:MISSING_SHOWN])) + (", ..." if len(missing) > MISSING_SHOWN else "")
        rows.append(("rows missing", f"{expected - len(missing)} of {expected} steps logged ({len(missing)} missing: {shown})"))
    fragments = set_aside_fragments(record)
    if fragments:
        rows.append(("rows cut short", f"{fragments[1]} set aside in {fragments[0]} (a run killed while writing)"))
    return rows


def _number(value: float | None, form: str = "{:.4f}") -> str:
    return "" if value is None else form.format(value)


def step_table(record: RunRecord) -> str:
    """Every logged step's scalars as an HTML table: the plotted series as numbers."""
    lr_keys = sorted({key for row in record.train.values() for key in row if key.startswith("lr/")})
    staleness_keys = [f"{prefix}{stage}" for prefix in (STALENESS, STALENESS_MAX) for stage in stage_series(record.train, prefix)]
    rows = []
    for step in sorted(record.train):
        row, validation = record.train[step], record.validation.get(step, {})
        rows.append([
            str(step), _number(row.get(TRAIN_LOSS)), _number(validation.get(VALIDATION_LOSS)),
            _number(row.get("grad_norm")), _number(row.get(THROUGHPUT), "{:,.0f}"),
            *(_number(row.get(key), "{:.4g}") for key in lr_keys + staleness_keys),
        ])
    return html_table(["step", "training loss", "validation loss", "grad norm", "tokens/s", *lr_keys, *staleness_keys], rows)


def render_html(record: RunRecord, plots: list[tuple[str, str, Path]]) -> str:
    """The page: summary, plots, benchmark results (if any), per-step table, optimizer groups
    and resolved config."""
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
    benchmarks = read_results(record.directory)
    if benchmarks:
        parts.append('<section id="benchmarks"><h2>Benchmarks (eval --tasks, lm-evaluation-harness)</h2>'
                     f"{html_table(HEADER, table_rows(benchmarks))}</section>")
    parts.append(f'<section id="steps"><h2>Per-step metrics</h2><details><summary>{len(record.train)} logged steps'
                 f"</summary>{step_table(record)}</details></section>")
    groups = record.directory / GROUP_TABLE
    if groups.is_file():
        parts.append(f'<section id="optimizer-groups"><h2>Optimizer parameter groups</h2>'
                     f"<pre>{html.escape(groups.read_text())}</pre></section>")
    parts.append(f'<section id="config"><h2>Resolved config ({runs.CONFIG_FILE})</h2>'
                 f"<pre>{html.escape(record.config_text)}</pre></section>")
    return html_page(f"titan-async run {record.directory.resolve().name}", parts)


def write_report(directory: Path, out: Path | None = None) -> Path:
    """Write the report of the run in `directory` to `out` (default RUN/report/report.html),
    its PNGs into the same folder, and return the HTML path.

    Raises UserError if `directory` is not a run directory, has logged no training step,
    or `out` is a directory or cannot be written.
    """
    record = read_run(directory)
    with runs.writing(*(("--out", out) if out else ("--run-dir", directory))):
        out = page_path(out or directory / "report" / "report.html")
        runs.write_atomic(out, render_html(record, draw_plots(record, out.parent)))
    return out
