"""Weights & Biases in offline mode (`metrics.enable_wandb`, `metrics.wandb_mode = "offline"`).

The test reads the offline run files W&B itself wrote (`run-<id>.wandb`: W&B's record log, a
LevelDB-style log of protobuf `Record`s, decoded here by hand with W&B's own protobuf classes)
and compares their history with metrics.jsonl and the per-stage pipeline/stage<s>.jsonl files.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from wandb.proto import wandb_internal_pb2

from conftest import CONFIGS, TINY, run_cli, sets

BLOCK = 32768
"""W&B's record log is written in blocks of this many bytes; a record header never straddles one."""
FULL, LAST = 1, 4


def records(path: Path):
    """The protobuf records of a W&B run file: a 7-byte header (":W&B", magic, version), then
    chunks with a 7-byte header (CRC-32C, length, type: full, first, middle, last)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    position, pending = 7, b""
    while position + 7 <= len(data):
        left = BLOCK - position % BLOCK
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if left < 7 or (kind == 0 and length == 0):
            position += left
            continue
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def history(run_dir: Path, run_id: str) -> dict[int, dict[str, float]]:
    """Step -> scalars of W&B run `run_id`, over every offline session of it in `run_dir`."""
    steps, sessions = {}, 0
    for path in sorted(run_dir.rglob(f"run-{run_id}.wandb")):
        sessions += 1
        for record in records(path):
            if record.WhichOneof("record_type") == "run":
                assert record.run.run_id == run_id and record.run.run_group == run_id.partition("-")[0]
            if record.WhichOneof("record_type") == "history":
                items = {item.key or "/".join(item.nested_key): item.value_json for item in record.history.item}
                steps.setdefault(record.history.step.num, {}).update(
                    {key: json.loads(value) for key, value in items.items() if not key.startswith("_")})
    return steps, sessions


def test_offline_run_holds_the_runs_scalars_and_each_stages_and_resume_appends(tmp_path):
    run_dir = tmp_path / "run"
    common = (*TINY, "parallelism.pipeline_parallel_schedule=PipeDream2BW", "validation.enable=false",
              "metrics.enable_wandb=true", "metrics.wandb_mode=offline", "metrics.wandb_rank_runs=true",
              "checkpoint.interval=2")
    run_cli("train", "--config", str(CONFIGS / "debug_cpu_pp2.toml"), "--nproc-per-node", "2", "--run-dir", str(run_dir),
            *sets(*common, "training.steps=4"))
    run_id = json.loads((run_dir / "launch.json").read_text())["run_id"]
    run_cli("resume", "--run-dir", str(run_dir), *sets("training.steps=6"))
    assert json.loads((run_dir / "launch.json").read_text())["run_id"] == run_id

    logged, sessions = history(run_dir, run_id)
    assert sessions == 2  # the resumed session appends to the same run
    losses = {row["step"]: row["loss_metrics/global_avg_loss"] for row in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
              if row["kind"] == "train"}
    assert sorted(losses) == list(range(1, 7))
    assert {step: logged[step]["loss_metrics/global_avg_loss"] for step in losses} == losses
    for stage in (0, 1):
        per_stage, sessions = history(run_dir, f"{run_id}-stage{stage}")
        rows = [json.loads(line) for line in (run_dir / "pipeline" / f"stage{stage}.jsonl").read_text().splitlines()]
        assert sessions == 2 and sorted(per_stage) == list(range(1, 7)) == [row["step"] for row in rows]
        for row in rows:
            assert per_stage[row["step"]]["pipeline/bubble"] == row["bubble"]
            assert per_stage[row["step"]]["pipeline/staleness"] == row["staleness"]
    assert len({path.name for path in run_dir.rglob("run-*.wandb")}) == 3  # the job's run and one per stage
