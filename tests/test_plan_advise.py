"""`plan --simulate --gpu-counts`: each layout's schedules at their best setting (activation
checkpointing x microbatch size) that fits --gpu-memory, checked against `plan --simulate` of each
setting written into the config by hand; recomputation's and TP's costs and a step without a
pipeline against the model's sizes by hand; the ranking by time to target under laws of our own."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import CONFIGS, cli_in_process
from titan_async.cluster.advise import advise
from titan_async.cluster.cluster import Cluster
from titan_async.cluster.simulate import ELEMENTWISE_PASSES, HBM_BYTES_PER_S, SimulationOptions
from titan_async.cluster.staleness import Law
from titan_async.commands.plan.command import advice_simulator
from titan_async.config.run_config import load_run_config
from titan_async.pipeline.schedules import STREAMING_SCHEDULES

CONFIG = str(CONFIGS / "debug_cpu_pp2.toml")


def plan(capsys, *args: str) -> dict:
    code, out, _ = cli_in_process(capsys, "plan", "--config", CONFIG, "--gpus-per-node", "2", "--simulate", "--json", *args)
    assert code == 0
    return json.loads(out)


def config_layout(point: dict) -> dict:
    """The config's own layout among a GPU count's layouts."""
    return next(layout for layout in point["layouts"] if layout["kind"] == "config")


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
    point = config_layout(advice["points"][0])
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
    point = config_layout(plan(capsys, "--gpu-memory", f"{min(peaks) - 1}B", "--gpu-counts", "2")["points"][0])
    for name in refused:
        assert name in point["unfit"] or point["settings"][name]["activation_checkpoint"] == "full", name
    assert any(name in point["settings"] for name in refused)


def test_gpu_counts_keep_the_global_batch_and_simulate_each_point_as_plan_does(capsys, tmp_path):
    """debug_cpu_pp2 on 2 GPUs: PP 2, 8 sequences per step. At 4 GPUs FSDP 2 halves each data
    rank's batch, at 8 GPUs a rank holds 2 sequences, 2 microbatches of 1; 3 GPUs are no whole
    number of 2-GPU nodes; 16 GPUs leave the config's layout one sequence per rank, fewer
    microbatches than stages, and FSDP over 16 GPUs 8 sequences for 16 data ranks, while TP 2 x
    FSDP 8 runs one per rank. The config layout's fastest schedule's tokens/s equals `plan
    --simulate` of the config written out by hand for that count and its setting (on nodes of the
    size given: 4 GPUs are 2 nodes of 2), and the table names the recommended row's setting."""
    picture = tmp_path / "advice.png"
    advice = plan(capsys, "--gpu-counts", "2,3,4,8,16", "--advice-png", str(picture))
    assert picture.stat().st_size > 0
    assert advice["sequences_per_step"] == 8
    assert [p["gpus"] for p in advice["points"]] == [2, 4, 8, 16]
    reasons = {s["gpus"]: s["reason"] for s in advice["skipped"]}
    assert sorted(reasons) == [3] and "whole number of 2-GPU nodes" in reasons[3]
    at_16 = {layout["layout"]: layout for layout in advice["points"][3]["layouts"]}
    fewer = at_16["PP 2 x FSDP 8"]  # one microbatch on two stages: 1F1B refused, GPipe and the streaming ones run
    assert fewer["unfit"]["1F1B"].startswith("ac=none mb=1: not simulated: train refuses it:")
    assert {"GPipe", "PipeDream2BW", "PACI"} <= set(fewer["settings"]) and fewer["settings"]["PipeDream2BW"]["delay"] == 1
    assert at_16["FSDP 16"]["reason"] == "8 sequences per step do not divide over 16 data ranks"
    assert at_16["TP 2 x FSDP 8"]["settings"]["FSDP"]["microbatch_size"] == 1
    point = config_layout(advice["points"][1])
    best = point["fastest"]
    assert point["tokens_per_second"][best] == max(point["tokens_per_second"].values())
    chosen = point["settings"][best]
    as_simulated = "1F1B" if 4 // chosen["microbatch_size"] >= 2 else "GPipe"  # 1F1B refuses one microbatch on two stages
    hand = by_setting(capsys, chosen["activation_checkpoint"], chosen["microbatch_size"], "--nodes", "2",
                      "--set", "training.local_batch_size=4", "--set", "parallelism.data_parallel_shard_degree=2",
                      "--set", f"parallelism.pipeline_parallel_schedule={as_simulated}")
    by_hand = {s["name"]: s["tokens_per_second"] for s in hand["simulation"]["schedules"]}
    assert point["tokens_per_second"][best] == pytest.approx(by_hand[best], rel=1e-9)
    assert chosen["m_over_p"] == 4 / chosen["microbatch_size"] / 2

    recommended = advice["points"][1]["recommended"]
    code, out, _ = cli_in_process(capsys, "plan", "--config", CONFIG, "--gpus-per-node", "2", "--simulate", "--gpu-counts", "2,4")
    assert code == 0
    line = next(line for line in out.splitlines() if line.startswith("4 ") and line.endswith("<- recommended"))
    for cell in (recommended["layout"], recommended["setting"], f"{recommended['tokens_per_second']:,.0f}"):
        assert cell in line


