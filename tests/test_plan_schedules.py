"""`plan` across schedules: activation chunks in flight counted on torch's own action lists,
each simulated schedule's peak memory, and Muon's exchange charged to the optimizer step."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import CONFIGS, cli_in_process, sets

from titan_async.cluster.estimate import Cluster, estimate
from titan_async.cluster.memory import held_microbatches
from titan_async.commands.plan.render import _plain, _simulation_table
from titan_async.cluster.simulate import SimulationOptions, rank_costs
from titan_async.config.run_config import load_run_config
from titan_async.optim.muon_cost import stage_costs
from titan_async.optim.routing import route_parameters
from titan_async.pipeline.schedules import register

pytestmark = pytest.mark.filterwarnings("ignore:DTensor random operators")
TEN_B = CONFIGS / "10b_2bw_muon.toml"
CLUSTER = Cluster(8, 8, 80 * 2**30)


def with_schedule(run, name: str):
    """`run` with only its pipeline schedule changed."""
    return dataclasses.replace(run, parallelism=dataclasses.replace(run.parallelism, pipeline_parallel_schedule=name))


def torch_in_flight(schedule: str, ranks: int, microbatches: int) -> list[int]:
    """Each rank's most activation chunks alive at once, walked here on the action lists torch
    builds: +1 at F, -1 at a full backward or at the W of a split one (torch's I keeps the graph
    for its W: retain_graph=True); an overlapped F;B counts its F first."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
    from torch.distributed.pipelining.schedules import _ComputationType as T

    peaks = []
    for actions in get_schedule_ops(schedule, ranks, microbatches):
        alive = peak = 0
        for action in actions:
            for part in (action.sub_actions or (action,)) if action is not None else ():
                alive += {T.FORWARD: 1, T.FULL_BACKWARD: -1, T.BACKWARD_WEIGHT: -1}.get(part.computation_type, 0)
                peak = max(peak, alive)
        peaks.append(peak)
    return peaks


@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "DualPipeV"])
@pytest.mark.parametrize("p", range(4, 9))
def test_v_schedules_hold_what_torchs_action_lists_hold(schedule, p):
    for m in (2 * p, 4 * p):
        assert [held_microbatches(schedule, r, p, m, 2) for r in range(p)] == torch_in_flight(schedule, p, m), m


@pytest.mark.parametrize("p", range(4, 9))
def test_1f1b_gpipe_and_interleaved_in_flight_keep_their_hand_formulas(p):
    for m in (p, 2 * p, 4 * p):
        v = 2
        assert [held_microbatches("1F1B", r, p, m, 1) for r in range(p)] == [min(m, p - r) for r in range(p)]
        assert [held_microbatches("GPipe", r, p, m, 1) for r in range(p)] == [m] * p
        assert [held_microbatches("Interleaved1F1B", r, p, m, v) for r in range(p)] == [
            min(m * v, (v - 1) * p + 2 * (p - 1 - r) + 1) for r in range(p)]
        assert [held_microbatches("Interleaved1F1B", r, p, m, v) for r in range(p)] == torch_in_flight("Interleaved1F1B", p, m)


@pytest.fixture(scope="module")
def ten_b():
    register()
    return load_run_config(TEN_B)


@pytest.mark.parametrize("schedule,held", [("ZBVZeroBubble", 16), ("DualPipeV", 17)])
def test_ten_b_v_schedules_hold_torchs_16_or_17_chunks_not_23(ten_b, schedule, held):
    rows = estimate(with_schedule(ten_b, schedule), CLUSTER).rows
    assert [r["held_microbatches"] for r in rows] == torch_in_flight(schedule, 8, 32) == [held] * 8
    assert [len(r["stages"]) for r in rows] == [2] * 8


