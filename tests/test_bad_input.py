"""Every bad input ends with one line naming the file, key or argument, exit status 2, no traceback."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import CONFIGS, REPO, TINY, cli_in_process, fresh_environment, run_cli, sets
from test_compare import write_run
from titan_async import cli


def fail(capsys, *args: str) -> str:
    """Run the CLI in-process, expect exit status 2, return its single stderr line."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(list(args))
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("titan-async: ")
    return err


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_missing_config_file_as_a_process(tmp_path):
    result = run_cli("train", "--config", str(tmp_path / "nope.toml"), check=False)
    assert result.returncode == 2
    assert result.stderr.strip() == f"titan-async: {tmp_path / 'nope.toml'}: config file not found"


def test_toml_syntax_error_gives_line_and_column(tmp_path, capsys):
    path = write(tmp_path / "bad.toml", "[training]\nsteps = 10\nlr = = 3\n")
    err = fail(capsys, "config", "show", "--config", str(path))
    assert str(path) in err and "TOML syntax error" in err and "line 3, column" in err


def test_unknown_key_suggests_closest(tmp_path, capsys):
    path = write(tmp_path / "typo.toml", "[training]\nstep = 10\n")
    err = fail(capsys, "config", "show", "--config", str(path))
    assert err == f"titan-async: {path}: [training]: unknown key 'step' (did you mean 'steps'?)"


def test_unknown_section_suggests_closest(tmp_path, capsys):
    path = write(tmp_path / "typo.toml", "[trainng]\nsteps = 10\n")
    err = fail(capsys, "config", "show", "--config", str(path))
    assert err == f"titan-async: {path}: unknown section [trainng] (did you mean 'training'?)"


def test_wrong_value_type_names_key_and_expected_type(capsys):
    err = fail(capsys, "config", "show", *sets("training.steps=ten"))
    assert err.endswith('training.steps: expected an integer, got string "ten"')


def test_wrong_literal_lists_choices(capsys):
    err = fail(capsys, "config", "show", *sets("optimizer.name=sgd"))
    assert err.endswith('optimizer.name: expected one of "adamw", "muon", got string "sgd"')


def test_malformed_set(capsys):
    err = fail(capsys, "config", "show", "--set", "steps")
    assert "--set 'steps': expected section.key=value" in err


def test_parallel_degrees_must_match_process_count(capsys, tmp_path):
    err = fail(capsys, "train", "--config", str(CONFIGS / "debug_cpu_pp2_fsdp2.toml"), "--nproc-per-node", "2",
               "--run-dir", str(tmp_path / "run"))
    assert "parallelism.pipeline_parallel_degree (2) x parallelism.data_parallel_shard_degree (2) = 4" in err
    assert "2 process(es)" in err
    assert not (tmp_path / "run").exists()


def test_batch_must_divide_into_microbatches(capsys, tmp_path):
    err = fail(capsys, "train", "--config", str(CONFIGS / "debug_cpu_pp2.toml"), "--nproc-per-node", "2",
               "--run-dir", str(tmp_path / "run"), *sets("parallelism.pipeline_parallel_microbatch_size=3"))
    assert "training.local_batch_size (8) is not divisible into microbatches of " \
           "parallelism.pipeline_parallel_microbatch_size (3)" in err


def test_resume_needs_a_run_directory(capsys, tmp_path):
    err = fail(capsys, "resume", "--run-dir", str(tmp_path))
    assert err == f"titan-async: --run-dir {tmp_path}: not a titan-async run directory (no config.toml)"


def test_resume_needs_a_complete_checkpoint(capsys, tmp_path):
    run = tmp_path / "run"
    (run / "checkpoint" / "step-5").mkdir(parents=True)  # a save that never finished: no .metadata
    shutil.copy(CONFIGS / "debug_cpu.toml", run / "config.toml")
    err = fail(capsys, "resume", "--run-dir", str(run))
    assert err.startswith(f"titan-async: --run-dir {run}: no intact checkpoint to resume from")
    assert "step-5, no .metadata" in err and (run / "checkpoint" / "step-5").is_dir()


def test_eval_missing_checkpoint(capsys, tmp_path):
    (tmp_path / "checkpoint" / "step-2").mkdir(parents=True)
    err = fail(capsys, "eval", "--checkpoint", str(tmp_path / "checkpoint" / "step-3"))
    assert "step-3: no such checkpoint (the run has: step-2)" in err


