"""The staleness study's table logic (tools/staleness_study.py) on synthetic metrics files."""

from __future__ import annotations

import csv
import importlib.util
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from titan_async.experiments import staleness_runs

REPO = Path(__file__).resolve().parent.parent
_PATH = REPO / "tools" / "staleness_study.py"
_SPEC = importlib.util.spec_from_file_location("staleness_study", _PATH)
study = importlib.util.module_from_spec(_SPEC)
sys.modules["staleness_study"] = study
_SPEC.loader.exec_module(study)
Arm = study.Arm

# Final validation losses at seed 0 of a study where the paper's ordering holds.
SEED0 = {
    Arm("adamw", 0, False): 4.00,
    Arm("adamw", 0, True): 4.01,
    Arm("adamw", 1, False): 4.30,
    Arm("adamw", 1, True): 4.10,
    Arm("muon", 0, False): 3.80,
    Arm("muon", 0, True): 3.80,
    Arm("muon", 1, False): 3.84,
    Arm("muon", 1, True): 3.81,
}
# Seed 1: every loss 0.05 higher, except AdamW delay 1 (gap 0.28 instead of 0.30).
SEED1 = {arm.at(1): loss + 0.05 - (0.02 if arm == Arm("adamw", 1, False) else 0) for arm, loss in SEED0.items()}


def write_run(runs_dir: Path, arm: Arm, final: float) -> None:
    """A run directory whose metrics.jsonl ends at validation loss `final` (step 20)."""
    run = runs_dir / arm.name
    run.mkdir(parents=True)
    records = []
    for step in range(1, 21):
        records.append({"step": step, "kind": "train", "loss_metrics/global_avg_loss": final + 1 / step, "grad_norm": 1.0})
        if step in (1, 10, 20):
            records.append({"step": step, "kind": "validation", "validation_metrics/loss": final + (20 - step) / 100})
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    (run / "config.toml").write_text(f'# resolved from {REPO}/train_configs/debug_cpu.toml\n\n[optimizer]\nname = "{arm.optimizer}"\n')


def write_runs(runs_dir: Path, finals: dict) -> Path:
    for arm, final in finals.items():
        write_run(runs_dir, arm, final)
    return runs_dir


def rows_of(runs_dir: Path, seeds: list[int], noise_seeds: list[int] = ()) -> list:
    return study.build_table(study.collect(study.study_arms(seeds, noise_seeds), runs_dir))


def test_arms_interleave_optimizers_and_names_are_unique():
    arms = study.study_arms([0, 1], noise_seeds=[1, 2])
    assert len(arms) == 18 and len({a.name for a in arms}) == 18
    assert [a.optimizer for a in arms] == ["adamw", "muon"] * 9
    main = [Arm(o, d, e, seed) for seed in (0, 1) for d, e in ((0, False), (1, False), (1, True)) for o in ("adamw", "muon")]
    assert arms[:12] == main  # the delay gap and EF's recovery at every seed first
    assert arms[12:16] == [Arm("adamw", 0, True), Arm("muon", 0, True), Arm("adamw", 0, True, 1), Arm("muon", 0, True, 1)]
    assert arms[-2:] == [Arm("adamw", 0, False, 2), Arm("muon", 0, False, 2)]
    assert Arm("muon", 1, True, 2).name == "muon-delay1-ef-seed2"
    assert "training.gradient_delay=1" in Arm("muon", 1, True).overrides()


def test_load_curves_and_finished(tmp_path: Path):
    write_run(tmp_path, Arm("adamw", 1, False), 4.3)
    curves = study.load_curves(tmp_path / "adamw-delay1" / "metrics.jsonl")
    assert len(curves.train) == 20 and [s for s, _ in curves.validation] == [1, 10, 20]
    assert curves.final_validation == pytest.approx(4.30)
    assert study.finished(tmp_path / "adamw-delay1", 20) and not study.finished(tmp_path / "adamw-delay1", 30)


def test_a_run_still_training_is_left_out_of_the_table(tmp_path: Path):
    write_runs(tmp_path, SEED0)
    everything = study.collect(study.study_arms([0]), tmp_path)
    assert len(everything) == len(study.collect(study.study_arms([0]), tmp_path, steps=20)) == 8
    assert study.collect(study.study_arms([0]), tmp_path, steps=30) == {}  # none validated at step 30