def matmul_weights(model: dict, layers: int, head: bool) -> int:
    """Weights of the matmuls of `layers` llama3 blocks (wq, wk, wv, wo; w1, w2, w3) and the output head."""
    dim, kv = model["dim"], model["dim"] * model["n_kv_heads"] // model["n_heads"]
    return layers * (2 * dim * dim + 2 * dim * kv + 3 * dim * model["ffn_dim"]) + head * model["vocab_size"] * dim


def training_flops(model: dict, layers: int, head: bool, tokens: int, seq: int) -> float:
    """6 x matmul weights x tokens plus causal attention, 6 x layers x tokens x seq x dim."""
    return 6 * matmul_weights(model, layers, head) * tokens + 6 * layers * tokens * seq * model["dim"]


@pytest.mark.parametrize("nodes", [1, 2])
def test_a_step_without_a_pipeline_by_hand_on_one_and_two_nodes(capsys, nodes):
    """Pipeline degree 1, FSDP over 2 GPUs on one node and over 4 on two nodes, 8 sequences per
    step one per forward (K = 4 or 2 accumulated microbatches), float32 throughout. By hand: each
    microbatch's forward and backward (1:2 of its FLOPs at the MFU), the forward after the FSDP
    gather of the weights (ring: (f - 1) / f of P x 4 bytes), the backward followed by a second
    gather and the reduce-scatter, each overlapped unit by unit with that compute (U = blocks +
    embedding + norm and head units, exposed max(C / U, C - compute (U - 1) / U)), over the
    intra-node link on one node and the inter-node link on two; then AdamW's element-wise step."""
    gpus, inter_gbps = 2 * nodes, 1.0
    out = plan(capsys, "--nodes", str(nodes), "--inter-node-gbps", str(inter_gbps), "--set", "parallelism.pipeline_parallel_degree=1",
               "--set", "parallelism.data_parallel_shard_degree=-1", "--set", "training.local_batch_size=1",
               "--set", "training.global_batch_size=8", "--set", "activation_checkpoint.mode=none")
    model, seq, options = out["model"], 256, SimulationOptions(inter_node_gbps=inter_gbps)
    assert (out["layout"]["compute_dtype"], out["layout"]["reduce_dtype"], out["layout"]["param_dtype"]) == ("float32",) * 3
    flops = training_flops(model, model["n_layers"], True, seq, seq)
    forward, backward = flops / 3 / options.flops_per_s, 2 * flops / 3 / options.flops_per_s
    bandwidth = (options.intra_node_gbps if nodes == 1 else inter_gbps) * 1e9
    moved = model["parameters"] * 4 * (gpus - 1) / gpus / bandwidth
    units = model["n_layers"] + 2

    def exposed(collective: float, compute: float) -> float:
        return max(collective / units, collective - compute * (units - 1) / units)

    accumulated = 8 // gpus
    optimizer = ELEMENTWISE_PASSES * model["parameters"] / gpus * 4 / HBM_BYTES_PER_S
    step = accumulated * (exposed(moved, forward) + forward + backward + exposed(2 * moved, backward)) + optimizer
    [row] = out["simulation"]["schedules"]
    assert row["name"] == "FSDP"
    assert row["step_seconds"] == pytest.approx(step, rel=1e-9)
    assert row["tokens_per_second"] == pytest.approx(8 * seq / step, rel=1e-9)


