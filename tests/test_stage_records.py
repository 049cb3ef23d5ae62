"""The one writer per pipeline stage (`titan_async.train.stage_records`), in this process."""

from __future__ import annotations

import builtins
import json
from pathlib import Path
from types import SimpleNamespace

from titan_async.train.stage_records import StageRecords, written_stage

NO_LOGGERS = SimpleNamespace(enable_tensorboard=False, enable_wandb=False, wandb_rank_runs=False)


def test_each_stage_has_one_writer_its_first_rank_at_512_ranks():
    writers = {rank: written_stage(rank, 512, 8) for rank in range(512)}
    assert {rank: stage for rank, stage in writers.items() if stage is not None} == {64 * s: s for s in range(8)}
    assert [rank for rank in range(512) if written_stage(rank, 512, 1) is not None] == [0]  # no pipeline, or emulated stages
    assert all(written_stage(rank, 4, 4) == rank for rank in range(4))


def test_a_stage_writer_creates_its_folder_and_opens_its_file_once_and_flushes_each_step(tmp_path, monkeypatch):
    calls = []
    real_mkdir, real_open = Path.mkdir, builtins.open
    monkeypatch.setattr(Path, "mkdir", lambda self, *a, **k: (calls.append(("mkdir", self)), real_mkdir(self, *a, **k))[1])
    monkeypatch.setattr(builtins, "open", lambda file, *a, **k: (calls.append(("open", file)), real_open(file, *a, **k))[1])
    path = tmp_path / "pipeline" / "stage3.jsonl"
    records = StageRecords(tmp_path, 3, NO_LOGGERS)
    for step in range(1, 6):
        records.write({"step": step, "rank": 192, "bubble": 0.1 * step})
        with real_open(path) as f:
            assert [json.loads(line)["step"] for line in f] == list(range(1, step + 1))
    records.close()
    assert calls == [("mkdir", tmp_path / "pipeline"), ("open", path)]