def test_gaps_and_recovery_at_one_seed(tmp_path: Path):
    rows = rows_of(write_runs(tmp_path, SEED0), [0])
    by_arm = {r.arm: r for r in rows}
    assert [r.arm.optimizer for r in rows] == ["adamw"] * 4 + ["muon"] * 4
    assert by_arm[Arm("adamw", 1, False)].gaps == {0: pytest.approx(0.30)}
    assert by_arm[Arm("muon", 1, False)].mean_gap == pytest.approx(0.04)
    assert by_arm[Arm("adamw", 1, True)].mean_gap_same_ef == pytest.approx(0.09)
    assert by_arm[Arm("adamw", 1, True)].ef_recovery == pytest.approx(2 / 3)
    assert by_arm[Arm("muon", 1, True)].ef_recovery == pytest.approx(0.75)
    assert by_arm[Arm("adamw", 0, True)].ef_recovery is None
    noise = study.measure_noise(rows)
    assert noise.gap is None and noise.sync is None and noise.threshold == 0


def test_noise_and_claims_over_two_seeds(tmp_path: Path):
    runs = write_runs(tmp_path, {**SEED0, **SEED1})
    rows = rows_of(runs, [0, 1])
    by_arm = {r.arm: r for r in rows}
    assert by_arm[Arm("adamw", 1, False)].gaps == {0: pytest.approx(0.30), 1: pytest.approx(0.28)}
    assert by_arm[Arm("adamw", 1, False)].mean_gap == pytest.approx(0.29)
    noise = study.measure_noise(rows)
    assert noise.gap == pytest.approx(0.02) and noise.sync == pytest.approx(0.05) and noise.threshold == pytest.approx(0.04)

    claims = study.check_ordering(rows, noise.threshold)
    assert claims[0].margins == {0: pytest.approx(0.26), 1: pytest.approx(0.24)}
    # AdamW's EF margin (0.20, 0.18) clears 0.04; Muon's (0.03 at both seeds) does not.
    assert [c.holds for c in claims] == [True, True, False]


def test_sync_repeats_give_the_threshold_without_delayed_repeats(tmp_path: Path):
    runs = write_runs(tmp_path, {**SEED0, Arm("adamw", 0, False, 1): 4.02, Arm("muon", 0, False, 1): 3.79})
    noise = study.measure_noise(rows_of(runs, [0], noise_seeds=[1]))
    assert noise.gap is None and noise.sync == pytest.approx(0.02) and noise.threshold == pytest.approx(0.04)


def test_ordering_fails_when_muon_suffers_more(tmp_path: Path):
    runs = write_runs(tmp_path, {**SEED0, Arm("muon", 1, False): 4.34})
    claims = study.check_ordering(rows_of(runs, [0]), threshold=0.0)
    assert claims[0].holds is False and claims[0].mean == pytest.approx(0.30 - 0.54)


def test_a_claim_must_hold_at_every_seed():
    claim = study.Claim("x", {0: 0.5, 1: -0.01}, threshold=0.1)
    assert claim.mean > claim.threshold and not claim.holds


def test_missing_reference_run_is_an_error(tmp_path: Path):
    runs = write_runs(tmp_path, {a: v for a, v in SEED0.items() if a != Arm("muon", 0, False)})
    with pytest.raises(KeyError, match="muon-sync"):
        rows_of(runs, [0])


def test_table_csv(tmp_path: Path):
    rows = rows_of(write_runs(tmp_path / "runs", {**SEED0, **SEED1}), [0, 1])
    study.write_table_csv(rows, tmp_path / "table.csv")
    with open(tmp_path / "table.csv", newline="") as f:
        records = list(csv.DictReader(f))
    assert len(records) == 16 and records[0]["arm"] == "adamw-sync" and records[1]["arm"] == "adamw-sync-seed1"
    delayed = next(r for r in records if r["arm"] == "adamw-delay1-ef-seed1")
    assert delayed["seed"] == "1" and float(delayed["final_validation_loss"]) == pytest.approx(4.15)
    assert float(delayed["gap_to_sync"]) == pytest.approx(0.10)
    assert float(delayed["gap_to_sync_same_ef"]) == pytest.approx(0.09)


