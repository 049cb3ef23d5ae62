"""`titan-async eval --tasks`: lm-evaluation-harness on a checkpoint in process.

The reference is lm-eval's own Hugging Face path (`simple_evaluate(model="hf")`, what
`lm_eval --model hf` runs) on the directory `titan-async export` wrote. The task is a local
multiple-choice YAML on jsonl files, evaluated offline.
"""

from __future__ import annotations

import builtins
import io
import json
import random
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import CONFIGS, TINY, cli_in_process, run_cli, sets
from test_bad_input import fail
from titan_async import cli

STEPS = 4
TASK = "tiny_choice"
LIMIT, FEWSHOT = 30, 2
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
WORDS = ("import", "return", "class", "value", "print", "self", "data", "file", "list", "None", "error", "test")


def write_task(folder: Path, dataset_path: str = "json") -> Path:
    """A multiple-choice task YAML on local train (few-shot) and test jsonl files: a code-like
    prefix and four one-word continuations, the target drawn at random."""
    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    for split, count in (("train", 8), ("test", 40)):
        items = []
        for _ in range(count):
            question = f"{rng.choice(WORDS)} = {rng.choice(WORDS)}({rng.choice(WORDS)}, "
            choices = rng.sample(WORDS, 4)
            items.append({"question": question, "choices": choices, "answer": rng.randrange(4)})
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(item) + "\n" for item in items))
    yaml = folder / f"{TASK}.yaml"
    yaml.write_text(
        f"task: {TASK}\ndataset_path: {dataset_path}\n"
        f"dataset_kwargs:\n  data_files:\n    train: {folder / 'train.jsonl'}\n    test: {folder / 'test.jsonl'}\n"
        "training_split: train\ntest_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )
    return yaml


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path, Path, Path]:
    """(run directory, its last checkpoint, the export of that checkpoint, the task YAML)."""
    root = tmp_path_factory.mktemp("benchmark")
    run_cli("train", "--run-dir", str(root / "run"), *sets(*TINY, f"training.steps={STEPS}", "validation.enable=false"))
    checkpoint = root / "run" / "checkpoint" / f"step-{STEPS}"
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["export", "--checkpoint", str(checkpoint), "--out", str(root / "hf")])
    assert exit_info.value.code == 0
    return root / "run", checkpoint, root / "hf", write_task(root / "task")