@pytest.mark.parametrize("per_node", [4, 1])
def test_tensor_parallel_collectives_cross_the_link_their_group_spans(capsys, per_node):
    """PP 2 x TP 2 (sequence parallel, microbatches of 2 sequences, float32, no recomputation) on
    one node of 4 GPUs, then on 4 nodes of 1, where the TP pair spans two nodes. Each rank's
    forward is its FLOPs / TP at the MFU plus, per block, 2 all-gathers and 2 reduce-scatters of the
    (tokens x dim) activation (the embedding's stage one more, the head's one more), each moving
    (tp - 1) / tp of it over the intra-node link, or the inter-node link once TP exceeds a node's
    GPUs; the backward twice the FLOPs and as many collectives."""
    out = plan(capsys, "--gpus-per-node", str(per_node), "--nodes", str(4 // per_node), "--set", "parallelism.tensor_parallel_degree=2",
               "--set", "activation_checkpoint.mode=none")
    model, seq, options, tp = out["model"], 256, SimulationOptions(), 2
    assert out["layout"]["sequence_parallel"] and out["layout"]["compute_dtype"] == "float32"
    tokens = out["layout"]["microbatch_tokens"] * tp
    bandwidth = (options.intra_node_gbps if per_node >= tp else options.inter_node_gbps) * 1e9
    activation = tokens * model["dim"] * 4 * (tp - 1) / tp / bandwidth
    costs = out["simulation"]["costs"]
    for rank, row in enumerate(out["ranks"]):
        modules = [module for stage in row["stages"] for module in stage["modules"]]
        blocks = sum(module.startswith("layers.") for module in modules)
        collectives = 4 * blocks + ("tok_embeddings" in modules) + ("lm_head" in modules)
        flops = training_flops(model, blocks, "lm_head" in modules, tokens, seq) / tp / options.flops_per_s
        assert costs["forward"][rank] == pytest.approx(flops / 3 + collectives * activation, rel=1e-9)
        assert costs["backward"][rank] == pytest.approx(2 * flops / 3 + collectives * activation, rel=1e-9)


def law(coefficient: float, spread: float = 2.0) -> Law:
    """A staleness law of our own: ln(1 / eta) = coefficient for AdamW without a corrector."""
    return Law({"adamw+none": coefficient}, 0.0, 0.0, spread, (1, 10**9), (1, 10**12), "test")


@pytest.mark.parametrize("coefficient", [5.0, 1e-6])
def test_the_law_decides_between_the_streaming_schedule_and_the_synchronous_layouts(coefficient):
    """debug_cpu_pp2 on 2 GPUs (AdamW, no corrector, 150 steps of 2,048 tokens): PipeDream2BW
    has the most tokens/s of every layout. A law costing the delay e^-5 of its tokens makes a
    synchronous layout the recommended one, one costing about nothing 2BW; every row's hours are
    150 x 2,048 / (tokens/s x efficiency) / 3600 with the law's range (e^(-c x 2), e^(-c / 2))."""
    run = load_run_config(Path(CONFIG))
    advice = advise(run, Cluster(1, 2, 80 * 2**30), [2], advice_simulator(SimulationOptions()), law(coefficient))
    [point] = advice["points"]
    rows = [{"layout": layout["layout"], "schedule": name, **chosen}
            for layout in point["layouts"] if "reason" not in layout for name, chosen in layout["settings"].items()]
    fastest = max(rows, key=lambda row: row["tokens_per_second"])
    assert fastest["schedule"] in STREAMING_SCHEDULES
    for row in rows:
        streaming = row["schedule"] in STREAMING_SCHEDULES
        efficiency = math.exp(-coefficient) if streaming else 1.0
        assert row["efficiency"] == pytest.approx(efficiency, rel=1e-12)
        assert row["hours"] == pytest.approx(150 * 2048 / (row["tokens_per_second"] * efficiency) / 3600, rel=1e-12)
        if streaming:
            expected = (math.exp(-2 * coefficient), math.exp(-coefficient / 2))
            assert (row["efficiency_low"], row["efficiency_high"]) == pytest.approx(expected)
    by_time = min(rows, key=lambda row: row["hours"])
    recommended = point["recommended"]
    assert (recommended["layout"], recommended["schedule"]) == (by_time["layout"], by_time["schedule"])
    for side, chosen in ((True, point["best_streaming"]), (False, point["best_synchronous"])):
        mine = min((row for row in rows if (row["schedule"] in STREAMING_SCHEDULES) == side), key=lambda row: row["hours"])
        assert (chosen["layout"], chosen["schedule"]) == (mine["layout"], mine["schedule"])
    if coefficient > 1:
        assert recommended["schedule"] not in STREAMING_SCHEDULES
        assert point["fastest"]["schedule"] == fastest["schedule"]
    else:
        assert (recommended["layout"], recommended["schedule"]) == (fastest["layout"], fastest["schedule"])


def test_a_layout_that_fits_nowhere_says_why(capsys):
    """At a GPU memory 1 byte below the smallest peak of any schedule at any setting of the
    config's layout (PP 2 on 2 GPUs; each setting's peaks from `plan --simulate` by hand), that
    layout's line names the schedule and setting of that peak, while a layout without a pipeline
    still fits and is recommended."""
    peaks = {}
    for mode in ("none", "selective", "full"):
        for size in (1, 2, 4):
            for row in by_setting(capsys, mode, size)["simulation"]["schedules"]:
                refused = mode == "selective" and row["name"] in ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV", "PACI")
                if row.get("memory") and not refused:
                    peaks[row["name"], f"ac={mode} mb={size}"] = row["memory"]["peak_bytes"]
    (name, setting), peak = min(peaks.items(), key=lambda item: item[1])
    advice = plan(capsys, "--gpu-memory", f"{peak - 1}B", "--gpu-counts", "2")
    point = advice["points"][0]
    reason = config_layout(point)["reason"]
    assert reason == f"{name}: no setting fits --gpu-memory; the smallest peak is {peak / 2**30:.1f} GiB ({setting})"
    assert point["best"]["config"] == f"PP 2: {reason}"
    assert point["recommended"]["kind"] == "no pipeline"
    code, out, _ = cli_in_process(capsys, "plan", "--config", CONFIG, "--gpus-per-node", "2", "--simulate",
                                  "--gpu-memory", f"{peak - 1}B", "--gpu-counts", "2")
    assert code == 0 and f"2 GPUs, PP 2: {reason}" in out.splitlines()


def test_without_a_law_for_the_optimizer_every_layout_is_ranked_by_tokens_per_second():
    """A law fitted to Muon only leaves AdamW's delay unknown: the streaming schedules have no
    efficiency and no hours, the synchronous ones efficiency 1, the recommended row is the one
    with the most tokens/s, and one line says why."""
    run = load_run_config(Path(CONFIG))
    muon_only = Law({"muon+ef": 1.0}, 0.0, 0.0, 2.0, (1, 10**9), (1, 10**12), "test")
    advice = advise(run, Cluster(1, 2, 80 * 2**30), [2], advice_simulator(SimulationOptions()), muon_only)
    [point] = advice["points"]
    rows = [{"layout": layout["layout"], "schedule": name, **chosen}
            for layout in point["layouts"] if "reason" not in layout for name, chosen in layout["settings"].items()]
    for row in rows:
        streaming = row["schedule"] in STREAMING_SCHEDULES
        assert (row["efficiency"] is None) == streaming and (row["hours"] is None) == streaming
    fastest = max(rows, key=lambda row: row["tokens_per_second"])
    assert (point["recommended"]["layout"], point["recommended"]["schedule"]) == (fastest["layout"], fastest["schedule"])
    assert len(advice["notes"]) == 1 and "ranked by tokens/s" in advice["notes"][0]


@pytest.mark.parametrize("exponent", [1.0, None])
def test_fewer_microbatches_than_stages_cost_the_streaming_schedules_their_delay(exponent):
    """debug_cpu_pp2 at PP 4 on 4 GPUs with 2 sequences per step: microbatches of 1 make m = 2
    (d = ceil(3 / 2) = 2), of 2 m = 1 (d = 3); 1F1B is refused there. Under a law whose delay term
    is d ** 1, PipeDream2BW's rows cost e^(-c d); under one without a delay term they have no
    efficiency, rank after every row of known time, and a line says why."""
    c = 0.01
    run = load_run_config(Path(CONFIG), ["parallelism.pipeline_parallel_degree=4", "training.local_batch_size=2"])
    fitted = replace(law(c), delay_exponents={} if exponent is None else {"adamw+none": exponent}, delays=(1, 4))
    advice = advise(run, Cluster(1, 4, 80 * 2**30), [4], advice_simulator(SimulationOptions()), fitted)
    [point] = advice["points"]
    config = config_layout(point)
    assert "1F1B" in config["unfit"] and "train refuses it" in config["unfit"]["1F1B"]
    two_bw = config["settings"]["PipeDream2BW"]
    assert two_bw["delay"] == math.ceil(3 / (2 // two_bw["microbatch_size"])) > 1
    rows = [{"layout": layout["layout"], "schedule": name, **chosen}
            for layout in point["layouts"] if "reason" not in layout for name, chosen in layout["settings"].items()]
    if exponent is None:
        assert two_bw["efficiency"] is None and two_bw["hours"] is None
        assert point["recommended"]["hours"] is not None
        assert any("no delay term" in note for note in advice["notes"])
        return
    assert two_bw["efficiency"] == pytest.approx(math.exp(-c * two_bw["delay"]), rel=1e-12)
    known = [row for row in rows if row["hours"] is not None]
    best = min(known, key=lambda row: row["hours"])
    assert (point["recommended"]["layout"], point["recommended"]["schedule"]) == (best["layout"], best["schedule"])