def test_report_writes_results_and_keeps_the_analysis(tmp_path: Path):
    runs = write_runs(tmp_path / "runs", {**SEED0, **SEED1})
    out = tmp_path / "out"
    out.mkdir()
    (out / "README.md").write_text("old table\n\n## Analysis\n\nhand-written text\n")
    study.report(study.study_arms([0, 1]), runs, out, {Arm("adamw", 0, False): 12.0}, ["- command: `x`"])
    readme = (out / "README.md").read_text()
    assert "| AdamW delay 1 | 4.3000 | 4.3300 | +0.3000 | +0.2800 | +0.2900 | +0.2800..+0.3000 | +0.2900 |  |" in readme
    assert "old table" not in readme and readme.endswith("## Analysis\n\nhand-written text\n")
    assert "-> holds" in readme and "- command: `x`" in readme
    assert {p.name for p in (out / "configs").iterdir()} == {f"{a.name}.toml" for a in {**SEED0, **SEED1}}
    recorded = (out / "configs" / "muon-delay1-ef.toml").read_text()  # the source named relative to the repository
    assert recorded == '# resolved from train_configs/debug_cpu.toml\n\n[optimizer]\nname = "muon"\n'
    assert (out / "curves.png").stat().st_size > 0
    with open(out / "curves.csv", newline="") as f:
        assert sum(1 for r in csv.DictReader(f) if r["kind"] == "validation") == 3 * 16
    with open(out / "table.csv", newline="") as f:
        assert next(csv.DictReader(f))["wall_s"] == "12.0"


def test_the_recorded_study_configs_name_their_source_relative_to_the_repository():
    """Every config a study recorded under docs/results names the config it was resolved from by
    its path in the repository, not on the machine that ran it."""
    recorded = sorted((REPO / "docs" / "results").glob("*/configs/*.toml"))
    assert len(recorded) >= 96
    for path in recorded:
        source = path.read_text().splitlines()[0].removeprefix("# resolved from ")
        assert (REPO / source).is_file() and not Path(source).is_absolute(), (path, source)


def test_tokens20_regime_trains_20_tokens_per_parameter():
    regime = study.REGIMES["tokens20"]
    assert regime.parameters == staleness_runs.dense_parameters(64, 4, 512, 64) == 279_104  # the trainer's count
    assert regime.tokens == regime.steps * regime.seq_len * regime.batch
    step_tokens = regime.seq_len * regime.batch * regime.evaluations
    assert 20 * regime.parameters <= regime.tokens < 20 * regime.parameters + step_tokens
    settings = regime.settings(1e-3, 1e-2, 1e-3)
    assert settings.steps % settings.validation_freq == 0 and settings.warmup_steps == round(0.05 * settings.steps)
    assert {"data.vocab_size=512", "model.multiple_of=64", f"training.steps={regime.steps}"} <= set(settings.overrides())


def test_the_moe_regime_trains_20_tokens_per_parameter_of_every_expert():
    """The trainer's counts (its optimizer table: Muon + AdamW rows, or AdamW's total) for 8
    experts of hidden size 48 and 96 (360,448 + 68,288 and 655,360 + 68,288) and for the regime's
    4 of hidden size 48 (280,256)."""
    assert staleness_runs.moe_parameters(64, 4, 4, 512, 8, 48) == 428_736
    assert staleness_runs.moe_parameters(64, 4, 4, 512, 8, 96) == 723_648
    assert staleness_runs.moe_parameters(64, 4, 4, 512, 4, 48) == 280_256
    moe = study.regime_of(study.parse_args(["--regime", "tokens20", "--moe"]))
    assert moe.parameters == 280_256
    assert 20 * moe.parameters <= moe.tokens < 20 * moe.parameters + moe.seq_len * moe.batch * moe.evaluations
    overrides = moe.settings(1e-3, 1e-2, 1e-3).overrides()
    assert {"model.family=qwen3_moe", "model.num_experts=4", "model.moe_hidden_dim=48", "model.expert_precision=full",
            f"training.steps={moe.steps}"} <= set(overrides)
    dense = study.REGIMES["tokens20"].settings(1e-3, 1e-2, 1e-3).overrides()
    assert not any(o.startswith(("model.family", "model.num_experts", "model.expert_precision")) for o in dense)