def test_simulated_schedules_show_their_peak_memory_2bw_with_its_second_weight_version(capsys):
    status, out, err = cli_in_process(capsys, "plan", "--config", str(TEN_B), "--nodes", "8", "--gpus-per-node", "8",
                                      "--gpu-memory", "80GiB", "--simulate", "--json")
    assert status == 0, err
    plan = json.loads(out)
    rows = {s["name"]: s for s in plan["simulation"]["schedules"]}
    assert all(row["memory"] and row["memory"]["peak_bytes"] > 0 for row in rows.values())
    two_bw, one_f_one_b = rows["PipeDream2BW"]["memory"], rows["1F1B"]["memory"]
    assert two_bw["peak_bytes"] == plan["peak_bytes"]  # the config's own schedule: its own estimate
    rank = two_bw["pp_rank"]
    assert one_f_one_b["rank_peaks"][rank] <= one_f_one_b["peak_bytes"]
    # the 2BW rank's weight shard by hand: its stage's parameters over 8 FSDP ranks, float32
    shard = plan["ranks"][rank]["parameters"] / 8 * 4
    assert two_bw["memory"]["weight_versions"] == pytest.approx(shard, abs=1)
    assert one_f_one_b["pp_rank"] == rank and one_f_one_b["memory"]["weight_versions"] == 0
    for key in ("weights", "gradients", "optimizer", "error_feedback"):
        assert two_bw["memory"][key] == one_f_one_b["memory"][key], key
    # GPipe holds all 32 microbatches (the last rank's logits too): it does not fit 80 GiB
    assert not rows["GPipe"]["memory"]["fits"] and rows["1F1B"]["memory"]["fits"]
    table = _plain(_simulation_table(plan)).splitlines()
    assert "peak GiB" in table[1]
    for line in table[2:]:
        name, *_ = line.split()
        memory = rows[name]["memory"]
        assert f"{memory['peak_bytes'] / 2**30:.1f} (pp {memory['pp_rank']})" in line
        assert line.split(")")[-1].split("<-")[0].strip() == ("" if memory["fits"] else "NO")
    assert any(line.startswith("memory: each schedule's peak") for line in plan["simulation"]["assumptions"])


def _optimizer_seconds(path, intra_node_gbps: float) -> tuple[tuple[float, ...], object]:
    register()
    run = load_run_config(path)
    planned = estimate(run, CLUSTER)
    options = SimulationOptions(intra_node_gbps=intra_node_gbps)
    costs = rank_costs(run, planned.layout, planned.model.module, planned.shapes, planned.setup, CLUSTER, options)
    return costs.optimizer, planned


def test_muon_exchange_is_charged_to_the_optimizer_step_over_its_link_and_adamw_pays_none():
    """The 10B Muon group is the 8 GPUs of a node: halving the intra-node time per byte takes
    exactly half the exchange off each rank's optimizer step; AdamW's step does not move."""
    slow, planned = _optimizer_seconds(TEN_B, 450.0)
    fast, _ = _optimizer_seconds(TEN_B, 900.0)
    setup = planned.setup
    assert setup.muon_group == 8
    stages = stage_costs(route_parameters(planned.model.module), planned.layout.stage_modules, fsdp=8,
                         ns_steps=setup.ns_steps, ns_dtype=getattr(torch, setup.ns_dtype), state_bytes=4,
                         tokens=4096, seq_len=4096, dim=setup.dim)
    for rank, indices in enumerate(planned.layout.rank_stages):
        exchanged = sum(stages[i].received_bytes for i in indices)
        assert exchanged > 0
        assert slow[rank] - fast[rank] == pytest.approx(exchanged / 450e9 - exchanged / 900e9, rel=1e-9)
    adamw_slow, _ = _optimizer_seconds(CONFIGS / "10b_paci_adamw.toml", 450.0)
    adamw_fast, _ = _optimizer_seconds(CONFIGS / "10b_paci_adamw.toml", 900.0)
    assert adamw_slow == adamw_fast


def test_simulate_with_fewer_microbatches_than_stages_leaves_out_what_train_refuses(capsys):
    """4 microbatches on 8 stages: 1F1B and DualPipeV (torch's refusals, `check_microbatches`)
    are not simulated, each with train's one-line reason; the ratios to 1F1B are "-"; PipeDream2BW
    runs at its delay."""
    code, out, err = cli_in_process(capsys, "plan", "--config", str(CONFIGS / "10b_2bw_muon.toml"), "--nodes", "8",
                                    "--gpus-per-node", "8", "--simulate", "--json", *sets("training.local_batch_size=4"))
    assert code == 0, err
    simulation = json.loads(out)["simulation"]
    assert set(simulation["skipped"]) == {"1F1B", "DualPipeV"}
    assert simulation["skipped"]["1F1B"].startswith("train refuses it: parallelism.pipeline_parallel_schedule = '1F1B' needs at least")
    assert "= 4 < 8 stages" in simulation["skipped"]["1F1B"] and "= 4 < 16 stages" in simulation["skipped"]["DualPipeV"]
    rows = {row["name"]: row for row in simulation["schedules"]}
    assert all(row["vs_1f1b"] is None for row in rows.values())
    assert rows["PipeDream2BW"]["vs_best_synchronous"] > 1 and rows["GPipe"]["bubble"][0] > 0.5