def reference(export: Path, yaml: Path, limit: int = LIMIT, num_fewshot: int | None = FEWSHOT) -> dict:
    """lm-eval's results of the task on the export, through its own Hugging Face model loader."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    output = simple_evaluate(
        model="hf", model_args=f"pretrained={export},dtype=float32", tasks=[TASK],
        task_manager=TaskManager(include_path=str(yaml.parent), include_defaults=False),
        limit=limit, num_fewshot=num_fewshot, log_samples=False, device="cuda" if torch.cuda.is_available() else "cpu",
    )
    return output["results"][TASK]


def test_accuracy_equals_lm_eval_hf_on_the_export(trained, capsys):
    run_dir, checkpoint, export, yaml = trained
    result = run_cli("eval", "--checkpoint", str(checkpoint), "--tasks", str(yaml), "--limit", str(LIMIT),
                     "--num-fewshot", str(FEWSHOT), "--json", env=OFFLINE)
    ours = json.loads(result.stdout)
    task = ours["tasks"][TASK]
    theirs = reference(export, yaml)
    assert task["metrics"] == {"acc": theirs["acc,none"], "acc_norm": theirs["acc_norm,none"]}
    assert task["stderr"] == {"acc": theirs["acc_stderr,none"], "acc_norm": theirs["acc_norm_stderr,none"]}
    assert (task["samples"], task["num_fewshot"], ours["step"]) == (LIMIT, FEWSHOT, STEPS)

    stored = json.loads((run_dir / "benchmarks" / f"step-{STEPS}.json").read_text())
    assert ours["results"] == str(run_dir / "benchmarks" / f"step-{STEPS}.json")
    assert stored["tasks"] == ours["tasks"] and stored["step"] == STEPS

    status, _, err = cli_in_process(capsys, "report", "--run-dir", str(run_dir))
    assert status == 0, err
    page = (run_dir / "report" / "report.html").read_text()
    assert '<section id="benchmarks">' in page
    assert f"<td>{STEPS}</td><td>{TASK}</td><td>acc</td><td>{theirs['acc,none']:.4f}</td>" in page

    status, out, err = cli_in_process(capsys, "compare", str(run_dir), "--json", "--target", "100")
    assert status == 0, err
    assert json.loads(out)["runs"][0]["benchmarks"][TASK]["metrics"]["acc"] == theirs["acc,none"]
    status, out, err = cli_in_process(capsys, "compare", str(run_dir), "--target", "100")
    assert status == 0, err
    assert [TASK, "acc", f"{theirs['acc,none']:.4f}", "(step", f"{STEPS})"] in [line.split() for line in out.splitlines()]


def test_a_table_without_json(trained, capsys):
    _, checkpoint, _, yaml = trained
    status, out, err = cli_in_process(capsys, "eval", "--checkpoint", str(checkpoint), "--tasks", str(yaml), "--limit", "4")
    assert status == 0, err
    cells = [[cell.strip() for cell in line.split("│") if cell.strip()] for line in out.splitlines()]
    assert [str(STEPS), TASK, "acc_norm"] in [row[:3] for row in cells]
    assert f"results: {checkpoint.parent.parent / 'benchmarks' / f'step-{STEPS}.json'}" in out.splitlines()


def test_unknown_task_is_one_line(trained, capsys):
    _, checkpoint, _, _ = trained
    err = fail(capsys, "eval", "--checkpoint", str(checkpoint), "--tasks", "no_such_task")
    assert err.startswith("titan-async: --tasks no_such_task: no task, group or tag of that name")
    err = fail(capsys, "eval", "--checkpoint", str(checkpoint), "--tasks", "missing/task.yaml")
    assert err == "titan-async: --tasks missing/task.yaml: no such task file"


def test_a_task_that_needs_a_download_fails_in_one_line_offline(trained, tmp_path):
    _, checkpoint, _, _ = trained
    yaml = write_task(tmp_path, dataset_path="Rowan/hellaswag")
    result = run_cli("eval", "--checkpoint", str(checkpoint), "--tasks", str(yaml), check=False, env=OFFLINE)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith(f"titan-async: --tasks {yaml}: its data set needs a download, which failed")
    assert len(result.stderr.splitlines()) == 1


def test_missing_extra_is_one_line_naming_it(trained, capsys, monkeypatch):
    _, checkpoint, _, yaml = trained
    monkeypatch.delitem(sys.modules, "titan_async.commands.evaluate.tasks", raising=False)
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    err = fail(capsys, "eval", "--checkpoint", str(checkpoint), "--tasks", str(yaml))
    assert err == "titan-async: --tasks: needs the optional extra `eval` (lm_eval is not installed): pip install 'titan-async[eval]'"


@pytest.mark.parametrize("argument, value", [("--limit", "0"), ("--limit", "ten"), ("--num-fewshot", "-1")])
def test_bad_counts_are_one_line(argument, value, capsys):
    status, _, err = cli_in_process(capsys, "eval", "--checkpoint", "x", "--tasks", "t", argument, value)
    assert status == 2 and len(err.strip().splitlines()) == 1
    assert f"argument {argument}" in err


def test_counts_without_tasks_are_one_line(capsys):
    err = fail(capsys, "eval", "--checkpoint", "x", "--limit", "3")
    assert err == "titan-async: --limit: applies only with --tasks"


def tensorboard_scalars(folder: Path, tag: str) -> dict[int, float]:
    """Step -> value of scalar `tag` in every TensorBoard event file under `folder`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    values = {}
    for events in folder.rglob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        if tag in accumulator.Tags()["scalars"]:
            values.update({event.step: event.value for event in accumulator.Scalars(tag)})
    return values