def test_eval_incomplete_checkpoint(capsys, tmp_path):
    step = tmp_path / "checkpoint" / "step-3"
    step.mkdir(parents=True)
    err = fail(capsys, "eval", "--checkpoint", str(step))
    assert "cannot read the checkpoint (no .metadata: the save did not finish)" in err


def test_eval_corrupt_checkpoint(capsys, tmp_path):
    step = tmp_path / "checkpoint" / "step-3"
    step.mkdir(parents=True)
    write(step / ".metadata", "not a pickle")
    write(step / "__0_0.distcp", "garbage")
    shutil.copy(CONFIGS / "debug_cpu.toml", tmp_path / "config.toml")
    err = fail(capsys, "eval", "--checkpoint", str(step))
    assert f"--checkpoint {step}: cannot read the checkpoint" in err


def test_train_refuses_to_discard_checkpoints(capsys, tmp_path):
    (tmp_path / "checkpoint" / "step-10").mkdir(parents=True)
    err = fail(capsys, "train", "--run-dir", str(tmp_path))
    assert "already holds checkpoints" in err and "--overwrite" in err
    assert (tmp_path / "checkpoint" / "step-10").is_dir()


def test_invalid_model_shape(capsys, tmp_path):
    err = fail(capsys, "train", "--run-dir", str(tmp_path / "run"), *sets("model.n_heads=7"))
    assert "model.dim (256) must be divisible by model.n_heads (7)" in err


def test_shipped_config_resolves_with_or_without_toml(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not the checkout: names resolve to the shipped configs
    for name in ("10b_2bw_muon", "10b_2bw_muon.toml", "train_configs/10b_2bw_muon.toml"):
        code, out, _ = cli_in_process(capsys, "config", "show", "--config", name)
        assert code == 0 and out.startswith(f"# resolved from {CONFIGS / '10b_2bw_muon.toml'}"), name


def test_unknown_config_name_lists_the_shipped_ones(capsys):
    err = fail(capsys, "config", "show", "--config", "10b_2bw_moun.toml")
    assert "--config 10b_2bw_moun.toml: no such file, and no shipped config of that name" in err and "10b_2bw_muon" in err


@pytest.mark.parametrize("argument", [("train", "--nproc-per-node", "0"), ("resume", "--run-dir", ".", "--nproc-per-node", "-1")])
def test_non_positive_process_counts_are_refused(capsys, argument):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(list(argument))
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1
    assert f"argument {argument[-2]}: expected a positive integer, got '{argument[-1]}'" in err


@pytest.mark.parametrize("key,value", [("training.steps", -5), ("training.local_batch_size", 0), ("metrics.log_freq", 0),
                                       ("validation.freq", -1), ("training.global_batch_size", 0)])
def test_non_positive_counts_in_the_config_are_refused(capsys, key, value):
    err = fail(capsys, "train", *sets(f"{key}={value}"))
    auto = ", or -1 (local_batch_size x data-parallel degree)" if key == "training.global_batch_size" else ""
    assert err.endswith(f"{key}: expected a positive integer{auto}, got {value}")


def test_zbv_with_validation_is_refused_before_launch(capsys):
    err = fail(capsys, "train", "--config", str(CONFIGS / "debug_cpu_pp2.toml"), "--nproc-per-node", "2",
               *sets("parallelism.pipeline_parallel_schedule=ZBVZeroBubble"))
    assert "parallelism.pipeline_parallel_schedule = 'ZBVZeroBubble' cannot validate" in err and "validation.enable = false" in err


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_non_finite_numbers_are_refused(capsys, tmp_path, value):
    err = fail(capsys, "config", "show", *sets(f"optimizer.lr={value}"))
    assert f"--set 'optimizer.lr={value}': optimizer.lr: expected a finite number, got float" in err
    path = write(tmp_path / "bad.toml", f"[optimizer.muon]\nadamw_lr = {value}\n")
    err = fail(capsys, "config", "show", "--config", str(path))
    assert f"{path}: optimizer.muon.adamw_lr: expected a finite number" in err


def test_a_set_typo_is_blamed_on_the_set(capsys):
    err = fail(capsys, "config", "show", *sets("training.stepz=5"))
    assert err == "titan-async: --set 'training.stepz=5': [training]: unknown key 'stepz' (did you mean 'steps'?)"
    err = fail(capsys, "config", "show", *sets("trainig.steps=5"))
    assert err.startswith("titan-async: --set 'trainig.steps=5': unknown section [trainig] (did you mean 'training'?)")


def test_more_stages_than_layers_is_one_line_before_launch(capsys, tmp_path):
    err = fail(capsys, "train", "--config", "debug_cpu_pp2", "--nproc-per-node", "4", "--run-dir", str(tmp_path / "run"),
               *sets("parallelism.pipeline_parallel_degree=4", "model.n_layers=1"))
    assert "Number of stages (4) cannot be greater than effective layers (3)" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("command", ["train", "resume"])
def test_run_dir_naming_a_file(capsys, tmp_path, command):
    path = write(tmp_path / "notes.txt", "mine")
    err = fail(capsys, command, "--run-dir", str(path))
    assert err == f"titan-async: --run-dir {path}: is a file; give a directory"
    assert path.read_text() == "mine"


def test_run_dir_under_a_file_is_refused_before_anything_is_made(capsys, tmp_path):
    notes = write(tmp_path / "notes.txt", "mine")
    err = fail(capsys, "train", "--run-dir", str(notes / "run"))
    assert err == f"titan-async: --run-dir {notes / 'run'}: {notes} is a file, not a directory"
    assert notes.read_text() == "mine" and sorted(tmp_path.iterdir()) == [notes]


def test_config_naming_a_directory(capsys, tmp_path):
    err = fail(capsys, "config", "show", "--config", str(tmp_path))
    assert err == f"titan-async: --config {tmp_path}: is a directory; give a TOML file or the name of a shipped config"


def test_version_is_the_installed_one(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out == f"titan-async {version('titan-async')}\n"


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["train", "--nproc-per-node", "0"], ["frobnicate"]])
def test_help_version_and_argument_errors_import_no_torch(args):
    probe = ("import sys\nfrom titan_async import cli\ntry:\n    cli.main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
             "print('torch' in sys.modules, file=sys.stderr)")
    result = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, timeout=60)
    assert result.stderr.strip().splitlines()[-1] == "False", result.stderr


