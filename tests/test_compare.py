"""`titan-async compare`: time to a target validation loss on hand-written run directories, bad
input, and one real comparison of two tiny runs of the default config."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import CONFIGS, TINY, cli_in_process, run_cli, sets
from test_report import PNG_SIGNATURE, embedded_images
from titan_async.commands.compare import compare, time_to_target


def write_run(directory: Path, validations: dict[int, float], seconds_per_step: float, steps: int = 10,
              model: str = "dim = 64", seq_len: int = 64) -> Path:
    """A run directory: config, and metrics.jsonl of `steps` training steps (1,000 tokens and
    `seconds_per_step` training seconds each; loss 5 - step / 10) and the given validations."""
    directory.mkdir(parents=True)
    (directory / "config.toml").write_text(
        f'[model]\n{model}\n\n[data]\nsource = "stdlib"\n\n[training]\nseq_len = {seq_len}\nlocal_batch_size = 4\n\n[validation]\nsteps = 2\n')
    rows = []
    for step in range(1, steps + 1):
        rows.append({"step": step, "kind": "train", "loss_metrics/global_avg_loss": 5 - step / 10,
                     "n_tokens_seen": 1000 * step, "time_metrics/training(s)": seconds_per_step})
        if step in validations:
            rows.append({"step": step, "kind": "validation", "validation_metrics/loss": validations[step]})
    (directory / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return directory


def run_compare(capsys, *args: str) -> tuple[int, str, str]:
    return cli_in_process(capsys, "compare", *args)


def test_time_to_target_interpolates_between_validations():
    # 4.0 at 10 s, 3.0 at 20 s: 3.25 is reached three quarters of the way, at 17.5 s
    assert time_to_target([0.0, 10.0, 20.0], [5.0, 4.0, 3.0], 3.25) == pytest.approx(17.5)
    assert time_to_target([1.0, 2.0], [3.0, 2.0], 3.5) == 1.0
    assert time_to_target([1.0, 2.0, 3.0], [4.0, 3.9, 3.8], 3.5) is None


def test_compare_reports_time_to_the_baseline_final_loss_and_speedup(tmp_path, capsys):
    # baseline: 2 s a step, validations 4.5 (step 1), 4.0 (step 5), 3.6 (step 10): target 3.6 at 20 s.
    baseline = write_run(tmp_path / "base", {1: 4.5, 5: 4.0, 10: 3.6}, 2.0)
    # faster: 1 s a step; 3.8 at step 5 (5 s), 3.4 at step 10 (10 s): 3.6 is half way, at 7.5 s, step 7.5
    faster = write_run(tmp_path / "fast", {1: 4.4, 5: 3.8, 10: 3.4}, 1.0)
    # slower: never below 3.7
    slower = write_run(tmp_path / "slow", {1: 4.6, 5: 4.1, 10: 3.7}, 1.0)
    status, out, err = run_compare(capsys, str(faster), str(slower), "--baseline", str(baseline), "--json")
    assert status == 0, err
    results = json.loads(out)
    assert results["target"] == 3.6 and results["baseline"] == str(baseline) and results["warnings"] == []
    base, fast, slow = results["runs"]
    assert [base["label"], fast["label"], slow["label"]] == ["base", "fast", "slow"]
    assert base["time_to_target_s"] == pytest.approx(20.0) and base["speedup"] == pytest.approx(1.0)
    assert fast["time_to_target_s"] == pytest.approx(7.5) and fast["steps_to_target"] == pytest.approx(7.5)
    assert fast["tokens_to_target"] == pytest.approx(7500) and fast["speedup"] == pytest.approx(20 / 7.5)
    assert fast["tokens_per_s"] == pytest.approx(1000) and base["tokens_per_s"] == pytest.approx(500)
    assert fast["final_validation_loss"] == 3.4 and slow["best_validation_loss"] == 3.7
    assert slow["time_to_target_s"] is None and slow["speedup"] is None

    status, out, err = run_compare(capsys, str(baseline), str(slower), "--target", "3.9", "--out", str(tmp_path / "page" / "c.html"))
    assert status == 0, err
    # 3.9: the baseline between step 5 (4.0, 10 s) and 10 (3.6, 20 s), at 12.5 s;
    # the slow run between step 5 (4.1, 5 s) and 10 (3.7, 10 s), at 7.5 s: 12.5 / 7.5 = 1.67x
    line = next(line for line in out.splitlines() if line.startswith("slow "))
    assert line.split()[6:] == ["7.5", "1.67x"]
    assert (tmp_path / "page" / "c.html").is_file() and len(list((tmp_path / "page").glob("*.png"))) == 6


def test_a_run_in_progress_has_not_reached_the_target(tmp_path, capsys):
    baseline = write_run(tmp_path / "base", {1: 4.5, 10: 3.6}, 1.0)
    running = write_run(tmp_path / "running", {1: 4.5}, 1.0, steps=3)
    with open(running / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "kind": "tra')  # a line cut short
    status, out, err = run_compare(capsys, str(baseline), str(running), "--out", str(tmp_path / "c.html"))
    assert status == 0, err
    assert "not reached" in next(line for line in out.splitlines() if line.startswith("running "))


def test_a_different_model_is_a_warning_and_different_validation_data_an_error(tmp_path, capsys):
    baseline = write_run(tmp_path / "base", {1: 4.5, 10: 3.6}, 1.0)
    wider = write_run(tmp_path / "wider", {1: 4.4, 10: 3.5}, 1.0, model="dim = 128")
    _, results = compare([baseline, wider])
    assert results["warnings"] == ["wider trains a different model ([model] differs from the baseline base's)"]
    status, _, err = run_compare(capsys, str(baseline), str(wider), "--out", str(tmp_path / "c.html"))
    assert status == 0 and "titan-async: warning: wider trains a different model" in err

    longer = write_run(tmp_path / "longer", {1: 4.4, 10: 3.5}, 1.0, seq_len=128)
    status, _, err = run_compare(capsys, str(baseline), str(longer))
    assert status == 2
    assert err == (f"titan-async: RUN_DIR {longer}: validates on different data than the baseline {baseline} "
                   "(training.seq_len differs); their losses do not compare\n")


@pytest.mark.parametrize("case", ["missing directory", "not a run", "target not a number", "target negative",
                                  "baseline never validated", "no training time"])
def test_bad_input_gets_one_line(tmp_path, capsys, case):
    baseline = write_run(tmp_path / "base", {1: 4.5, 10: 3.6}, 1.0)
    args, expected = [str(baseline)], ""
    if case == "missing directory":
        args.append(str(tmp_path / "nowhere"))
        expected = f"RUN_DIR {tmp_path / 'nowhere'}: no such directory"
    elif case == "not a run":
        (tmp_path / "empty").mkdir()
        args.append(str(tmp_path / "empty"))
        expected = f"RUN_DIR {tmp_path / 'empty'}: not a titan-async run directory (no config.toml)"
    elif case == "target not a number":
        args += ["--target", "low"]
        expected = "--target low: expected a positive validation loss"
    elif case == "target negative":
        args += ["--target", "-1"]
        expected = "--target -1: expected a positive validation loss"
    elif case == "baseline never validated":
        args = [str(write_run(tmp_path / "fresh", {}, 1.0))]
        expected = f"--baseline {tmp_path / 'fresh'}: no validation loss logged yet; give --target"
    else:
        metrics = baseline / "metrics.jsonl"
        metrics.write_text(metrics.read_text().replace('"time_metrics/training(s)"', '"other"'))
        expected = f"RUN_DIR {baseline}: metrics.jsonl lacks time_metrics/training(s)"
    status, out, err = run_compare(capsys, *args, "--json")
    assert status == 2 and out == ""
    assert err.startswith(f"titan-async: {expected}") and len(err.strip().splitlines()) == 1, err


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory) -> tuple[Path, Path]:
    """Two 6-step runs of the tiny default config, validated at steps 1, 3 and 6: AdamW and Muon."""
    folder = tmp_path_factory.mktemp("compare")
    runs = []
    for optimizer in ("adamw", "muon"):
        run_dir = folder / optimizer
        run_cli("train", "--config", str(CONFIGS / "debug_cpu.toml"), "--run-dir", str(run_dir),
                *sets(*TINY, "training.steps=6", "training.local_batch_size=2", "validation.freq=3", f"optimizer.name={optimizer}"))
        runs.append(run_dir)
    return runs[0], runs[1]


def test_compare_two_real_runs_writes_page_pngs_and_json(two_runs, tmp_path):
    adamw, muon = two_runs
    result = run_cli("compare", str(adamw), str(muon), "--json")
    results = json.loads(result.stdout)
    train = [json.loads(line) for line in (adamw / "metrics.jsonl").read_text().splitlines()]
    validations = [row["validation_metrics/loss"] for row in train if row["kind"] == "validation"]
    seconds = [row["time_metrics/training(s)"] for row in train if row["kind"] == "train"]
    assert len(seconds) == 6 and all(s > 0 for s in seconds)
    assert results["target"] == validations[-1] and [r["label"] for r in results["runs"]] == ["adamw", "muon"]
    base = results["runs"][0]
    assert base["steps"] == 6 and base["training_s"] == pytest.approx(sum(seconds))
    # the tiny default run's tokens: 6 steps x 2 sequences x 64 tokens
    assert base["tokens_per_s"] == pytest.approx(6 * 2 * 64 / sum(seconds))
    assert base["speedup"] == pytest.approx(1.0) and base["steps_to_target"] <= 6

    page = run_cli("compare", str(adamw), str(muon)).stdout.splitlines()[-1].removeprefix("compare: ")
    assert page == str(adamw / "compare" / "compare.html")
    pngs = sorted(Path(page).parent.glob("*.png"))
    assert [p.name for p in pngs] == [f"{kind}_loss_by_{axis}.png" for kind in ("training", "validation")
                                      for axis in ("seconds", "step", "tokens")]
    assert all(p.read_bytes().startswith(PNG_SIGNATURE) for p in pngs)
    text = Path(page).read_text()
    assert sorted(embedded_images(text)) == sorted(p.read_bytes() for p in pngs)
    assert f"Time to validation loss {validations[-1]:.4f}" in text and "<td>muon</td>" in text
    shutil.rmtree(Path(page).parent)