def test_benchmarks_during_training_with_2bw_on_pp2(tmp_path):
    """`[eval]` with PipeDream2BW on PP 2: the task's accuracy is logged at steps 3 and 6
    (metrics.jsonl rows of kind "benchmark", TensorBoard, RUN/benchmarks), and equals lm-eval's
    Hugging Face path on the export of each step's checkpoint."""
    yaml = write_task(tmp_path / "task")
    run_dir = tmp_path / "run"
    result = run_cli("train", "--config", str(CONFIGS / "debug_cpu_pp2.toml"), "--nproc-per-node", "2", "--run-dir", str(run_dir),
                     *sets(*TINY, "parallelism.pipeline_parallel_schedule=PipeDream2BW", "training.steps=6", "checkpoint.interval=3",
                           "validation.enable=false", f'eval.tasks=["{yaml}"]', f"eval.limit={LIMIT}", f"eval.num_fewshot={FEWSHOT}"),
                     env=OFFLINE)
    rows = {row["step"]: row for row in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if row["kind"] == "benchmark"}
    assert sorted(rows) == [3, 6], result.stderr[-3000:]
    assert f"benchmark step 3 | {TASK}/acc" in result.stdout
    logged = tensorboard_scalars(run_dir / "tb", f"benchmark/{TASK}/acc")
    for step in (3, 6):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["export", "--checkpoint", str(run_dir / "checkpoint" / f"step-{step}"), "--out", str(tmp_path / f"hf-{step}")])
        assert exit_info.value.code == 0
        theirs = reference(tmp_path / f"hf-{step}", yaml)
        assert rows[step][f"benchmark/{TASK}/acc"] == theirs["acc,none"]
        assert rows[step][f"benchmark/{TASK}/acc_norm"] == theirs["acc_norm,none"]
        assert logged[step] == pytest.approx(theirs["acc,none"])  # TensorBoard stores float32
        stored = json.loads((run_dir / "benchmarks" / f"step-{step}.json").read_text())["tasks"][TASK]
        assert stored["metrics"]["acc"] == theirs["acc,none"] and stored["samples"] == LIMIT


@pytest.mark.parametrize("assignment, named", [
    ('eval.tasks=["missing.yaml"]', "eval.tasks: no such task file missing.yaml"),
    ("eval.freq=4", "eval.freq (4) must be a multiple of checkpoint.interval (3)"),
    ("checkpoint.enable=false", "eval.tasks evaluates the run's checkpoints; set checkpoint.enable = true"),
    ("eval.limit=0", "eval.limit: expected a positive integer, got 0"),
])
def test_a_bad_eval_section_is_one_line(tmp_path, capsys, assignment, named):
    yaml = write_task(tmp_path / "task")
    err = fail(capsys, "train", "--run-dir", str(tmp_path / "run"),
               *sets(*TINY, "checkpoint.interval=3", f'eval.tasks=["{yaml}"]', assignment))
    assert named in err, err
    assert not (tmp_path / "run").exists()


SLOW_LOADER = '''
import os, time
from pathlib import Path
import datasets

def load(data_files, **metadata):
    """The task's data once SLOW_TASK_UNTIL exists and SLOW_TASK_GONE does not (at most 120 s),
    after appending the checkpoint folder's step directories then to SLOW_TASK_SEEN."""
    until, gone = Path(os.environ["SLOW_TASK_UNTIL"]), Path(os.environ["SLOW_TASK_GONE"])
    deadline = time.monotonic() + 120
    while (not until.exists() or gone.exists()) and time.monotonic() < deadline:
        time.sleep(0.2)
    steps = sorted(p.name for p in gone.parent.glob("step-*"))
    with open(os.environ["SLOW_TASK_SEEN"], "a") as seen:
        seen.write(" ".join(steps) + "\\n")
    return datasets.load_dataset("json", data_files=data_files)
'''


def write_slow_task(folder: Path) -> Path:
    """`write_task`'s task, loaded through `SLOW_LOADER`: an evaluation that waits for training."""
    yaml = write_task(folder)
    (folder / "slow.py").write_text(SLOW_LOADER)
    text = yaml.read_text().replace("dataset_path: json\n", "custom_dataset: !function slow.load\n")
    yaml.write_text(text)
    return yaml


def test_a_slow_evaluation_keeps_its_checkpoint_and_training_goes_on(tmp_path):
    """`[eval]` on every checkpoint with keep_latest_k = 2 (torchtitan's least) on PP 2 (rank 0
    purges, rank 1 evaluates), the evaluation of step 1 held until step 5 is saved and step 3
    purged: step 1 is still there when it is read, and deleted after; steps 2 to 4 are skipped
    with a warning each (eval.max_pending = 1: step 5 waits); training goes on and finishes."""
    yaml = write_slow_task(tmp_path / "task")
    run_dir = tmp_path / "run"
    checkpoints = run_dir / "checkpoint"
    env = {**OFFLINE, "SLOW_TASK_UNTIL": str(checkpoints / "step-5" / ".metadata"),
           "SLOW_TASK_GONE": str(checkpoints / "step-3"), "SLOW_TASK_SEEN": str(tmp_path / "seen.txt")}
    result = run_cli("train", "--config", str(CONFIGS / "debug_cpu_pp2.toml"), "--nproc-per-node", "2", "--run-dir", str(run_dir),
                     *sets(*TINY, "training.steps=5", "checkpoint.interval=1", "checkpoint.keep_latest_k=2",
                           "validation.enable=false", f'eval.tasks=["{yaml}"]', "eval.limit=2", "eval.num_fewshot=0"),
                     env=env, timeout=180)
    output = result.stdout + result.stderr
    rows = [row["step"] for row in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if row["kind"] == "benchmark"]
    assert rows == [1, 5], output[-3000:]
    assert (tmp_path / "seen.txt").read_text().splitlines()[0].split() == ["step-1", "step-4", "step-5"]
    for step in (2, 3, 4):
        assert f"the benchmark of step {step} is skipped: the evaluations fall behind (eval.max_pending = 1" in output
    assert sorted(p.name for p in checkpoints.iterdir()) == ["pins", "step-4", "step-5"]
    assert list((checkpoints / "pins").iterdir()) == []