@pytest.mark.parametrize("args, message", [
    (["plan", "--gpu-memory", "80XB"], "--gpu-memory '80XB': expected a positive size with a unit"),
    (["plan", "--nodes", "0"], "--nodes 0: must be at least 1"),
    (["plan", "--gantt", "g.png"], "--gantt: applies only with --simulate"),
    (["plan", "--advice-png", "a.png"], "--advice-png: applies only with --gpu-counts"),
    (["train", "--run-dir", "README.md/run"], "--run-dir README.md/run: README.md is a file, not a directory"),
])
def test_errors_of_the_arguments_alone_answer_before_torch_is_imported(args, message):
    probe = ("import sys\nfrom titan_async import cli\ntry:\n    cli.main(sys.argv[1:])\nexcept SystemExit as e:\n"
             "    print(e.code, file=sys.stderr)\nprint('torch' in sys.modules, file=sys.stderr)")
    result = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, timeout=60, cwd=REPO)
    error, status, torch_imported = result.stderr.splitlines()
    assert error.startswith(f"titan-async: {message}") and status == "2" and torch_imported == "False", result.stderr


def test_workers_that_fail_otherwise_are_summed_up_in_one_line(tmp_path):
    """In place of torch elastic's block of failure records: the status or signal of each failed worker."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from titan_async.run.launch import failed_workers

    failures = {3: ProcessFailure(local_rank=1, pid=11, exitcode=-9, error_file=""),
                0: ProcessFailure(local_rank=0, pid=10, exitcode=1, error_file="")}
    assert failed_workers(failures, tmp_path / "run") == ("the run failed: rank 0 exited with status 1; rank 3 was killed by SIGKILL "
                                                          f"(the workers' errors are above; each rank's log is in {tmp_path / 'run' / 'logs'})")


def _resumable_fake_run(folder: Path, *assignments: str) -> Path:
    """A run directory of debug_cpu with `assignments`, holding one (tiny, intact) checkpoint."""
    import torch
    import torch.distributed.checkpoint as dcp

    from titan_async.config.run_config import load_run_config, render_toml

    folder.mkdir()
    write(folder / "config.toml", render_toml(load_run_config(CONFIGS / "debug_cpu.toml", list(assignments))))
    from titan_async.rundir import checksums

    dcp.save({"w": torch.ones(1)}, checkpoint_id=str(folder / "checkpoint" / "step-1"), no_dist=True)
    checksums.record(folder / "checkpoint" / "step-1", rank=0)
    return folder


PR_CAPBSET_DROP, CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH = 24, 1, 2


def _bound_by_permissions() -> None:
    """preexec_fn: root passes file permissions by CAP_DAC_OVERRIDE (and CAP_DAC_READ_SEARCH);
    with both out of its bounding set, the program it execs is refused a chmod -w directory as
    any user is. A user's process holds neither."""
    if os.geteuid() != 0:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH):
        if libc.prctl(PR_CAPBSET_DROP, capability, 0, 0, 0):
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