def test_corrector_arms_and_their_overrides():
    arms = study.study_arms([0, 1], correctors=True)
    assert len(arms) == 24 and len({a.name for a in arms}) == 24
    assert arms[12:18] == [Arm("adamw", 0, True), Arm("muon", 0, True),
                           Arm("adamw", 1, False, 0, "sync_start"), Arm("muon", 1, False, 0, "sync_start"),
                           Arm("adamw", 1, False, 0, "predict"), Arm("muon", 1, False, 0, "predict")]
    sync_start = Arm("muon", 1, False, 1, "sync_start")
    assert sync_start.name == "muon-delay1-syncstart-seed1" and sync_start.label == "Muon delay 1 + Sync Start"
    assert "training.sync_start_steps=137" in sync_start.overrides(1370)
    assert "training.gradient_delay=1" in sync_start.overrides(1370)
    predict = Arm("adamw", 1, False, 0, "predict")
    assert "training.weight_prediction=1" in predict.overrides() and predict.name == "adamw-delay1-predict"
    assert not any("sync_start" in o or "weight_prediction" in o for o in Arm("adamw", 1, True).overrides(100))
    reschedule = Arm("muon", 4, False, 0, "reschedule")
    assert reschedule.name == "muon-delay4-resched" and "lr_scheduler.delay_rescheduling_steps=342" in reschedule.overrides(1370)
    assert study.study_arms([0]) == study.study_arms([0], correctors=False)


def test_corrector_rows_recover_a_share_of_the_delay_gap_with_its_spread(tmp_path: Path):
    finals = {**SEED0, **SEED1}
    finals[Arm("adamw", 1, False, 0, "predict")] = 4.15  # gap 0.15 of 0.30
    finals[Arm("adamw", 1, False, 1, "predict")] = 4.05 + 0.11  # gap 0.11 of 0.28
    runs = write_runs(tmp_path, finals)
    rows = study.build_table(study.collect(study.study_arms([0, 1], correctors=True), runs))
    row = next(r for r in rows if r.arm.corrector == "predict")
    assert rows.index(row) == 4 and row.gaps == {0: pytest.approx(0.15), 1: pytest.approx(0.11)}
    assert row.gap_range == (pytest.approx(0.11), pytest.approx(0.15))
    assert row.ef_recovery == pytest.approx(1 - 0.13 / 0.29)
    assert row.mean_gap_same_ef == pytest.approx(0.13)
    line = next(x for x in study.format_table(rows).splitlines() if x.startswith("| AdamW delay 1 + weight prediction |"))
    assert "| +0.1300 | +0.1100..+0.1500 | +0.1300 | 55% |" in line


def test_a_sweep_grows_past_an_end_that_wins_until_the_best_is_bracketed():
    base = (1e-3, 2e-3, 4e-3)
    assert study.grown(base, {1e-3: 4.3, 2e-3: 4.2, 4e-3: 4.25}, base) is None
    assert study.grown(base, {1e-3: 4.3, 2e-3: 4.2, 4e-3: 4.1}, base) == (1e-3, 2e-3, 4e-3, 8e-3)
    assert study.grown(base, {1e-3: 4.1, 2e-3: 4.2, 4e-3: float("nan")}, base) == (5e-4, 1e-3, 2e-3, 4e-3)
    longest = (*base, 8e-3, 1.6e-2)
    assert study.grown(longest, dict(zip(longest, (5, 4, 3, 2, 1))), base) is None  # EXTENSIONS reached


def test_the_seed_0_synchronous_arms_are_the_sweeps_runs_at_the_chosen_lrs(tmp_path: Path):
    settings = study.REGIMES["tokens20"].settings(6e-3, 1e-2, 6e-3)
    for name in ("adamw-lr0.006", "muon-lr0.01", "muon-lr0.02"):
        run = tmp_path / "tune" / name
        run.mkdir(parents=True)
        (run / "metrics.jsonl").write_text(json.dumps({"step": settings.steps, "kind": "validation", "validation_metrics/loss": 2.5}) + "\n")
    assert study.copied_from_the_sweep(Arm("adamw", 0, False), settings, tmp_path)
    assert study.copied_from_the_sweep(Arm("muon", 0, False), settings, tmp_path)
    assert study.finished(tmp_path / "adamw-sync", settings.steps) and study.finished(tmp_path / "muon-sync", settings.steps)
    for other in (Arm("adamw", 0, True), Arm("adamw", 1, False), Arm("adamw", 0, False, 1), Arm("muon", 1, False, 0, "predict")):
        assert not study.copied_from_the_sweep(other, settings, tmp_path)
    assert not study.copied_from_the_sweep(Arm("muon", 0, False), replace(settings, muon_lr=4e-2), tmp_path)  # not swept


