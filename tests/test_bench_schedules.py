"""tools/bench_schedules.py end to end on a tiny model: it trains each schedule and writes its table;
and its ideal step time on a hand-written trace."""

from __future__ import annotations

import csv
import importlib.util
import json
import subprocess
import sys

import pytest

from conftest import REPO, fresh_environment

_SPEC = importlib.util.spec_from_file_location("bench_schedules", REPO / "tools" / "bench_schedules.py")
bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench)


def test_ideal_step_time_is_the_slowest_rank_never_waiting(tmp_path):
    # rank 0: forwards 1, 1, 3 ms (median 1), backwards 2 ms, optimizer 0.5 ms: 2 x 3 + 0.5 = 6.5 ms;
    # rank 1: forwards 2 ms, backwards 3 ms, optimizer 1 ms: 2 x 5 + 1 = 11 ms, the slowest
    durations = {0: [("0F0", 1), ("0F1", 1), ("0F2", 3), ("0B0", 2), ("0B1", 2), ("0O0", 0.5)],
                 1: [("1F0", 2), ("1B0", 3), ("1F1", 2), ("1B1", 3), ("1O0", 1)]}
    events = [{"name": name, "ph": "X", "pid": 0, "tid": rank, "ts": 0.0, "dur": ms * 1e3}
              for rank, actions in durations.items() for name, ms in actions]
    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": events}))
    assert bench.ideal_step_time(tmp_path / "trace.json", microbatches=2) == pytest.approx(0.011)


def number(cell: str) -> float:
    return float(cell.replace(",", ""))


def assert_ratio(printed: str, numerator: str, denominator: str | float) -> None:
    """`printed` (3 decimals) is numerator / denominator, tokens/s printed as whole numbers: within
    the rounding of all three."""
    a, b = number(numerator), denominator if isinstance(denominator, float) else number(denominator)
    assert float(printed) == pytest.approx(a / b, abs=5e-4 + a / b * (0.5 / a + 0.5 / b))


def test_benchmark_runs_sync_zero_bubble_and_streaming_schedules_and_saves_the_table(tmp_path):
    command = [sys.executable, "tools/bench_schedules.py", "--stages", "2", "--microbatches", "2", "--microbatch-size", "1",
               "--seq-len", "32", "--dim", "64", "--layers", "3", "--steps", "5", "--warmup", "1", "--reps", "1",
               "--schedules", "1F1B,ZBVZeroBubble,PipeDream2BW", "--out", str(tmp_path), "--simulate"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900, env=fresh_environment())
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    weights = next(line for line in lines if line.startswith("stage weights MiB per rank: "))
    ideal = number(next(line for line in lines if line.startswith("ideal ")).split(": ")[1].removesuffix(" tokens/s"))
    with open(tmp_path / "bench_schedules_p2_m2.csv") as f:
        rows = list(csv.DictReader(f))
    table = {row["schedule"]: row for row in rows}
    assert list(table) == ["1F1B", "ZBVZeroBubble", "PipeDream2BW"]
    for row in rows:
        assert number(row["min"]) <= number(row["tokens/s"]) <= number(row["max"])
        # each ratio is the row's median tokens/s over its reference's, to the table's rounding
        assert_ratio(row["vs 1F1B"], row["tokens/s"], table["1F1B"]["tokens/s"])
        assert_ratio(row["of ideal"], row["tokens/s"], ideal)
    synchronous = [table[s] for s in ("1F1B", "ZBVZeroBubble")]
    best = max(synchronous, key=lambda row: number(row["tokens/s"]))
    assert f"best synchronous: {best['schedule']}" in result.stdout
    for row in rows:
        assert_ratio(row["vs best sync"], row["tokens/s"], best["tokens/s"])
    assert float(table["1F1B"]["vs 1F1B"]) == 1.0 and float(best["vs best sync"]) == 1.0

    for row in rows:  # measured from every run's trace
        bubbles = [float(b.rstrip("%")) / 100 for b in row["bubble per rank"].split()]
        assert len(bubbles) == 2 and all(0 <= b < 1 for b in bubbles)
    # (p-1)/(m+p-1) for 1F1B; no formula for zero bubble
    assert table["1F1B"]["formula bubble"] == "33%"
    assert table["ZBVZeroBubble"]["formula bubble"] == table["PipeDream2BW"]["formula bubble"] == "-"
    # 2BW holds exactly one extra copy of each rank's stage weights (as planned)
    assert table["PipeDream2BW"]["weight copies MiB per rank"].split() == weights.split(": ")[1].split()
    assert (tmp_path / "bench_schedules_p2_m2.png").stat().st_size > 0

    # --simulate: each run simulated from its own trace, beside the measured ratio of the same run
    with open(tmp_path / "bench_schedules_p2_m2_simulated.csv") as f:
        simulated = {row["schedule"]: row for row in csv.DictReader(f)}
    assert list(simulated) == list(table)
    for schedule, row in simulated.items():
        assert row["measured vs 1F1B"] == table[schedule]["vs 1F1B"]
        assert number(row["simulated tokens/s"]) > 0
        # one repetition: its own pair; both ratios are printed to 0.0005 and the difference to 0.05%
        measured, simulated_ratio = float(row["measured vs 1F1B"]), float(row["simulated vs 1F1B"])
        lowest = 100 * ((simulated_ratio - 0.0005) / (measured + 0.0005) - 1) - 0.05
        highest = 100 * ((simulated_ratio + 0.0005) / (measured - 0.0005) - 1) + 0.05
        assert lowest <= float(row["difference"].rstrip("%")) <= highest
    assert simulated["1F1B"]["simulated vs 1F1B"] == "1.000"
    assert "largest difference: " in result.stdout