@pytest.mark.parametrize("case", ["report", "report --out", "compare", "resume", "resume with a lock file"])
def test_a_directory_the_user_cannot_write_is_one_line(tmp_path, case):
    """The command's first write into a chmod -w directory, run as a user would (`_bound_by_permissions`):
    report's RUN/report, or --out's folder; compare's BASELINE/compare; resume's lock file, or where
    the lock file is there (and writable) the config it stages."""
    if case.startswith("resume"):
        run = _resumable_fake_run(tmp_path / "run", *TINY)
        if case == "resume with a lock file":
            write(run / "run.lock", "")
        args, unwritable, named = ["resume", "--run-dir", str(run)], run, f"--run-dir {run}"
        written = run / ("run.lock" if case == "resume" else "resume.staged.json.tmp")
    elif case == "report --out":
        run, unwritable = write_run(tmp_path / "run", {1: 4.5, 10: 3.6}, 1.0), tmp_path / "pages"
        unwritable.mkdir()
        out = unwritable / "run" / "page.html"
        args, written, named = ["report", "--run-dir", str(run), "--out", str(out)], out.parent, f"--out {out}"
    else:
        run = unwritable = write_run(tmp_path / "run", {1: 4.5, 10: 3.6}, 1.0)
        args = ["compare", str(run)] if case == "compare" else ["report", "--run-dir", str(run)]
        written, named = run / case, f"{'RUN_DIR' if case == 'compare' else '--run-dir'} {run}"
    before = sorted(unwritable.rglob("*"))
    unwritable.chmod(0o555)
    try:
        result = subprocess.run([sys.executable, "-m", "titan_async.cli", *args], capture_output=True, text=True, timeout=300,
                                cwd=REPO, env=fresh_environment(), preexec_fn=_bound_by_permissions)
    finally:
        unwritable.chmod(0o755)
    assert result.returncode == 2, result.stderr
    assert result.stderr == f"titan-async: {named}: cannot write there ({written}: Permission denied)\n"
    assert sorted(unwritable.rglob("*")) == before


def test_resume_names_the_switched_optimizer_not_what_it_leaves_behind(capsys, tmp_path):
    run = _resumable_fake_run(tmp_path / "run", "optimizer.name=muon", "optimizer.muon.adamw_lr=1e-3")
    err = fail(capsys, "resume", "--run-dir", str(run), *sets("optimizer.name=adamw"))
    assert err == ("titan-async: --set 'optimizer.name=adamw': resume cannot switch optimizer.name from 'muon': the checkpoints "
                   "hold that optimizer's state (AdamW's moments; with muon, Muon's momentum too); start a new run "
                   "(train --run-dir NEW), or keep the setting")


def test_resume_says_what_a_schedule_switch_leaves(capsys, tmp_path):
    run = _resumable_fake_run(tmp_path / "run")
    err = fail(capsys, "resume", "--run-dir", str(run), *sets("parallelism.pipeline_parallel_schedule=PipeDream2BW",
                                                              "parallelism.emulated_stages=2", "parallelism.pipeline_parallel_microbatch_size=1"))
    assert "the checkpoints hold state for 'no weight versions (a synchronous schedule)', resume cannot switch to " \
           "'PipeDream2BW on 2 stages'" in err


def test_a_config_error_in_train_imports_neither_the_trainer_nor_the_data_pipeline(tmp_path):
    """The config is checked on its schema alone; the trainer and data stack come after it passes."""
    probe = ("import sys\nfrom titan_async import cli\ntry:\n    cli.main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
             "print([m for m in ('titan_async.train.trainer', 'titan_async.config.assemble', 'torchtitan.trainer') if m in sys.modules],"
             " file=sys.stderr)")
    args = ["train", "--run-dir", str(tmp_path / "run"), "--set", "training.stepz=1"]
    result = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, timeout=120)
    assert "training.stepz" in result.stderr and result.stderr.strip().splitlines()[-1] == "[]", result.stderr