def test_the_ordering_claims_read_the_rows_without_a_corrector(tmp_path: Path):
    """Sync Start and weight prediction rows share optimizer, delay and EF with the plain delayed
    row; the claims must compare the plain rows (AdamW gap 0.30 vs Muon 0.04), not the correctors'."""
    finals = dict(SEED0)
    finals[Arm("adamw", 1, False, 0, "predict")] = 4.02  # gap 0.02, below Muon's plain 0.04
    finals[Arm("muon", 1, False, 0, "predict")] = 3.83
    finals[Arm("adamw", 1, False, 0, "sync_start")] = 4.20
    finals[Arm("muon", 1, False, 0, "sync_start")] = 3.84
    rows = study.build_table(study.collect(study.study_arms([0], correctors=True), write_runs(tmp_path, finals)))
    claims = {c.text: c for c in study.check_ordering(rows, 0.0)}
    assert claims["AdamW delay gap > Muon delay gap"].mean == pytest.approx(0.30 - 0.04)
    assert claims["EF reduces AdamW's delay gap"].mean == pytest.approx(0.30 - 0.10)


def test_best_lr_and_dry_run(tmp_path: Path, capsys):
    assert study.best_lr({1e-3: 4.2, 3e-3: 4.1, 6e-3: float("nan")}) == 3e-3
    study.main(["--regime", "tokens20", "--sweep", "--seeds", "0,1", "--dry-run", "--runs-dir", str(tmp_path)])
    printed = capsys.readouterr().out
    assert "279,104 parameters" in printed and "20.1" in printed and "30 runs (8 sweep + 22 arms; 2 arms are sweep runs)" in printed
    assert printed.count("titan_async.cli train") == 30 and not any(tmp_path.iterdir())


def test_a_run_named_by_its_lr_keeps_its_own_console_log(tmp_path: Path):
    """A run named "adamw-lr0.003" logs to adamw-lr0.003.log, not to an "adamw-lr0.log" that its
    sweep's other lrs would overwrite; its failure names that log."""
    from titan_async.experiments.jobs import Job, run_job
    with pytest.raises(RuntimeError, match="adamw-lr0.003.log"):
        run_job(Job("adamw-lr0.003", tmp_path / "adamw-lr0.003", config=str(tmp_path / "missing.toml"), settings=[]))
    assert [p.name for p in tmp_path.glob("*.log")] == ["adamw-lr0.003.log"]


def test_a_killed_study_run_resumes_from_its_checkpoint_and_counts_each_step_once(tmp_path: Path):
    """A study run that saves checkpoints and was killed partway (its last checkpoint lost, its
    metrics logged past the one left) resumes there instead of starting over: its console log
    keeps the first part, the replayed steps count once, and it validates at its last step."""
    import shutil
    from titan_async.experiments.jobs import run_job
    settings = staleness_runs.Settings(steps=4, adamw_lr=1e-3, muon_lr=0.01, muon_adamw_lr=1e-3, dim=64, n_layers=2,
                                       n_heads=4, seq_len=32, batch=2, validation_freq=2, validation_steps=1, warmup_steps=1)
    run_dir = tmp_path / "adamw-delay1"
    job = staleness_runs.job(Arm("adamw", 1, False), settings, run_dir, checkpoint_every=2)
    assert not job.resumes()
    run_job(job)
    first = staleness_runs.load_curves(run_dir / "metrics.jsonl")
    shutil.rmtree(run_dir / "checkpoint" / "step-4")  # killed after logging step 4, before saving it
    assert job.resumes()
    run_job(job)
    log = run_dir.with_name("adamw-delay1.log").read_text()
    assert "step 1/4" in log and "step 3/4" in log.split("step 4/4", 1)[1]  # the first part, then the replay
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics if r.get("kind") == "validation"].count(4) == 2
    again = staleness_runs.load_curves(run_dir / "metrics.jsonl")
    assert [s for s, _ in again.train] == [1, 2, 3, 4] and [s for s, _ in again.validation] == [1, 2, 4]
    assert [loss for _, loss in again.validation] == pytest.approx([loss for _, loss in first.validation])
    assert not staleness_runs.job(Arm("adamw", 1, False), settings, tmp_path / "fresh").resumes()
