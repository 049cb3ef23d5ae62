"""tools/bench_schedules.py end to end on a tiny model: it trains each schedule and writes its table."""

from __future__ import annotations

import csv
import subprocess
import sys

from conftest import REPO, fresh_environment


def test_benchmark_runs_sync_and_streaming_schedules_and_saves_the_table(tmp_path):
    command = [sys.executable, "tools/bench_schedules.py", "--stages", "2", "--microbatches", "2", "--microbatch-size", "1",
               "--seq-len", "32", "--dim", "64", "--layers", "3", "--steps", "5", "--warmup", "1", "--reps", "1",
               "--schedules", "1F1B,Interleaved1F1B,PipeDream2BW", "--out", str(tmp_path)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600, env=fresh_environment())
    assert result.returncode == 0, result.stderr[-3000:]
    weights = next(line for line in result.stdout.splitlines() if line.startswith("stage weights MiB per rank: "))
    rows = list(csv.reader(open(tmp_path / "bench_schedules_p2_m2.csv")))
    assert rows[0][:3] == ["schedule", "tokens/s", "vs 1F1B"]
    table = {row[0]: row for row in rows[1:]}
    assert sorted(table) == ["1F1B", "Interleaved1F1B", "PipeDream2BW"]
    assert float(table["1F1B"][2]) == 1.0 and float(table["PipeDream2BW"][1].replace(",", "")) > 0
    bubbles = [float(b.rstrip("%")) / 100 for b in table["PipeDream2BW"][3].split()]
    assert len(bubbles) == 2 and all(0 <= b < 1 for b in bubbles)
    assert table["1F1B"][3] == "[33%] [33%]"
    # 2BW holds exactly one extra copy of each rank's stage weights (as planned)
    assert table["PipeDream2BW"][6].split() == weights.split(": ")[1].split()
    assert (tmp_path / "bench_schedules_p2_m2.png").stat().st_size > 0
