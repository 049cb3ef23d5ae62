"""`titan-async eval --tasks`: lm-evaluation-harness benchmarks of a checkpoint, in this process.

The checkpoint becomes a transformers model (Llama, Qwen3-MoE) in memory through `model.hf_conversion`
(the weights, config and tokenizer that `export` writes; nothing is written to disk)
and runs through lm-eval's own `HFLM`, so the results are those of `lm_eval --model hf` on the
export. A task is a name lm-eval knows (its data set downloaded by `datasets` on first use) or
a task YAML file (`dataset_path: json` on local jsonl files works offline). Results go to
RUN/benchmarks/step-N.json (`run.benchmarks`).
"""

from __future__ import annotations

import json
from importlib.metadata import version
from pathlib import Path

import datasets
import lm_eval
import torch
import transformers
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager
from rich.console import Console
from rich.table import Table

from titan_async.commands.evaluate.memory import check_cpu_memory
from titan_async.core.errors import UserError
from titan_async.model.hf_conversion import conversion, hf_fast_tokenizer, read_hf_tensors
from titan_async.rundir.benchmarks import HEADER, result_rows, save_results
from titan_async.rundir.checkpoints import named_step

HARNESS = f"lm-eval {version('lm-eval')}"
EVAL_DTYPE = torch.float32
"""The dtype the evaluated model is held and run in."""
TASK_FILE_SUFFIXES = (".yaml", ".yml")


def parse_tasks(text: str) -> list[str]:
    """The comma-separated task names and YAML files of --tasks; UserError when none is given or
    a YAML file does not exist."""
    specs = list(dict.fromkeys(spec.strip() for spec in text.split(",") if spec.strip()))
    if not specs:
        raise UserError(f"--tasks {text!r}: no task given")
    for spec in specs:
        if spec.endswith(TASK_FILE_SUFFIXES) and not Path(spec).is_file():
            raise UserError(f"--tasks {spec}: no such task file")
    return specs


def _one_line(err: Exception) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0] if lines else ''}"


def load_tasks(specs: list[str]) -> tuple[TaskManager, list]:
    """lm-eval's task manager and the top-level tasks and groups of `specs`, their data sets
    loaded; UserError naming the task that is unknown or whose data cannot be loaded (a
    download while offline)."""
    manager = TaskManager(include_defaults=any(not spec.endswith(TASK_FILE_SUFFIXES) for spec in specs))
    built = []
    for spec in specs:
        if not spec.endswith(TASK_FILE_SUFFIXES) and spec not in manager.all_tasks:
            raise UserError(f"--tasks {spec}: no task, group or tag of that name in {HARNESS}, and not a .yaml file")
        try:
            loaded = manager.load([spec])
        except ConnectionError as err:
            raise UserError(f"--tasks {spec}: its data set needs a download, which failed (offline?): {_one_line(err)}") from None
        except Exception as err:
            raise UserError(f"--tasks {spec}: cannot load the task: {_one_line(err)}") from None
        children = {child for names in loaded["group_map"].values() for child in names}
        built += [item for name, item in {**loaded["groups"], **loaded["tasks"]}.items() if name not in children]
    return manager, built


def hf_model(checkpoint: Path) -> tuple[transformers.PreTrainedModel, transformers.PreTrainedTokenizerFast]:
    """`checkpoint` as a transformers model in `EVAL_DTYPE` and its tokenizer, built in memory from
    what `export` would write (UserError as `export` gives one), each file read once and checked
    against its recorded checksum as it is read (UserError naming a file that does not match)."""
    hf = conversion(checkpoint, str(EVAL_DTYPE).removeprefix("torch."))
    state = read_hf_tensors(checkpoint, hf.adapter, hf.entries, list(hf.entries), verified=True)
    transformers.utils.logging.disable_progress_bar()
    model_class = getattr(transformers, hf.config["architectures"][0])
    model = model_class.from_pretrained(None, config=model_class.config_class(**hf.config), state_dict=state, dtype=EVAL_DTYPE)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=hf_fast_tokenizer(hf.tokenizer_source, hf.tokenizer),
        bos_token=hf.tokenizer.bos_token,
        eos_token=hf.tokenizer.eos_token,
    )
    return model.eval(), tokenizer


def task_results(output: dict, limit: int | None) -> dict[str, dict]:
    """lm-eval's results as task name -> {"metrics", "stderr", "num_fewshot", "samples",
    "limit"} (metric names without the "none" filter, other filters as "metric,filter")."""
    tasks = {}
    for name, values in output["results"].items():
        metrics, stderr = {}, {}
        for key, value in values.items():
            metric, _, filter_name = key.partition(",")
            if not filter_name or metric.endswith("_stderr"):
                continue
            label = metric if filter_name == "none" else key
            metrics[label] = float(value) if isinstance(value, (int, float)) else None
            error = values.get(f"{metric}_stderr,{filter_name}")
            stderr[label] = float(error) if isinstance(error, (int, float)) else None
        samples = output.get("n-samples", {}).get(name, {}).get("effective")
        tasks[name] = {"metrics": metrics, "stderr": stderr, "num_fewshot": output.get("n-shot", {}).get(name),
                       "samples": samples, "limit": limit}
    return tasks


def print_table(checkpoint: Path, step: int, tasks: dict[str, dict], path: Path) -> None:
    table = Table(title=f"eval {checkpoint} ({HARNESS})")
    for column in HEADER:
        table.add_column(column, justify="left" if column in ("task", "metric") else "right")
    for name, result in tasks.items():
        for row in result_rows(step, name, result):
            table.add_row(*row)
    console = Console()
    console.print(table)
    console.print(f"results: {path}", soft_wrap=True)  # a path stays on one line


def evaluate_tasks(checkpoint: Path, tasks: str, *, limit: int | None, num_fewshot: int | None,
                   batch_size: int, device: str | None, as_json: bool) -> int:
    """Run lm-eval's `tasks` (the --tasks text) on `checkpoint` on the torch `device` (None: the
    GPU when there is one), store the results in its run directory and print them (one JSON
    object with `as_json`, else a table); the exit status."""
    specs = parse_tasks(tasks)
    if device not in (None, "cpu") and int(device.partition(":")[2] or 0) >= torch.cuda.device_count():
        raise UserError(f"--device {device}: no such GPU (this process sees {torch.cuda.device_count()})")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        check_cpu_memory(checkpoint, EVAL_DTYPE)
    step = named_step(checkpoint)  # the model's files are verified as they are read (`hf_model`)
    datasets.disable_progress_bars()  # lm-eval's own bar shows the progress
    manager, built = load_tasks(specs)
    model, tokenizer = hf_model(checkpoint)
    model.to(device)
    output = lm_eval.simple_evaluate(
        model=HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size),
        tasks=built, task_manager=manager, num_fewshot=num_fewshot, limit=limit, log_samples=False,
    )
    results = task_results(output, limit)
    path = save_results(checkpoint.parent.parent, step, checkpoint, HARNESS, results)
    if as_json:
        print(json.dumps({"checkpoint": str(checkpoint), "step": step, "harness": HARNESS, "results": str(path), "tasks": results}))
    else:
        print_table(checkpoint, step, results, path)
    return 0