def test_benchmark_with_fsdp_prints_each_ranks_fsdp_traffic_against_1f1b(tmp_path):
    command = [sys.executable, "tools/bench_schedules.py", "--stages", "2", "--fsdp", "2", "--microbatches", "2",
               "--microbatch-size", "1", "--seq-len", "32", "--dim", "64", "--layers", "3", "--steps", "4", "--warmup", "1",
               "--reps", "1", "--schedules", "1F1B,PipeDream2BW", "--out", str(tmp_path)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900, env=fresh_environment())
    assert result.returncode == 0, result.stderr[-3000:]
    with open(tmp_path / "bench_schedules_p2_m2_fsdp2.csv") as f:
        table = {row["schedule"]: row for row in csv.DictReader(f)}
    traffic = {s: [float(x) for x in row["collective MiB/step per rank"].split()] for s, row in table.items()}
    assert len(traffic["1F1B"]) == 2 and all(x > 0 for x in traffic["1F1B"])  # each stage's first rank
    for schedule, row in table.items():
        worst = max(mine / base for mine, base in zip(traffic[schedule], traffic["1F1B"]))
        assert float(row["collective vs 1F1B (worst rank)"]) == pytest.approx(worst, abs=2e-3)
        assert row["replica all-reduce MiB/step per rank"].split() == ["0"] * 2
    # a streaming stage gathers once per weight version and reduces once per update
    assert float(table["PipeDream2BW"]["collective vs 1F1B (worst rank)"]) <= 1.3
    assert "largest per-rank collective bytes vs 1F1B: PipeDream2BW" in result.stdout


def test_benchmark_with_replicas_and_accumulation_counts_each_ranks_all_reduce(tmp_path):
    """DDP (2 replicas per stage) accumulating 2 local batches: each rank all-reduces its float32 stage
    gradient, as many bytes as the stage's weights, once per step under 2BW and once per flush, twice,
    under 1F1B (the table holds each stage's first rank)."""
    command = [sys.executable, "tools/bench_schedules.py", "--stages", "2", "--replicas", "2", "--accumulate", "2",
               "--microbatches", "2", "--microbatch-size", "1", "--seq-len", "32", "--dim", "64", "--layers", "3",
               "--steps", "4", "--warmup", "1", "--reps", "1", "--schedules", "1F1B,PipeDream2BW", "--out", str(tmp_path)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900, env=fresh_environment())
    assert result.returncode == 0, result.stderr[-3000:]
    weights = next(line for line in result.stdout.splitlines() if line.startswith("stage shard MiB per pipeline rank: "))
    stage_mib = [float(x) for x in weights.split(": ")[1].split()]
    with open(tmp_path / "bench_schedules_p2_m2_replicas2_accumulate2.csv") as f:
        table = {row["schedule"]: row for row in csv.DictReader(f)}
    all_reduce = {s: [float(x) for x in row["replica all-reduce MiB/step per rank"].split()] for s, row in table.items()}
    assert all_reduce["PipeDream2BW"] == pytest.approx(stage_mib, abs=0.006)
    assert all_reduce["1F1B"] == pytest.approx([2 * x for x in all_reduce["PipeDream2BW"]], rel=1e-3)
    for row in table.values():  # one GPU per FSDP group: nothing to gather or reduce-scatter
        assert row["collective MiB/step per rank"] == row["replica all-reduce MiB/step per rank"]
    assert float(table["PipeDream2BW"]["collective vs 1F1B (worst rank)"]) == pytest.approx(0.5, abs=2e-3)
    assert "PipeDream2BW 0.500x (within the accepted 1.1x)" in result.stdout