def test_the_evaluation_device_is_never_a_training_rank_gpu():
    from titan_async.core.errors import UserError
    from titan_async.train.eval_device import eval_device

    assert eval_device("cpu", 8, 8) == "cpu"
    assert eval_device("cuda:7", 4, 8) == "cuda:7"
    for device, workers, gpus in (("cuda:3", 4, 8), ("cuda", 4, 8), ("cuda:0", 2, 1)):
        with pytest.raises(UserError, match=f"eval.device = '{device}' is a training rank's GPU on this node"):
            eval_device(device, workers, gpus)
    for device, workers, gpus in (("cuda:8", 4, 8), ("cuda:0", 1, 0)):
        with pytest.raises(UserError, match="no such GPU on this node"):
            eval_device(device, workers, gpus)


def test_a_training_rank_gpu_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    from titan_async.train import eval_device

    monkeypatch.setattr(eval_device, "visible_gpus", lambda: 4)
    yaml = write_task(tmp_path / "task")
    err = fail(capsys, "train", "--config", str(CONFIGS / "debug_cpu_pp2.toml"), "--nproc-per-node", "2", "--run-dir", str(tmp_path / "run"),
               *sets(*TINY, f'eval.tasks=["{yaml}"]', "eval.device=cuda:1"))
    assert err.endswith("eval.device = 'cuda:1' is a training rank's GPU on this node (its 2 rank(s) use cuda:0..cuda:1); "
                        'a spare GPU is cuda:2..cuda:3, or use "cpu"'), err
    assert not (tmp_path / "run").exists()


def test_a_model_larger_than_this_nodes_memory_is_refused_on_the_cpu_before_anything_is_read(tmp_path, capsys):
    """`eval --tasks --device cpu` of the Llama-3-70B-shaped config (70,553,706,496 parameters, as
    its header counts them: 263 GiB in float32, 329 GiB with the stated 25% margin) on a node with
    less available memory: one line naming both, before the checkpoint (here an empty folder) is
    read and before anything is allocated (the parameters are counted on the meta device)."""
    import psutil

    run_dir = tmp_path / "run"
    (run_dir / "checkpoint" / "step-10").mkdir(parents=True)
    (run_dir / "config.toml").write_text((CONFIGS / "70b_2bw_muon.toml").read_text())
    need_gib = 70_553_706_496 * 4 * 1.25 / 2**30
    assert psutil.virtual_memory().available < need_gib * 2**30  # the premise: this node cannot hold it
    err = fail(capsys, "eval", "--checkpoint", str(run_dir / "checkpoint" / "step-10"), "--tasks", str(write_task(tmp_path / "task")),
               "--device", "cpu")
    assert err.startswith(f"titan-async: --checkpoint {run_dir / 'checkpoint' / 'step-10'}: evaluating on the CPU holds the "
                          f"model's 70,553,706,496 parameters in float32, about {need_gib:.3g} GiB with the evaluation's 25% margin, "
                          "but this node has "), err
    assert "GiB of available RAM; evaluate on a GPU (--device cuda:N) or on a node with more memory" in err


class CountedFile(io.FileIO):
    """A file whose bytes read are added up in `READ` under its name."""

    def readinto(self, buffer):
        read = super().readinto(buffer)
        READ[Path(self.name).name] = READ.get(Path(self.name).name, 0) + (read or 0)
        return read

    def readall(self):
        data = super().readall()
        READ[Path(self.name).name] = READ.get(Path(self.name).name, 0) + len(data)
        return data


READ: dict[str, int] = {}


