"""`resume --set optimizer.*`: every key either applies from the first resumed step or is refused
in one line before launch; never a silent revert to the checkpoint's value."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from operator import attrgetter

import pytest
import torch
import torch.distributed.checkpoint as dcp

from conftest import CONFIGS, REPO, TINY, checkpoint_weights, fresh_environment, losses, metrics, run_cli, sets

from titan_async.config.run_config import load_run_config
from titan_async.optim.section import ON_RESUME, OptimizerSection

MUON = ("optimizer.name=muon", "optimizer.error_feedback.enabled=true")
# Warm-up over 4 of 5 steps: the lr of step 3 (0-based 2, the first resumed step) is (2 + 1) / 4 of the peak.
BASE = (*TINY, "lr_scheduler.warmup_steps=4", "lr_scheduler.total_steps=5", "training.steps=2",
        "validation.enable=false", "metrics.enable_tensorboard=false")
FIRST_RESUMED_LR_FACTOR = 3 / 4
HIDDEN = "layers.0.attention.wo.weight"
EMBEDDING = "tok_embeddings.weight"

# key -> (base run, new value, how the new value reads back from the checkpoint's param groups:
# (parameter, group key, index or None), or None where it is not checkpointed).
CHANGES = {
    "optimizer.lr": ("adamw", 0.01, (EMBEDDING, "initial_lr", None)),
    "optimizer.beta1": ("adamw", 0.5, (EMBEDDING, "betas", 0)),
    "optimizer.beta2": ("adamw", 0.5, (EMBEDDING, "betas", 1)),
    "optimizer.eps": ("adamw", 1e-3, (EMBEDDING, "eps", None)),
    "optimizer.weight_decay": ("adamw", 5.0, (EMBEDDING, "weight_decay", None)),
    "optimizer.implementation": ("adamw", "for-loop", (EMBEDDING, "fused", None)),
    "optimizer.muon.momentum": ("muon", 0.5, (HIDDEN, "momentum", None)),
    "optimizer.muon.nesterov": ("muon", False, (HIDDEN, "nesterov", None)),
    "optimizer.muon.ns_steps": ("muon", 1, (HIDDEN, "ns_steps", None)),
    "optimizer.muon.ns_dtype": ("muon", "bfloat16", (HIDDEN, "ns_dtype", None)),
    "optimizer.muon.lr_scaling": ("muon", "original", (HIDDEN, "lr_scaling", None)),
    "optimizer.muon.adamw_lr": ("muon", 0.01, (EMBEDDING, "initial_lr", None)),
    "optimizer.error_feedback.coefficient": ("muon", 0.0, None),
    "optimizer.name": ("adamw", "muon", None),
    "optimizer.error_feedback.enabled": ("muon", False, None),
}
APPLIED = [key for key in CHANGES if ON_RESUME.get(key) is None]
REFUSED = [key for key in CHANGES if ON_RESUME.get(key)]
READ_BACK = {"optimizer.implementation": False}
"""Expected read-back where it is not the new value itself: for-loop is fused = False."""
SAME_ARITHMETIC = {"optimizer.implementation"}
"""Keys whose new value computes the same update (the AdamW kernels): their read-back shows them in effect."""

DRIVER = """
import json, shutil, sys, time, types
from titan_async import cli
from titan_async.core import platform
platform.configure()
import torchtitan.trainer
torchtitan.trainer.time = types.SimpleNamespace(**{**vars(time), "sleep": lambda seconds: None})  # its 2 s wait for other ranks
statuses = []
for copy_from, argv in json.loads(sys.argv[1]):
    if copy_from:
        shutil.copytree(copy_from, argv[2])
    try:
        cli.main(argv)
    except SystemExit as exit:
        statuses.append(exit.code)