STAGES_OF_TWO = [["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "layers.3", "norm", "lm_head"]]


@pytest.mark.parametrize("split, message", [
    ([STAGES_OF_TWO[0], [*STAGES_OF_TWO[1][:-1], "output"]], "names 'output', which is no module of this model"),
    ([STAGES_OF_TWO[0], STAGES_OF_TWO[1][:-1]], "leaves out lm_head"),
    ([STAGES_OF_TWO[0], ["layers.1", *STAGES_OF_TWO[1]]], "places 'layers.1' on more than one stage"),
])
def test_a_split_that_misplaces_a_module_is_refused_by_train_and_plan(capsys, tmp_path, split, message):
    """torchtitan would build stages without the head (or with a layer twice); train and plan refuse."""
    assignments = sets("model.n_layers=4", f"parallelism.module_fqns_per_model_part={split}".replace("'", '"'))
    for command in (["train", "--nproc-per-node", "2", "--run-dir", str(tmp_path / "run")], ["plan", "--gpus-per-node", "2"]):
        err = fail(capsys, *command, "--config", str(CONFIGS / "debug_cpu_pp2.toml"), *assignments)
        assert f"parallelism.module_fqns_per_model_part {message}" in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("schedule, local_batch, message", [
    ("1F1B", 2, "'1F1B' needs at least as many microbatches per flush as stages: training.local_batch_size / "
                "parallelism.pipeline_parallel_microbatch_size = 2 < 4 stages"),
    ("DualPipeV", 4, "'DualPipeV' needs at least as many microbatches per flush as stages: training.local_batch_size / "
                     "parallelism.pipeline_parallel_microbatch_size = 4 < 8 stages"),
    ("Interleaved1F1B", 9, "'Interleaved1F1B' needs the microbatches per flush to be a multiple of their rounds "
                           "(microbatches // pipeline_parallel_degree = 2)"),
])
def test_microbatches_torchs_schedule_refuses_are_refused_in_one_line(capsys, schedule, local_batch, message):
    """Before launch, where torch would raise in every worker (plan's dry run built the schedule)."""
    assignments = sets("model.n_layers=8", "parallelism.pipeline_parallel_degree=4", f"parallelism.pipeline_parallel_schedule={schedule}",
                       f"training.local_batch_size={local_batch}", "parallelism.pipeline_parallel_microbatch_size=1",
                       "validation.enable=false")
    err = fail(capsys, "plan", "--config", str(CONFIGS / "debug_cpu_pp2.toml"), "--gpus-per-node", "4", *assignments)
    assert message in err, err


@pytest.mark.parametrize("schedule", ["1F1B", "GPipe", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"])
def test_the_microbatch_check_refuses_exactly_what_torchs_schedules_refuse(schedule):
    """torch's schedule builder (its visualizer's, on mock stages; 2 stages per rank for the
    multi-stage schedules) is the reference, for p = 2..5 and m = 1..12."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    from titan_async.pipeline.split import check_microbatches

    single = schedule in ("1F1B", "GPipe")
    for pp in range(2, 6):
        for microbatches in range(1, 13):
            try:
                get_schedule_ops(schedule, pp, microbatches)
                torch_refuses = False
            except ValueError:
                torch_refuses = True
            try:
                check_microbatches(schedule, microbatches, pp if single else 2 * pp, pp)
                refused = False
            except ValueError:
                refused = True
            assert refused == torch_refuses, (schedule, pp, microbatches, torch_refuses)


@pytest.mark.parametrize("value, message", [
    ("-1", "training.sync_start_steps: expected an integer >= 0, got -1"),
    ("1.5", "training.sync_start_steps: expected an integer, got float 1.5"),
])
def test_sync_start_steps_must_be_a_count(capsys, value, message):
    err = fail(capsys, "config", "show", *sets(f"training.sync_start_steps={value}"))
    assert message in err, err


def test_sync_start_on_a_synchronous_schedule_is_refused(capsys, tmp_path):
    err = fail(capsys, "train", "--config", str(CONFIGS / "debug_cpu_pp2.toml"), "--nproc-per-node", "2",
               "--run-dir", str(tmp_path / "run"), *sets("training.sync_start_steps=3"))
    assert ("training.sync_start_steps = 3 trains the first steps synchronously before a streaming schedule "
            "(PipeDream2BW, PACI) or training.gradient_delay = 1; parallelism.pipeline_parallel_schedule = '1F1B' "
            "is synchronous throughout") in err, err
    assert not (tmp_path / "run").exists()