def test_run_and_table_compute_tokens_bubble_and_ideal_from_the_raw_records(tmp_path, monkeypatch, capsys):
    """`run` and `report` on hand-written stage records and trace (no training): the printed
    tokens/s, ratios, bubbles and 1F1B's formula bubble against our own arithmetic on the raw rows."""
    args = bench.argparse.Namespace(stages=2, fsdp=1, replicas=1, accumulate=1, microbatches=2, microbatch_size=1, seq_len=32,
                                    warmup=1, steps=5, simulate=False, out=tmp_path / "out", reps=1, vocab=0,
                                    balance=False)
    monkeypatch.setattr(bench, "titan_async", lambda *a, **k: None)
    step_times = {"1F1B": [0.0, 1.0, 1.25, 1.5, 1.75, 2.0], "PipeDream2BW": [0.0, 1.0, 1.1, 1.3, 1.4, 2.0]}  # steps 2-4 measured
    bubbles = {0: [0.5, 0.1, 0.3, 0.2, 0.9], 1: [0.5, 0.4, 0.0, 0.2, 0.9]}  # per rank, steps 1-5
    durations = {0: [("0F0", 1), ("0F1", 3), ("0F2", 1), ("0B0", 2), ("0B1", 2), ("0O0", 1)],
                 1: [("1F0", 2), ("1B0", 3), ("1F1", 2), ("1B1", 3), ("1O0", 0.5)]}  # slowest: 2 x (2 + 3) + 0.5 = 10.5 ms
    results = {}
    for schedule, times in step_times.items():
        run_dir = tmp_path / schedule
        (run_dir / "pipeline").mkdir(parents=True)
        for rank in (0, 1):
            rows = [{"step": s, "time": times[s], "bubble": bubbles[rank][s - 1], "memory_gib": 1.0} for s in range(1, 6)]
            (run_dir / "pipeline" / f"stage{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        events = [{"name": n, "ph": "X", "pid": 0, "tid": r, "ts": 0.0, "dur": ms * 1e3} for r, acts in durations.items() for n, ms in acts]
        (run_dir / "pipeline" / "trace.json").write_text(json.dumps({"traceEvents": events}))
        results[schedule] = [bench.run(schedule, args, run_dir)]
    bench.report(results, {0: 1.0, 1: 1.0}, args)
    out = capsys.readouterr().out
    tokens = 1 * 2 * 32  # microbatch size x microbatches x sequence length
    speed = {"1F1B": tokens / 0.25, "PipeDream2BW": tokens / 0.1}  # medians of step times (0.25, 0.25, 0.25) and (0.1, 0.2, 0.1)
    ideal = tokens / 0.0105
    with open(tmp_path / "out" / "bench_schedules_p2_m2.csv") as f:
        table = {row["schedule"]: row for row in csv.DictReader(f)}
    for schedule, row in table.items():
        assert number(row["tokens/s"]) == pytest.approx(speed[schedule], abs=0.5)
        assert float(row["vs 1F1B"]) == pytest.approx(speed[schedule] / speed["1F1B"], abs=5e-4)
        assert float(row["of ideal"]) == pytest.approx(speed[schedule] / ideal, abs=5e-4)
        # median over the measured steps 2-4: rank 0 of (0.1, 0.3, 0.2), rank 1 of (0.4, 0.0, 0.2)
        assert row["bubble per rank"] == "20.0% 20.0%"
    assert table["1F1B"]["formula bubble"] == "33%"  # (p - 1) / (m + p - 1) = 1 / 3
    assert f"{ideal:,.0f} tokens/s" in out


def test_balance_report_pairs_each_ratio_within_its_repetition(tmp_path, capsys):
    """The reference is the synchronous default-split variant of the highest median (1F1B: 110
    against GPipe's 100); a balanced variant's gain is its tokens/s over its own schedule's
    default split in the same repetition, measured and simulated alike, as min / median / max."""
    def runs(measured, simulated):
        return [{"tokens_per_s": m, "simulated_tokens_per_s": s} for m, s in zip(measured, simulated)]

    results = {"GPipe": runs([100, 100, 100], [10, 10, 10]),
               "1F1B": runs([100, 110, 120], [10, 10, 20]),
               "1F1B balanced": runs([110, 99, 150], [12, 11, 20]),
               "PipeDream2BW": runs([200, 220, 120], [20, 30, 20])}
    bench.report_balance(results, tmp_path / "gain.csv")
    with open(tmp_path / "gain.csv") as f:
        rows = {row[0]: row[1:] for row in list(csv.reader(f))[1:]}
    assert rows["GPipe"][:2] == ["0.833 / 0.909 / 1.000", "0.500 / 1.000 / 1.000"]
    assert rows["PipeDream2BW"][:2] == ["1.000 / 2.000 / 2.000", "1.000 / 2.000 / 3.000"]
    assert rows["1F1B balanced"] == ["0.900 / 1.100 / 1.250", "1.000 / 1.100 / 1.200",
                                     "0.900 / 1.100 / 1.250", "1.000 / 1.100 / 1.200"]
    assert rows["1F1B"][2:] == ["", ""]
    assert "measured vs 1F1B" in capsys.readouterr().out