print(json.dumps(statuses))
"""


def _cli_in_one_process(commands: list[tuple[str | None, list[str]]]) -> None:
    """Run titan-async commands one after the other in one fresh interpreter (each start of torch
    costs seconds, and torchtitan's trainer waits 2 s at the end for other ranks: there are none);
    a command with a directory first copies it to its --run-dir. Fails on any non-zero exit."""
    result = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(commands)], capture_output=True, text=True,
                            timeout=600, cwd=REPO, env=fresh_environment())
    statuses = json.loads(result.stdout.splitlines()[-1]) if result.returncode == 0 else None
    assert statuses == [0] * len(commands), result.stderr[-5000:]


def _option_keys(section, prefix: str = "optimizer") -> list[str]:
    keys = []
    for field in dataclasses.fields(section):
        value = getattr(section, field.name)
        keys += _option_keys(value, f"{prefix}.{field.name}") if dataclasses.is_dataclass(value) else [f"{prefix}.{field.name}"]
    return keys


def _group_value(run_dir, step: int, parameter: str, key: str):
    name = f"optimizer.param_groups.{parameter}.{key}"
    state = {name: None}
    dcp.load(state, checkpoint_id=str(run_dir / "checkpoint" / f"step-{step}"))
    return state[name]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run directories: "adamw" and "muon" (2 steps each, not resumed), "adamw-resumed" and
    "muon-resumed" (resumed to step 4 with no change), and each applied key's resume to step 4 with
    its new value. The lr and the unchanged AdamW resumes also save step 3."""
    root = tmp_path_factory.mktemp("resume_changes")
    config = ("--config", str(CONFIGS / "debug_cpu.toml"))
    commands = [(None, ["train", "--run-dir", str(root / "adamw"), *config, *sets(*BASE)]),
                (None, ["train", "--run-dir", str(root / "muon"), *config, *sets(*BASE, *MUON)])]
    for name, base, assignments in [("adamw-resumed", "adamw", []), ("muon-resumed", "muon", []),
                                    *[(key, CHANGES[key][0], [f"{key}={json.dumps(CHANGES[key][1])}"]) for key in APPLIED]]:
        if name in ("adamw-resumed", "optimizer.lr"):
            assignments.append("checkpoint.interval=1")
        commands.append((str(root / base), ["resume", "--run-dir", str(root / name), *sets("training.steps=4", *assignments)]))
    _cli_in_one_process(commands)
    return root


def test_every_optimizer_key_is_applied_or_refused():
    assert sorted(ON_RESUME) == sorted(CHANGES) == sorted(_option_keys(OptimizerSection()))
    assert REFUSED == ["optimizer.name", "optimizer.error_feedback.enabled"]


@pytest.mark.parametrize("key", APPLIED)
def test_a_new_value_applies_from_the_first_resumed_step(runs, key):
    base, value, read_back = CHANGES[key]
    unchanged, changed = runs / f"{base}-resumed", runs / key
    assert sorted(losses(changed)) == [1, 2, 3, 4]
    # Step 3's loss is of the checkpoint's weights; the weights saved at step 4 are the resumed
    # updates' (their losses may round alike: bfloat16 Newton-Schulz moves step 4's by ~1e-7).
    assert losses(changed)[3] == losses(unchanged)[3]
    if key not in SAME_ARITHMETIC:
        weights = [checkpoint_weights(run / "checkpoint" / "step-4") for run in (unchanged, changed)]
        assert any(not torch.equal(weights[0][name], weights[1][name]) for name in weights[0])
    if read_back is not None:
        parameter, group_key, index = read_back
        saved = _group_value(changed, 4, parameter, group_key)
        assert (saved if index is None else saved[index]) == READ_BACK.get(key, value)
    assert attrgetter(key)(load_run_config(changed / "config.toml", [])) == value


def test_a_new_lr_is_the_lr_of_the_first_resumed_step(runs):
    old, new = 3e-3, CHANGES["optimizer.lr"][1]  # debug_cpu.toml's lr, and the resume's
    unchanged, changed = runs / "adamw-resumed", runs / "optimizer.lr"
    assert metrics(unchanged)[3]["lr/AdamW"] == pytest.approx(old * FIRST_RESUMED_LR_FACTOR, rel=1e-12)
    assert metrics(changed)[3]["lr/AdamW"] == pytest.approx(new * FIRST_RESUMED_LR_FACTOR, rel=1e-12)
    # AdamW's update from the same state is proportional to the lr it used: the lr resume's first
    # update is new / old times the unchanged resume's.
    before = checkpoint_weights(runs / "adamw" / "checkpoint" / "step-2")
    after = {name: checkpoint_weights(run / "checkpoint" / "step-3") for name, run in [("old", unchanged), ("new", changed)]}
    update = {name: torch.cat([(weights[k] - before[k]).flatten() for k in before]) for name, weights in after.items()}
    expected = update["old"] * (new / old)
    assert (update["new"] - expected).norm() / expected.norm() < 1e-4


@pytest.mark.parametrize("key", REFUSED)
def test_resume_refuses_a_key_that_decides_the_checkpointed_state(runs, capsys, key):
    from titan_async import cli

    base, value, _ = CHANGES[key]
    run_dir = runs / base
    config = (run_dir / "config.toml").read_text()
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["resume", "--run-dir", str(run_dir), *sets("training.steps=4", f"{key}={json.dumps(value)}")])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1, err
    assert f"resume cannot switch {key} from " in err and ON_RESUME[key] in err
    assert (run_dir / "config.toml").read_text() == config
    assert sorted(p.name for p in (run_dir / "checkpoint").iterdir()) == ["step-2"]


