"""tools/tta_study.py end to end on two tiny pipeline arms: its runs, table and JSON, whose times to
target are `titan-async compare`'s."""

from __future__ import annotations

import csv
import math
import json
import subprocess
import sys

import pytest

from conftest import REPO, TINY, fresh_environment
from titan_async.commands.compare import compare


def test_tta_study_trains_two_arms_and_tabulates_compares_time_to_target(tmp_path):
    runs, out = tmp_path / "runs", tmp_path / "out"
    command = [sys.executable, "tools/tta_study.py", "--schedules", "1F1B,PipeDream2BW", "--optimizers", "adamw",
               "--seeds", "0", "--baseline", "1F1B:adamw", "--steps", "4", "--validation-freq", "2",
               "--runs-dir", str(runs), "--out", str(out)]
    for setting in TINY:
        command += ["--set", setting]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900, env=fresh_environment())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    baseline, streaming = runs / "1F1B-adamw-seed0", runs / "PipeDream2BW-adamw-seed0"
    _, expected = compare([baseline, streaming])
    recorded = json.loads((out / "results.json").read_text())
    assert recorded["per_seed"]["0"] == json.loads(json.dumps(expected))
    base, other = expected["runs"]
    assert base["speedup"] == pytest.approx(1.0) and base["steps_to_target"] <= 4

    table = {row["arm"]: row for row in recorded["table"]}
    assert sorted(table) == ["1F1B-adamw", "PipeDream2BW-adamw"]
    assert table["PipeDream2BW-adamw"]["mean_speedup"] == other["speedup"]
    assert table["PipeDream2BW-adamw"]["reached"] == ("1/1" if other["speedup"] is not None else "0/1")
    with open(out / "table.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["arm"], r["seed"]) for r in rows] == [("1F1B-adamw", "0"), ("PipeDream2BW-adamw", "0")]
    assert float(rows[0]["time_to_target_s"]) == pytest.approx(base["time_to_target_s"], abs=1e-4)

    readme = (out / "README.md").read_text()
    assert f"| 1F1B-adamw | {base['time_to_target_s']:.1f} | 1/1 | 1.00x |" in readme
    assert "tools/tta_study.py --schedules 1F1B,PipeDream2BW" in readme and "git revision" in readme and "load average" in readme
    assert sorted(p.name for p in (out / "configs").iterdir()) == ["1F1B-adamw-seed0.toml", "PipeDream2BW-adamw-seed0.toml"]
    assert (runs / "1F1B-adamw-seed0" / "config.toml").read_text().startswith(f"# resolved from {REPO}/")
    recorded = (out / "configs" / "1F1B-adamw-seed0.toml").read_text()
    assert recorded.startswith("# resolved from train_configs/debug_cpu_pp2.toml\n") and str(REPO) not in recorded
    assert len(list(out.glob("*.png"))) == 6


def test_the_predicted_speedup_is_the_simulated_tokens_ratio_times_the_laws_efficiency():
    sys.path.insert(0, str(REPO / "tools"))
    import tta_predicted

    from titan_async.cluster.staleness import Law

    law = Law({"muon+none": 0.2, "muon+ef": 0.05}, 0.5, 0.0, 1.5, (350, 5460), (279_104, 541_536), "test")
    def arm(name, tokens, speedups):
        return {"arm": name, "mean_tokens_per_s": tokens, "seeds": {str(i): {"speedup": s} for i, s in enumerate(speedups)}}

    measured = {"table": [arm("1F1B-muon", 1000, [1.0, 1.0]), arm("PipeDream2BW-muon", 1300, [None, 1.2]),
                          arm("Interleaved1F1B-muon-ef", 1100, [1.1, 1.3]), arm("PACI-muon-ef", 1250, [1.4, 1.5]),
                          arm("PACI-adamw", 1250, [None, None])]}
    plan = {"model": {"parameters": 6_000_000},
            "simulation": {"schedules": [{"name": "1F1B", "tokens_per_second": 2000}, {"name": "Interleaved1F1B", "tokens_per_second": 2200},
                                         {"name": "PipeDream2BW", "tokens_per_second": 2400}, {"name": "PACI", "tokens_per_second": 2500}]}}
    rows = {r["arm"]: r for r in tta_predicted.predict(measured, plan, 250, law)}
    assert set(rows) == {"1F1B-muon", "PipeDream2BW-muon", "Interleaved1F1B-muon-ef", "PACI-muon-ef"}  # Muon arms only
    # 250 steps lie below the law's 350: ln(1/eta) = c x (350 / 1000)^-0.5, held there; the range
    # divides and multiplies it by 1.5
    held = 0.35 ** -0.5
    assert rows["PipeDream2BW-muon"]["predicted_speedup"] == pytest.approx(1.2 * math.exp(-0.2 * held))
    assert rows["PipeDream2BW-muon"]["predicted_speedup_range"] == pytest.approx(
        [1.2 * math.exp(-0.3 * held), 1.2 * math.exp(-0.2 * held / 1.5)])
    assert rows["PipeDream2BW-muon"]["measured_speedup"] == 1.2  # the seed that reached the target
    assert rows["PACI-muon-ef"]["measured_over_predicted"] == pytest.approx(1.45 / (1.25 * math.exp(-0.05 * held)))
    assert rows["Interleaved1F1B-muon-ef"]["token_efficiency"] == 1.0
    assert rows["Interleaved1F1B-muon-ef"]["measured_tokens_per_s_ratio"] == pytest.approx(1.1)
    assert "steps 250 lie outside" in rows["PACI-muon-ef"]["extrapolated"][0]
