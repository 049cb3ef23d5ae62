"""The delay's cost model: the staleness law (titan_async/cluster/staleness.py), the scaling study
that fits it (tools/staleness_scaling.py) on synthetic records, and `plan --staleness`."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from dataclasses import replace

import pytest

from conftest import CONFIGS, REPO, cli_in_process
from titan_async.cluster import staleness
from titan_async.cluster.staleness import Law
from titan_async.commands.plan.staleness import staleness_report, staleness_text
from titan_async.config.run_config import load_run_config

sys.path.insert(0, str(REPO / "tools"))
_SPEC = importlib.util.spec_from_file_location("staleness_scaling", REPO / "tools" / "staleness_scaling.py")
scaling = importlib.util.module_from_spec(_SPEC)
sys.modules["staleness_scaling"] = scaling
_SPEC.loader.exec_module(scaling)

LAW = Law({"muon+none": 0.2, "muon+ef": 0.05, "muon+predict": 0.1, "adamw+none": 0.8, "adamw+ef": 0.2, "adamw+predict": 0.2},
          0.5, 0.25, 2.0, (500, 8000), (100_000, 1_000_000), "test")


def test_the_law_evaluates_its_power_law_with_its_residual_range_and_names_what_it_extrapolates():
    # 0.2 x (4000 / 1000)^-0.5 x (16e6 / 1e6)^-0.25 = 0.2 x 0.5 x 0.5 = 0.05
    found = staleness.estimate("muon", "none", 4000, 16_000_000, LAW)
    assert found.efficiency == pytest.approx(math.exp(-0.05))
    assert (found.low, found.high) == (pytest.approx(math.exp(-0.1)), pytest.approx(math.exp(-0.025)))
    assert found.tokens_factor == pytest.approx(math.exp(0.05))
    assert found.extrapolated == ("parameters 16,000,000 lie outside the studies' 100,000..1,000,000 (16x beyond)",)
    assert staleness.estimate("adamw", "ef", 1000, 1_000_000, LAW).extrapolated == ()
    fewer = staleness.estimate("adamw", "ef", 100, 1_000_000, LAW)  # held at the fewest studied steps, 500
    assert "steps 100 lie outside" in fewer.extrapolated[0]
    assert fewer.efficiency == pytest.approx(math.exp(-0.2 * 0.5 ** -0.5)) == staleness.estimate("adamw", "ef", 500, 1_000_000, LAW).efficiency
    with pytest.raises(KeyError):
        staleness.estimate("sgd", "none", 1000, 1_000_000, LAW)
    paper = replace(LAW, out_of_sample_factors={"muon+none": 10.0})  # only an extrapolating prediction reaches the paper's
    assert staleness.estimate("muon", "none", 4000, 16_000_000, paper).low == pytest.approx(math.exp(-0.5))
    assert staleness.estimate("muon", "none", 4000, 16_000_000, paper).high == pytest.approx(math.exp(-0.025))
    assert staleness.estimate("muon", "none", 4000, 1_000_000, paper).low == pytest.approx(math.exp(-0.2 * 0.5 * 2))
    wide = replace(LAW, range_factors={"muon+none": 4.0, "muon+ef": 1.2})  # the wider of the two factors counts
    assert staleness.estimate("muon", "none", 4000, 16_000_000, wide).low == pytest.approx(math.exp(-0.2))
    assert staleness.estimate("muon", "ef", 4000, 16_000_000, wide).low == pytest.approx(math.exp(-2 * 0.0125))


def test_a_longer_delay_scales_the_laws_cost_by_its_delay_exponent_and_names_an_untrained_delay():
    # at 1000 steps of 1e6 parameters ln(1/eta) = c; at d = 4 with exponent 1.5: c x 4^1.5 = 8 c
    delayed = replace(LAW, delay_exponents={"muon+none": 1.5}, delays=(1, 4))
    found = staleness.estimate("muon", "none", 1000, 1_000_000, delayed, delay=4)
    assert found.efficiency == pytest.approx(math.exp(-0.2 * 8)) and found.extrapolated == ()
    assert staleness.estimate("muon", "none", 1000, 1_000_000, delayed, delay=1).efficiency == pytest.approx(math.exp(-0.2))
    assert staleness.estimate("muon", "none", 1000, 1_000_000, delayed, delay=8).extrapolated == (
        "a delay of 8 lies outside the studies' 1..4 (2x beyond)",)
    with pytest.raises(KeyError):  # no exponent fitted for it: no estimate at d > 1
        staleness.estimate("muon", "ef", 1000, 1_000_000, delayed, delay=2)


def test_the_gap_is_the_efficiency_on_chinchillas_loss_curve():
    def chinchilla_loss(tokens: float) -> float:  # Hoffmann et al. 2022, approach 3, at a fixed model size
        return 1.69 + 406.4 / 1e9 ** 0.34 + 410.7 / tokens ** 0.28

    tokens, efficiency = 2e11, 0.9
    # The synchronous run reaches the delayed run's loss at efficiency x the tokens: the gap is the
    # loss difference between the two budgets (to first order in ln(1/efficiency)).
    expected = chinchilla_loss(efficiency * tokens) - chinchilla_loss(tokens)
    assert staleness.gap(efficiency, tokens) == pytest.approx(expected, rel=0.02)
    step = 1e-4
    numeric = -(chinchilla_loss(tokens * math.exp(step)) - chinchilla_loss(tokens)) / step
    assert staleness.chinchilla_slope(tokens) == pytest.approx(numeric, rel=1e-3)


def test_the_corrector_of_a_run():
    assert staleness.corrector_of(False, 0.0) == "none"
    assert staleness.corrector_of(True, 0.0) == "ef"
    assert staleness.corrector_of(False, 1.0) == "predict"


def _cell(name: str, dim: int, batch: int):
    return scaling.Cell(name, scaling._regime(dim, batch), 6e-3, 1e-2)


def _synthetic_record(cells, law: Law, slope: float, seeds=(0,)) -> dict[str, dict]:
    """A study record whose synchronous final losses lie exactly on L(D) = 5 - slope ln D (each
    budget its own run), and whose delayed runs sit `slope` x ln(1/eta) above, eta from `law`."""
    record = {}

    def add(cell, run, loss):
        settings = run.settings({"adamw": 6e-3, "muon": 1e-2})
        entry = scaling.entry_of(run, settings, [(settings.steps, loss)], 1.0, "synthetic")
        record[f"{cell.name}/{run.name}"] = entry

    for cell in cells:
        steps = cell.settings(1, 1).steps
        for optimizer, lr in (("adamw", 6e-3), ("muon", 1e-2)):
            for sweep_lr in (lr / 2, lr, 2 * lr):  # the middle lr wins the sweep
                run = scaling.Run(cell, scaling.Arm(optimizer, 0, False), sweep_lr, sweep=True)
                settings = run.settings({})
                tokens = settings.steps * settings.seq_len * settings.batch
                add(cell, run, 5 - slope * math.log(tokens) + (0 if sweep_lr == lr else 0.1))
            for budget in scaling.BUDGETS:
                run = scaling.Run(cell, scaling.Arm(optimizer, 0, False), lr, budget)
                settings = run.settings({optimizer: lr})
                add(cell, run, 5 - slope * math.log(settings.steps * settings.seq_len * settings.batch))
            full = cell.settings(1, 1)
            sync = 5 - slope * math.log(full.steps * full.seq_len * full.batch)
            for corrector in staleness.CORRECTORS:
                y = law.log_inefficiency(optimizer, corrector, steps, cell.regime.parameters)
                for seed in seeds:
                    if seed:
                        add(cell, scaling.Run(cell, scaling.Arm(optimizer, 0, False, seed), lr), sync + 0.01 * seed)
                    add(cell, scaling.Run(cell, scaling.corrector_arm(optimizer, corrector, seed), lr), sync + 0.01 * seed + slope * y)
    return record


def test_the_study_reads_token_efficiency_from_the_budget_runs_and_its_fit_recovers_a_known_law(monkeypatch):
    cells = [_cell("s", 64, 64), _cell("m", 64, 16), _cell("l", 64, 4), _cell("wide", 96, 32)]
    monkeypatch.setattr(scaling, "CELLS", {c.name: c for c in cells})
    monkeypatch.setattr(scaling, "SEEDS_OF_CELL", {c.name: (0, 1) for c in cells})
    law = replace(LAW, parameters_exponent=0.4, steps_exponents={"adamw": 0.3, "muon": 0.9})  # each optimizer its own
    record = _synthetic_record(cells, law, slope=0.3, seeds=(0, 1))
    points = scaling.measure(record, cells)
    assert len(points) == 4 * 2 * 3
    for p in points:
        assert p.slope == pytest.approx(0.3)
        assert p.mean == pytest.approx(law.log_inefficiency(p.optimizer, p.corrector, p.steps, p.cell.regime.parameters))
    fit = scaling.fit_law(points, "synthetic")
    assert fit.law.steps_exponents == pytest.approx({"adamw": 0.3, "muon": 0.9})
    assert fit.law.steps_exponent == pytest.approx(0.6)
    assert fit.law.parameters_exponent == pytest.approx(0.4)
    assert fit.law.coefficients == pytest.approx(law.coefficients)
    assert fit.law.residual_factor == pytest.approx(1.0)
    assert fit.law.steps == (350, 5460) and fit.law.parameters == (279_104, 541_536)


def test_the_fit_leaves_out_points_without_a_measurable_cost_and_fixes_an_exponent_it_cannot_identify(monkeypatch):
    cells = [_cell("s", 64, 64), _cell("l", 64, 4)]  # one model size: the parameters exponent is not identified
    monkeypatch.setattr(scaling, "CELLS", {c.name: c for c in cells})
    monkeypatch.setattr(scaling, "SEEDS_OF_CELL", {c.name: (0,) for c in cells})
    law = replace(LAW, coefficients={**LAW.coefficients, "muon+ef": -0.01})  # EF more than closes Muon's gap
    fit = scaling.fit_law(scaling.measure(_synthetic_record(cells, law, slope=0.2), cells), "synthetic")
    assert [(p.optimizer, p.corrector) for p, _ in fit.excluded] == [("muon", "ef")] * 2
    assert fit.law.coefficients["muon+ef"] == 0.0
    assert staleness.estimate("muon", "ef", 1000, 279_104, fit.law).efficiency == 1.0
    assert fit.law.parameters_exponent == 0.0
    assert fit.law.steps_exponent == pytest.approx(0.5)


def test_the_study_trains_each_cells_sweep_first_and_grows_a_grid_whose_best_lr_is_at_its_end(monkeypatch):
    cell = _cell("s", 64, 64)
    monkeypatch.setattr(scaling, "SEEDS_OF_CELL", {"s": (0, 1)})
    record: dict[str, dict] = {}
    first = list(scaling.pending([cell], record))
    assert [r.name for r in first] == ["tune-adamw-lr0.003", "tune-adamw-lr0.006", "tune-adamw-lr0.012",
                                       "tune-muon-lr0.005", "tune-muon-lr0.01", "tune-muon-lr0.02"]
    for run in first:  # AdamW's best lr is its largest; Muon's is bracketed
        loss = -run.lr if run.arm.optimizer == "adamw" else abs(run.lr - 0.01)
        record[run.key] = scaling.entry_of(run, run.settings({}), [(350, loss)], 1.0, "synthetic")
    assert [r.name for r in scaling.pending([cell], record)] == ["tune-adamw-lr0.024"]
    grown = scaling.Run(cell, scaling.Arm("adamw", 0, False), 0.024, sweep=True)
    record[grown.key] = scaling.entry_of(grown, grown.settings({}), [(350, 1.0)], 1.0, "synthetic")
    assert scaling.best_of(cell, record) == {"adamw": 0.012, "muon": 0.01}
    after = [r.name for r in scaling.pending([cell], record)]
    assert after[:4] == ["adamw-delay1", "muon-delay1", "adamw-sync-budget0.5", "muon-sync-budget0.5"]
    assert after[6:8] == ["adamw-delay1-ef", "muon-delay1-ef"]
    assert after[-4:] == ["adamw-sync-seed1", "muon-sync-seed1", "adamw-delay1-seed1", "muon-delay1-seed1"]


def test_the_out_of_sample_factor_is_how_far_the_law_undershoots_the_papers_points():
    law = replace(LAW, parameters_exponent=0.0)
    factors = scaling.out_of_sample_factors(law)
    # 360M Muon: the paper's gap 0.012 on Chinchilla's slope at 7.2B tokens, against the law at
    # sqrt(20,000 x 40,000) steps; the 10B MoE point (gap 0.005 at 200B tokens, 50,000 steps) is the other Muon one
    dense = 0.012 / staleness.chinchilla_slope(7.2e9) / (0.2 * (math.sqrt(20_000 * 40_000) / 1000) ** -0.5)
    moe = 0.005 / staleness.chinchilla_slope(200e9) / (0.2 * 50 ** -0.5)
    assert factors["muon+none"] == pytest.approx(max(dense, moe), rel=1e-3)
    assert factors["muon+predict"] == factors["muon+ef"]  # the paper trained no weight prediction
    assert factors["adamw+none"] == pytest.approx(0.278 / staleness.chinchilla_slope(7.2e9) / (0.8 * 28.28 ** -0.5), rel=1e-3)


def test_the_seeds_spread_widens_a_coefficients_range():
    cell = _cell("s", 64, 64)
    spread = scaling.Point(cell, "muon", "ef", {0: 0.04, 1: 0.01}, 1.0, 350)  # ln(1/eta) 0.04 and 0.01: sqrt(4)
    crossing = scaling.Point(cell, "muon", "ef", {0: 0.03, 1: -0.01}, 1.0, 350)  # mean 0.01, largest seed 0.03
    assert scaling.seed_spread_factor([spread]) == pytest.approx(2.0)
    assert scaling.seed_spread_factor([spread, crossing]) == pytest.approx(3.0)
    assert scaling.seed_spread_factor([scaling.Point(cell, "muon", "ef", {0: 0.04}, 1.0, 350)]) == 1.0


def test_a_torn_last_line_of_the_record_is_ignored(tmp_path):
    path = tmp_path / "runs.jsonl"
    path.write_text(json.dumps({"cell": "b4", "run": "adamw-delay1", "validation": [[10, 3.0]]}) + "\n{\"cell\": \"b4\", \"ru")
    assert list(scaling.load_record(path)) == ["b4/adamw-delay1"]


def test_plan_staleness_predicts_each_correctors_cost_for_the_config():
    run = load_run_config(CONFIGS / "10b_2bw_muon.toml")
    report = staleness_report(run, 10_000_000_000, 4_194_304, law=LAW)
    steps = run.training.steps
    tokens = steps * 4_194_304
    assert report["tokens"] == tokens and report["config_corrector"] == "ef"
    for corrector, found in report["correctors"].items():
        y = LAW.coefficients[f"muon+{corrector}"] * (steps / 1000) ** -0.5 * (1e10 / 1e6) ** -0.25
        assert found["token_efficiency"] == pytest.approx(math.exp(-y))
        assert found["token_efficiency_range"] == pytest.approx([math.exp(-2 * y), math.exp(-y / 2)])
        assert found["gap"] == pytest.approx(staleness.chinchilla_slope(tokens) * y)
    assert any(note.startswith("parameters 10,000,000,000 lie outside") for note in report["extrapolated"])
    assert not any("delays each gradient by" in note for note in report["notes"])


def test_plan_staleness_says_where_the_configs_delay_is_not_one_step():
    """2BW with fewer microbatches than stages delays by d steps, PACI stepping every a < p - 1
    backwards crosses several updates: the delay-1 law understates both, and the notes say so."""
    run = load_run_config(CONFIGS / "10b_2bw_muon.toml")
    notes = staleness_report(run, 10_000_000_000, 4_194_304, delay=3, stages=8, window=3, law=LAW)["notes"]
    assert notes[0].startswith("this config delays each gradient by 3 steps") and "understate" in notes[0]
    delayed = replace(LAW, delay_exponents={"muon+ef": 2.0}, delays=(1, 4))  # ln(1/eta) x 3^2 at d = 3
    report = staleness_report(run, 10_000_000_000, 4_194_304, delay=3, stages=8, window=3, law=delayed)
    at_delay = report["correctors"]["ef"]["at_delay"]
    assert at_delay["delay"] == 3 and "at_delay" not in report["correctors"]["none"]
    assert math.log(1 / at_delay["token_efficiency"]) == pytest.approx(9 * math.log(1 / report["correctors"]["ef"]["token_efficiency"]))
    assert "the 'at d' lines add the law's delay term" in report["notes"][0] and "at d = 3" in staleness_text(report)
    paci = load_run_config(CONFIGS / "10b_paci_adamw.toml", ["parallelism.paci.accumulation=2"])
    notes = staleness_report(paci, 10_000_000_000, 4_194_304, stages=8, window=16, law=LAW)["notes"]
    assert "a microbatch crosses up to 4 updates of its stage" in notes[-1]
    every_seventh = load_run_config(CONFIGS / "10b_paci_adamw.toml", ["parallelism.paci.accumulation=7"])
    notes = staleness_report(every_seventh, 10_000_000_000, 4_194_304, stages=8, window=16, law=LAW)["notes"]
    assert "bound its cost from above" in notes[-1]


def test_plan_staleness_json_carries_the_shipped_laws_prediction(capsys):
    status, out, _ = cli_in_process(capsys, "plan", "--config", str(CONFIGS / "10b_2bw_muon.toml"), "--nodes", "8",
                                    "--gpus-per-node", "8", "--staleness", "--json")
    assert status == 0
    plan = json.loads(out)
    found = plan["staleness"]
    assert found["parameters"] == plan["model"]["parameters"]
    assert found["tokens"] == plan["layout"]["tokens_per_step"] * found["steps"]
    shipped = staleness.law()
    for corrector in staleness.CORRECTORS:
        expected = staleness.estimate("muon", corrector, found["steps"], found["parameters"], shipped)
        assert found["correctors"][corrector]["token_efficiency"] == pytest.approx(expected.efficiency)
    status, _, err = cli_in_process(capsys, "plan", "--config", str(CONFIGS / "10b_2bw_muon.toml"), "--staleness",
                                    "--simulate", "--gpu-counts", "64")
    assert status == 2 and err.startswith("titan-async: --staleness: applies only without --gpu-counts")


def test_the_longer_delays_train_first_and_their_table_reads_each_delays_gap(monkeypatch):
    """The d = 2 and 4 arms of the longer-delay cell come before the other runs still pending (a
    second seed here); the section gives each delay's mean gap over the seeds and its efficiency
    on the cell's own slope."""
    cell = _cell("m", 64, 16)
    monkeypatch.setattr(scaling, "CELLS", {"m": cell})
    monkeypatch.setattr(scaling, "SEEDS_OF_CELL", {"m": (0, 1)})
    monkeypatch.setattr(scaling, "LONGER_DELAYS", ("m", (2, 4), (0, 1)))
    record = _synthetic_record([cell], LAW, slope=0.3, seeds=(0, 1))
    assert scaling._longer_delays_section(record) is None
    left = next(key for key in record if key.endswith("-seed1"))
    kept = record.pop(left)
    queued = [r.name for r in scaling.pending([cell], record)]
    assert queued[:6] == ["adamw-delay2", "muon-delay2", "adamw-delay2-ef", "muon-delay2-ef", "adamw-delay2-predict",
                          "muon-delay2-predict"]
    assert len(queued) == 33 and queued[-2:] == ["muon-delay4-resched-seed1", left.split("/")[1]]
    record[left] = kept
    full = cell.settings(1, 1)
    sync = 5 - 0.3 * math.log(full.steps * full.seq_len * full.batch)
    for run in scaling.longer_delay_runs(cell, {"adamw": 6e-3, "muon": 1e-2}):
        gap = 0.01 * run.arm.seed + 0.03 * run.arm.delay  # seed 1's synchronous run is 0.01 higher
        record[run.key] = scaling.entry_of(run, run.settings({}), [(full.steps, sync + gap)], 1.0, "synthetic")
    table = scaling._longer_delays_section(record)
    assert "| muon | none | 4 | +0.1200, +0.1200 | +0.4000 | 0.670 | 1.492x |  |" in table
    assert "| adamw | predict | 2 | +0.0600, +0.0600 | +0.2000 | 0.819 | 1.221x | 0% |" in table  # as long a gap as the plain delay's
    assert "| muon | reschedule | 4 | +0.1200, +0.1200 |" in table and "| muon | reschedule | 1 |" not in table  # d = 1: no run
    assert next(line for line in table.splitlines() if line.startswith("| muon | ef | 1 |")).endswith("| 75% |")  # 1 - 0.05 / 0.2
    exponents, delays = scaling.delay_exponents(record)
    y1 = LAW.log_inefficiency("muon", "none", full.steps, cell.regime.parameters)  # y_2 = 0.06 / 0.3, y_4 = 0.12 / 0.3
    assert exponents["muon+none"] == pytest.approx((math.log(0.2 / y1) / math.log(2) + math.log(0.4 / y1) / math.log(4)) / 2)
    assert delays == (1, 4) and len(exponents) == 6 and f"muon+none {exponents['muon+none']:.2f}" in table
    assert not list(scaling.pending([cell], record))