def count_reads(monkeypatch, folder: Path) -> dict[str, int]:
    """Count the bytes read from the DCP data files in `folder` (file name -> bytes) by every
    `open` of Python and pathlib from now on."""
    opened = io.open

    def counting_open(file, mode="r", *args, **kwargs):
        path = Path(file) if isinstance(file, (str, Path)) else None
        if path is not None and path.parent == folder and path.suffix == ".distcp" and mode == "rb":
            return io.BufferedReader(CountedFile(path))
        return opened(file, mode, *args, **kwargs)

    READ.clear()
    monkeypatch.setattr(builtins, "open", counting_open)
    monkeypatch.setattr(io, "open", counting_open)
    return READ


def model_files(checkpoint: Path) -> set[str]:
    """The data files that hold the model's entries, by DCP's metadata (the rest: optimizer, schedule, data state)."""
    from torch.distributed.checkpoint import FileSystemReader

    storage = FileSystemReader(str(checkpoint)).read_metadata().storage_data
    other = ("optimizer", "lr_scheduler", "dataloader", "train_state")
    return {info.relative_path for index, info in storage.items() if not index.fqn.startswith(other)}


def test_the_evaluation_reads_each_model_file_once_checking_it_against_its_checksum(trained, capsys, monkeypatch, tmp_path):
    """`eval --tasks` verifies the files it loads while it reads them: each data file that holds
    model entries is read exactly once, whole (its checksum covers it whole), and no other data
    file at all (counted by wrapping `open`). Before, every file was read whole for its checksum
    and the load read the model's pieces again. A byte flipped in a copy of the checkpoint is
    refused in one line naming the file."""
    _, checkpoint, _, yaml = trained
    sizes = {path.name: path.stat().st_size for path in checkpoint.glob("*.distcp")}
    read = count_reads(monkeypatch, checkpoint)
    status, out, err = cli_in_process(capsys, "eval", "--checkpoint", str(checkpoint), "--tasks", str(yaml), "--limit", "2", "--json")
    monkeypatch.undo()
    assert status == 0, err
    assert json.loads(out)["tasks"][TASK]["samples"] == 2
    assert read == {name: sizes[name] for name in model_files(checkpoint)}, (read, sizes)

    damaged = shutil.copytree(checkpoint.parent.parent, tmp_path / "run") / "checkpoint" / checkpoint.name
    data = bytearray((damaged / "__0_0.distcp").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (damaged / "__0_0.distcp").write_bytes(data)
    err = fail(capsys, "eval", "--checkpoint", str(damaged), "--tasks", str(yaml), "--limit", "2")
    assert err == f"titan-async: --checkpoint {damaged}: cannot read the checkpoint (__0_0.distcp does not match its checksum (damaged in place))"


def evaluation_of(checkpoint: Path, yaml: Path, **options):
    """`benchmark_process.evaluate` of `checkpoint` (step STEPS, one rank), 2 examples on the CPU."""
    from titan_async.train.benchmark_process import evaluate
    from titan_async.train.benchmarks import EvalSection

    section = EvalSection(tasks=[str(yaml)], limit=2, num_fewshot=0, batch_size=1)
    return evaluate(checkpoint, STEPS, section, "cpu", checkpoint.parent.parent / "logs" / f"eval-step-{STEPS}.log", 1, **options)


def test_a_benchmark_waits_for_every_ranks_checksums_and_fails_in_one_line_when_they_do_not_come(trained, tmp_path, caplog):
    """A benchmark queued right after its save, before the ranks have recorded their checksums
    (rank 0's manifest is put back only after the evaluation was started), waits for them and
    evaluates; one whose checksums never come fails after the timeout with one line, logged and
    recorded as the step's benchmark failure in RUN/benchmarks/step-N.json."""
    import threading

    run_dir = shutil.copytree(trained[0], tmp_path / "run")
    checkpoint = run_dir / "checkpoint" / f"step-{STEPS}"
    manifest = checkpoint / "checksums.rank0.json"
    recorded = manifest.read_text()
    manifest.unlink()
    result = {}
    started = threading.Thread(target=lambda: result.update(tasks=evaluation_of(checkpoint, trained[3])))
    started.start()
    time.sleep(1)
    manifest.write_text(recorded)
    started.join()
    assert result["tasks"][TASK]["samples"] == 2, (run_dir / "logs" / f"eval-step-{STEPS}.log").read_text()[-3000:]

    manifest.unlink()
    assert evaluation_of(checkpoint, trained[3], timeout_s=0.5) is None
    line = (f"the benchmark of step {STEPS} failed: rank(s) 0 did not record their checksums of {checkpoint} "
            "(checksums.rank0.json) within 0.5 s")
    assert line in caplog.text
    assert json.loads((run_dir / "benchmarks" / f"step-{STEPS}.json").read_text())["failure"] == line