def test_every_resume_appends_what_it_changed_to_the_history(runs):
    """The history holds each resume's changes against the config it resumed, read here from the
    TOML files themselves; the staged config is gone once the resumed run trained."""
    before = tomllib.loads((runs / "adamw" / "config.toml").read_text())
    for name, changed in [("adamw-resumed", {"training.steps": 4, "checkpoint.interval": 1}),
                          ("optimizer.lr", {"training.steps": 4, "checkpoint.interval": 1, "optimizer.lr": 0.01})]:
        history = [json.loads(line) for line in (runs / name / "resume_history.jsonl").read_text().splitlines()]
        expected = {key: [attrgetter_toml(before, key), value] for key, value in changed.items()}
        assert [(entry["resumed_step"], entry["changed"]) for entry in history] == [(2, expected)]
        assert not (runs / name / "resume.staged.json").exists()
        after = tomllib.loads((runs / name / "config.toml").read_text())
        assert all(attrgetter_toml(after, key) == value for key, value in changed.items())


def attrgetter_toml(document: dict, key: str):
    for part in key.split("."):
        document = document[part]
    return document


@pytest.mark.parametrize("assignments, message", [
    (["training.steps=2"], "--set 'training.steps=2': the run resumes from its checkpoint at step 2; expected training.steps > 2"),
    (["training.steps=1"], "--set 'training.steps=1': the run resumes from its checkpoint at step 2; expected training.steps > 2"),
    (["training.steps=4", "optimizer.weight_decay=-1"], "optimizer.weight_decay: expected a number >= 0, got -1.0"),
    # Before: the workers' checkpoint load failed with a traceback.
    (["training.steps=4", "model.n_layers=5"], "model.n_layers: the checkpoints hold the weights of a model with "
                                               "model.n_layers = 4, resume cannot switch to 5"),
    (["training.steps=4", "data.vocab_size=1024"], "data.vocab_size: the checkpoints hold the weights of a model with "
                                                   "data.vocab_size = 2048, resume cannot switch to 1024"),
])
def test_resume_refuses_a_run_that_would_train_nothing_or_a_bad_value(runs, capsys, assignments, message):
    """Before: training.steps at the checkpoint's step trained nothing and exited 0, below it
    torchtitan asserted in every worker, and the config.toml it wrote failed every later resume."""
    from titan_async import cli

    run_dir = runs / "muon"
    config = (run_dir / "config.toml").read_bytes()
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["resume", "--run-dir", str(run_dir), *sets(*assignments)])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1 and message in err, err
    assert (run_dir / "config.toml").read_bytes() == config and not (run_dir / "resume.staged.json").exists()


def test_a_resume_stopped_before_its_workers_loaded_leaves_the_config_and_a_plain_resume_works(runs, tmp_path):
    """A resume whose workers never reach their first step (killed while they start, as a lost node
    or a failure only the workers find would stop them) leaves config.toml byte for byte and the
    history as they were; the next plain resume trains on the config that was in effect."""
    run_dir = tmp_path / "run"
    shutil.copytree(runs / "adamw-resumed", run_dir)
    shutil.rmtree(run_dir / "checkpoint" / "step-4")  # the run now resumes from step 3 of 4
    config, history = (run_dir / "config.toml").read_bytes(), (run_dir / "resume_history.jsonl").read_bytes()
    rows = (run_dir / "metrics.jsonl").read_bytes()
    resume = subprocess.Popen([sys.executable, "-m", "titan_async.cli", "resume", "--run-dir", str(run_dir),
                               *sets("optimizer.lr=0.02")], cwd=REPO, env=fresh_environment(), start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    staged = run_dir / "resume.staged.json"
    while not staged.exists():
        assert resume.poll() is None, "the resume ended before it staged its config"
        time.sleep(0.01)
    os.killpg(resume.pid, signal.SIGKILL)
    resume.wait()
    assert (run_dir / "metrics.jsonl").read_bytes() == rows, "killed after its first step"
    assert (run_dir / "config.toml").read_bytes() == config
    assert (run_dir / "resume_history.jsonl").read_bytes() == history
    run_cli("resume", "--run-dir", str(run_dir))
    assert (run_dir / "config.toml").read_bytes() == config and not staged.exists()
    entries = [json.loads(line) for line in (run_dir / "resume_history.jsonl").read_text().splitlines()]
    assert [(entry["resumed_step"], entry["set"], entry["changed"]) for entry in entries[1:]] == [(3, [], {})]
    assert metrics(run_dir)[4]["lr/AdamW"] == metrics(runs / "adamw-resumed")[4]["lr/AdamW"]
    assert losses(run_dir)[4] == losses(runs / "adamw-resumed")[4]
