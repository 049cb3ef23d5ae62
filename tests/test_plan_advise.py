"""`plan --simulate --gpu-counts`: each schedule at its fastest setting (activation checkpointing x
microbatch size) that fits --gpu-memory, checked against `plan --simulate` of each setting written
into the config by hand, and recomputation's cost against the model's sizes."""

from __future__ import annotations

import json

import pytest

from conftest import CONFIGS, cli_in_process
from titan_async.cluster.simulate import SimulationOptions

CONFIG = str(CONFIGS / "debug_cpu_pp2.toml")


def plan(capsys, *args: str) -> dict:
    code, out, _ = cli_in_process(capsys, "plan", "--config", CONFIG, "--gpus-per-node", "2", "--simulate", "--json", *args)
    assert code == 0
    return json.loads(out)


def by_setting(capsys, mode: str, size: int, *args: str) -> dict:
    return plan(capsys, "--set", f"activation_checkpoint.mode={mode}", "--set", f"parallelism.pipeline_parallel_microbatch_size={size}",
                *args)


def test_recomputation_is_charged_in_the_backward(capsys):
    """Full recomputation adds each rank's forward to its backward; selective adds every second
    matmul of each block (wo and w3: 2 x tokens x (dim^2 + dim x ffn_dim) per block) at the MFU."""
    costs = {mode: by_setting(capsys, mode, 1)["simulation"]["costs"] for mode in ("none", "selective", "full")}
    layout = by_setting(capsys, "none", 1)
    dim, ffn, seq = layout["model"]["dim"], layout["model"]["ffn_dim"], 256
    flops_per_s = SimulationOptions().flops_per_s
    for rank, row in enumerate(layout["ranks"]):
        blocks = sum(module.startswith("layers.") for stage in row["stages"] for module in stage["modules"])
        none, selective, full = (costs[mode]["backward"][rank] for mode in ("none", "selective", "full"))
        assert full == pytest.approx(none + costs["none"]["forward"][rank], rel=1e-9)
        assert selective - none == pytest.approx(2 * seq * blocks * (dim * dim + dim * ffn) / flops_per_s, rel=1e-6)
        assert costs["selective"]["forward"][rank] == costs["none"]["forward"][rank]


def test_memory_headroom_buys_the_setting_without_recomputation(capsys):
    """4 sequences per data rank on 2 ranks: microbatches of 1 or 2 (m >= p), each with every
    recomputation mode. At a GPU memory of 1F1B's peak without recomputation (microbatches of 1),
    GPipe, which holds every microbatch, fits only with recomputation: its chosen setting is the
    fastest of those whose peak fits, as `plan --simulate` of each setting gives them, slower than
    without recomputation, and 1F1B keeps its setting without it."""
    batch = ("--set", "training.local_batch_size=4")
    hand = {(mode, size): by_setting(capsys, mode, size, *batch)["simulation"]["schedules"]
            for mode in ("none", "selective", "full") for size in (1, 2)}
    rows = {(key, row["name"]): row for key, schedules in hand.items() for row in schedules}
    memory = rows[("none", 1), "1F1B"]["memory"]["peak_bytes"]

    def fastest(name: str) -> tuple[tuple[str, int], float]:
        fitting = {key: rows[key, name]["tokens_per_second"] for key in hand if rows[key, name]["memory"]["peak_bytes"] <= memory}
        best = max(fitting, key=fitting.get)
        return best, fitting[best]

    advice = plan(capsys, *batch, "--gpu-memory", f"{memory}B", "--gpu-counts", "2")
    point = advice["points"][0]
    for name in ("1F1B", "GPipe"):
        (mode, size), tokens = fastest(name)
        chosen = point["settings"][name]
        assert (chosen["activation_checkpoint"], chosen["microbatch_size"]) == (mode, size), name
        assert chosen["setting"] == f"ac={mode} mb={size}"
        assert point["tokens_per_second"][name] == pytest.approx(tokens, rel=1e-9)
    assert point["settings"]["1F1B"]["activation_checkpoint"] == "none"
    assert point["settings"]["GPipe"]["activation_checkpoint"] != "none"
    gpipe = point["settings"]["GPipe"]
    assert gpipe["tokens_per_second"] < rows[("none", gpipe["microbatch_size"]), "GPipe"]["tokens_per_second"]


def test_selective_is_never_chosen_for_the_split_backward_schedules_or_paci(capsys):
    """train refuses selective recomputation with InterleavedZeroBubble, ZBVZeroBubble, DualPipeV
    and PACI: at a GPU memory below each one's every peak without recomputation, the advisor
    gives them full recomputation (or nothing), never selective."""
    refused = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV", "PACI")
    peaks = [row["memory"]["peak_bytes"] for size in (1, 2, 4) for row in by_setting(capsys, "none", size)["simulation"]["schedules"]
             if row["name"] in refused and row.get("memory")]
    point = plan(capsys, "--gpu-memory", f"{min(peaks) - 1}B", "--gpu-counts", "2")["points"][0]
    for name in refused:
        assert name in point["unfit"] or point["settings"][name]["activation_checkpoint"] == "full", name
    assert any(name in point["settings"] for name in refused)


def test_gpu_counts_keep_the_global_batch_and_simulate_each_point_as_plan_does(capsys, tmp_path):
    """debug_cpu_pp2 on 2 GPUs: PP 2, 8 sequences per step. At 4 GPUs FSDP 2 halves each data
    rank's batch, at 8 GPUs a rank holds 2 sequences, 2 microbatches of 1; 3 GPUs are no whole
    number of 2-GPU nodes, 16 GPUs leave one sequence per rank, fewer microbatches than stages.
    The recommended schedule's tokens/s equals `plan --simulate` of the config written out by hand
    for that count and its setting (on nodes of the size given: 4 GPUs are 2 nodes of 2), and the
    table names each schedule's setting."""
    picture = tmp_path / "advice.png"
    advice = plan(capsys, "--gpu-counts", "2,3,4,8,16", "--advice-png", str(picture))
    assert picture.stat().st_size > 0
    assert advice["sequences_per_step"] == 8
    assert [p["gpus"] for p in advice["points"]] == [2, 4, 8]
    reasons = {s["gpus"]: s["reason"] for s in advice["skipped"]}
    assert sorted(reasons) == [3, 16] and "whole number of 2-GPU nodes" in reasons[3] and "fewer microbatches" in reasons[16]
    point = advice["points"][1]
    best = point["recommended"]
    assert point["tokens_per_second"][best] == max(point["tokens_per_second"].values())
    chosen = point["settings"][best]
    hand = by_setting(capsys, chosen["activation_checkpoint"], chosen["microbatch_size"], "--nodes", "2",
                      "--set", "training.local_batch_size=4", "--set", "parallelism.data_parallel_shard_degree=2")
    by_hand = {s["name"]: s["tokens_per_second"] for s in hand["simulation"]["schedules"]}
    assert point["tokens_per_second"][best] == pytest.approx(by_hand[best], rel=1e-9)
    assert chosen["m_over_p"] == 4 / chosen["microbatch_size"] / 2

    code, out, _ = cli_in_process(capsys, "plan", "--config", CONFIG, "--gpus-per-node", "2", "--simulate", "--gpu-counts", "2,4")
    assert code == 0
    assert chosen["setting"] in out
    assert f"{point['tokens_per_second'][best]:,.0f} ({chosen['activation_checkpoint']}, mb {chosen['microbatch_size']})" in out
