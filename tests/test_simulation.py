"""The schedule simulator (`pipeline.simulation`) against the analytic bubble and hand-computed
timings, its costs read from a hand-written trace (which the simulation must give back), and
`plan --simulate` on the 10B config and from a run's trace."""

from __future__ import annotations

import json

import pytest
from conftest import REPO, cli_in_process

from titan_async.pipeline.simulation import (
    Collectives,
    Costs,
    Link,
    Task,
    compare,
    compute_actions,
    costs_from_trace,
    exposed,
    one_f_one_b,
    placement,
    run_tasks,
    simulate_streaming,
    simulate_synchronous,
    streaming_streams,
    torch_order,
)

RANKS = range(2, 17)


def _zero_cost(p: int) -> Costs:
    return Costs.uniform(p, forward=1.0, backward=2.0)


@pytest.mark.parametrize("name", ["1F1B", "GPipe"])
def test_flushing_bubble_is_the_analytic_one(name):
    for p in RANKS:
        for m in (p, 4 * p):
            result = simulate_synchronous(name, torch_order(name, p, m), _zero_cost(p))
            expected = (p - 1) / (m + p - 1)
            assert result.bubble == pytest.approx([expected] * p, abs=1e-9), (p, m)
            assert result.step_time == pytest.approx((m + p - 1) * 3.0, abs=1e-9)


def test_streaming_bubble_is_zero():
    for p in RANKS:
        m = 4 * p
        for name, every in (("PipeDream2BW", m), ("PACI", p)):
            result = simulate_streaming(name, p, m, _zero_cost(p), update_every=every)
            assert result.bubble == pytest.approx([0.0] * p, abs=1e-9), (name, p)
            assert result.step_time == pytest.approx(3.0 * m, abs=1e-9)


def test_1f1b_is_torchs_order_but_for_its_misnumbered_last_rank():
    """torch's own IR of 1F1B agrees with `one_f_one_b` on every rank but the last, whose forwards
    it numbers 1..m (so `torch_order` does not use it)."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    torch_1f1b = [compute_actions(rank) for rank in get_schedule_ops("1F1B", 4, 8)]
    ours = one_f_one_b(4, 8)
    assert torch_1f1b[:3] == [ours[r] for r in range(3)]
    assert [a.microbatch_index for a in torch_1f1b[3] if a.computation_type.value == "F"] == list(range(1, 9))


def test_placements_looped_and_v_shaped():
    p = 4
    assert placement(torch_order("Interleaved1F1B", p, 8)) == {s: s % p for s in range(2 * p)}
    v_shape = placement(torch_order("ZBVZeroBubble", p, 8))
    assert v_shape == {**{r: r for r in range(p)}, **{2 * p - 1 - r: r for r in range(p)}}


def test_latency_slows_1f1b_by_its_crossings():
    """p = 2, m = 2, F = 1, B = 2, latency L: stage 1 gets F0 at 1 + L and runs F0 B0 F1 B1 until
    7 + L; stage 0's B1 waits for that gradient until 7 + 2L and ends at 9 + 2L (9 without L)."""
    order = torch_order("1F1B", 2, 2)
    base = simulate_synchronous("1F1B", order, _zero_cost(2)).step_time
    slow = simulate_synchronous("1F1B", order, Costs.uniform(2, 1.0, 2.0, intra_node=Link(latency=0.25))).step_time
    assert base == pytest.approx(9.0)
    assert slow == pytest.approx(9.5)


def test_link_is_chosen_by_node():
    costs = Costs.uniform(2, 1.0, 2.0, message_bytes=100.0, intra_node=Link(1.0, 100.0), inter_node=Link(5.0, 10.0),
                          node_of_rank=(0, 1))
    assert costs.link(0, 1) == pytest.approx(15.0)
    assert costs.link(0, 0) == 0.0
    assert Costs.uniform(2, 1.0, 2.0, message_bytes=100.0, intra_node=Link(1.0, 100.0)).link(0, 1) == pytest.approx(2.0)


def test_streaming_step_of_one_stage_does_not_stall_the_other():
    """p = 2, m = 2, F = 1, B = 2, optimizer 3 s on stage 0, 1 s on stage 1, no communication cost.
    Stage 0 runs F0 F1 B0 | F2 B1 S F3 B2 | ..., stage 1 F0 B0 F1 B1 S | F2 B2 F3 B3 S | ... By hand:
      stage 0: F0 0-1, F1 1-2, B0 4-6 (waits for stage 1's B0, done at 4), F2 6-7, B1 7-9
               (stage 1's B1 ends at 7), step 9-12, F3 12-13, B2 13-15
      stage 1: F0 1-2, B0 2-4, F1 4-5, B1 5-7, step 7-8, F2 8-9 (stage 0's F2 ended at 7),
               B2 9-11 (while stage 0 steps: no barrier), F3 13-14 (stage 0's F3 ends at 13), B3 14-16, step 16-17
    In steady state stage 0 is never idle: a window takes 2 (F + B) + 3 = 9 s, and stage 1 idles
    2 of them (busy 2 (F + B) + 1 = 7)."""
    costs = Costs((1.0, 1.0), (2.0, 2.0), (3.0, 1.0))
    streams, _ = streaming_streams(2, 2, 2, costs, update_every=2)
    times = run_tasks(streams)
    assert times[0][:8] == [(0, 1), (1, 2), (4, 6), (6, 7), (7, 9), (9, 12), (12, 13), (13, 15)]
    assert times[1] == [(1, 2), (2, 4), (4, 5), (5, 7), (7, 8), (8, 9), (9, 11), (13, 14), (14, 16), (16, 17)]
    result = simulate_streaming("PipeDream2BW", 2, 2, costs)
    assert result.step_time == pytest.approx(9.0)
    assert result.bubble == pytest.approx([0.0, 2 / 9])
    barrier = simulate_synchronous("1F1B", torch_order("1F1B", 2, 2), costs)
    assert barrier.step_time == pytest.approx(9.0 + 3.0)  # the flush, then all wait for stage 0's step


@pytest.mark.parametrize("collective, compute, units", [(2.0, 1.0, 4), (1.0, 2.0, 4), (3.0, 3.0, 1), (0.5, 4.0, 8), (6.0, 6.0, 3)])
def test_exposed_collective_is_what_two_streams_of_unit_pieces_leave(collective, compute, units):
    """The closed form against the two streams piece by piece: a gather's piece i must end before
    unit i computes; a reduction's piece i starts after unit i computed. Either way the collective
    delays the end of the compute by `exposed`."""
    piece, work = collective / units, compute / units
    gather = run_tasks([[Task(("c", i), piece) for i in range(units)],
                        [Task(("w", i), work, ((("c", i), 0.0),)) for i in range(units)]])
    reduce = run_tasks([[Task(("w", i), work) for i in range(units)],
                        [Task(("c", i), piece, ((("w", i), 0.0),)) for i in range(units)]])
    for times in (gather, reduce):
        assert max(end for stream in times for _, end in stream) - compute == pytest.approx(exposed(collective, compute, units))


def test_1f1b_pays_the_exposed_gather_and_reduction_once_per_flush():
    """p = 2, m = 2, F = 1, B = 2 (9 s per step without collectives), each rank gathering 2 s and
    reducing 1 s over 4 FSDP units: the gather shows 2 - 3/4 = 1.25 s before each rank's first
    forward (a forward hides 3 of its 4 pieces), the reduction 1/4 s after its last backward
    (its last piece; a backward hides the rest). Both ranks start 1.25 s late, and stage 0's last
    backward, which ends the flush, waits for stage 1's, so the step is 9 + 1.25 + 0.25."""
    costs = Costs.uniform(2, 1.0, 2.0, collectives=(Collectives(gather=2.0, reduce=1.0, units=4),) * 2)
    result = simulate_synchronous("1F1B", torch_order("1F1B", 2, 2), costs)
    assert result.step_time == pytest.approx(10.5)
    assert [e["name"] for e in result.events if e["tid"] == 0 and "C" in e["name"]] == ["0C0", "0C1"] * 3  # 3 steps


def test_streaming_schedules_pay_the_exposed_collectives_once_per_reduction_without_a_bubble():
    """Equal stages, F = 1, B = 2, each stage gathering 2 s and reducing 1 s over 4 units (1.25 s
    and 0.25 s exposed, as above): 2BW reduces once a step and PACI every p backwards, and every
    stage pays the same, so the streams stay full and a step is 3 m + (reductions per step) x 1.5."""
    for p in (2, 4, 8):
        m = 4 * p
        costs = Costs.uniform(p, 1.0, 2.0, collectives=(Collectives(gather=2.0, reduce=1.0, units=4),) * p)
        for name, every in (("PipeDream2BW", m), ("PACI", p)):
            result = simulate_streaming(name, p, m, costs, update_every=every)
            assert result.step_time == pytest.approx(3.0 * m + m / every * 1.5), (name, p)
            assert result.bubble == pytest.approx([0.0] * p, abs=1e-9), (name, p)


def _hand_traced_1f1b() -> list[dict]:
    """Three steps of 1F1B at p = 2, m = 2, every 10 s, written out by hand: forwards 1 s,
    backwards 2 s, messages arrive 0.1 s after their producer ends; optimizer steps 0.2 s, rank 0's
    0.1 s and rank 1's 0.05 s after the slower flush ends (9.2 s); rank 0 starts the next step 0.5 s
    after its optimizer step (host work: 0.6 s per step), rank 1 0.05 s per step."""
    rank0 = [("0F0", 0, 1), ("0F1", 1, 2), ("0B0", 4.2, 6.2), ("0B1", 7.2, 9.2), ("0O", 9.3, 9.5)]
    rank1 = [("1F0", 1.1, 2.1), ("1B0", 2.1, 4.1), ("1F1", 4.1, 5.1), ("1B1", 5.1, 7.1), ("1O", 9.25, 9.45)]
    events = []
    for step in range(3):
        for rank, actions in enumerate((rank0, rank1)):
            for name, start, end in actions:
                name = f"{name}{step + 1}" if name.endswith("O") else name
                events.append({"name": name, "tid": rank, "ts": (start + 10 * step) * 1e6, "dur": (end - start) * 1e6})
    return events


def test_costs_from_a_hand_written_trace_and_its_step_time_simulated_back():
    costs = costs_from_trace(_hand_traced_1f1b(), microbatches=2, synchronous=True)
    assert costs.forward == pytest.approx((1.0, 1.0)) and costs.backward == pytest.approx((2.0, 2.0))
    assert costs.optimizer == pytest.approx((0.2, 0.2))
    assert [c for stage in costs.stage_costs for c in stage] == pytest.approx([1.0, 2.0, 0.0, 1.0, 2.0, 0.0])
    assert costs.intra_node.latency == pytest.approx(0.1)
    assert costs.host == pytest.approx((0.6, 0.05))
    result = simulate_synchronous("1F1B", one_f_one_b(2, 2), costs)
    assert result.step_time == pytest.approx(10.0)


def test_compare_ratios():
    rows, skipped = compare(4, 8, _zero_cost(4))
    by_name = {row.result.name: row for row in rows}
    assert not skipped
    assert by_name["1F1B"].vs_1f1b == 1.0
    assert by_name["PipeDream2BW"].vs_1f1b == pytest.approx(11 / 8)  # (m + p - 1) / m
    best = max(row.vs_1f1b for row in rows if row.result.name not in ("PipeDream2BW", "PACI"))
    assert by_name["PACI"].vs_best_synchronous == pytest.approx(by_name["PACI"].vs_1f1b / best)


def test_plan_simulate_10b(capsys):
    """The table lists every schedule; the streaming ones beat 1F1B; 1F1B's bubble on its busiest rank
    is near (p - 1) / (m + p - 1). Not within a few percent of it: the 10B split is not equal (ranks
    of 5 and 6 blocks, the output head on the last), and the busiest rank of unequal stages idles
    less than with equal ones, since the faster ranks fill and drain the pipe sooner (15.1% against
    17.9%); the equal-stage formula itself is checked to 1e-9 above."""
    args = ["plan", "--config", "train_configs/10b_2bw_muon.toml", "--nodes", "8", "--gpus-per-node", "8", "--simulate"]
    status, out, err = cli_in_process(capsys, *args)
    assert status == 0, err
    table = out[out.index("Simulated schedules"):].splitlines()
    rows = {line.split()[0]: line.split() for line in table[2:] if line and not line.startswith(("assumed", "not simulated"))}
    assert set(rows) == {"1F1B", "GPipe", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
                         "DualPipeV", "PipeDream2BW", "PACI"}
    for name in ("PipeDream2BW", "PACI"):
        assert float(rows[name][3].rstrip("x")) > 1.0
    assert any(line.startswith("assumed: compute at MFU 0.4 of 989 TFLOP/s") for line in table)

    status, out, _ = cli_in_process(capsys, *args, "--json")
    simulation = json.loads(out)["simulation"]
    assert {row["name"] for row in simulation["schedules"]} == set(rows)
    p, m = 8, 32  # pipeline_parallel_degree; local_batch_size 32 / pipeline_parallel_microbatch_size 1
    equal_stages = (p - 1) / (m + p - 1)
    bubble = float(rows["1F1B"][1].rstrip("%")) / 100
    assert equal_stages - 0.04 < bubble < equal_stages
    one_f_one_b = next(row for row in simulation["schedules"] if row["name"] == "1F1B")
    assert min(one_f_one_b["bubble"]) == pytest.approx(bubble, abs=0.0005)
    assert len(one_f_one_b["bubble"]) == p


@pytest.mark.parametrize("flag,value", [("--mfu", "0"), ("--mfu", "1.5"), ("--peak-tflops", "-1"), ("--inter-node-gbps", "0")])
def test_plan_simulate_bad_flags(capsys, flag, value):
    status, _, err = cli_in_process(capsys, "plan", "--config", "train_configs/10b_2bw_muon.toml", "--nodes", "8",
                                    "--gpus-per-node", "8", "--simulate", flag, value)
    assert status == 2
    assert flag in err and len(err.strip().splitlines()) == 1


def _traced_run(directory, events: list[dict]):
    """A run directory as `train` leaves it with metrics.pipeline_trace: PP 2, 1F1B, m = 2."""
    config = (REPO / "train_configs" / "debug_cpu_pp2.toml").read_text()
    (directory / "pipeline").mkdir(parents=True)
    (directory / "config.toml").write_text(config.replace("pipeline_parallel_microbatch_size = 2", "pipeline_parallel_microbatch_size = 4"))
    (directory / "launch.json").write_text(json.dumps({"world_size": 2}))
    (directory / "pipeline" / "trace.json").write_text(json.dumps({"traceEvents": events}))
    return directory


def test_plan_simulates_with_a_runs_traced_costs_and_draws_the_gantt(capsys, tmp_path):
    run = _traced_run(tmp_path / "run", _hand_traced_1f1b())
    gantt = tmp_path / "gantt.png"
    status, out, err = cli_in_process(capsys, "plan", "--config", str(run / "config.toml"), "--nodes", "1", "--gpus-per-node", "2",
                                      "--simulate", "--costs-from", str(run), "--gantt", str(gantt), "--json")
    assert status == 0, err
    simulation = json.loads(out)["simulation"]
    one_f_one_b = next(row for row in simulation["schedules"] if row["name"] == "1F1B")
    assert one_f_one_b["step_seconds"] == pytest.approx(10.0)  # the hand-written trace's own step time
    assert simulation["costs"]["host"] == pytest.approx([0.6, 0.05])
    assert any(f"costs measured by {run}/pipeline/trace.json" in line for line in simulation["assumptions"])
    assert gantt.stat().st_size > 0


@pytest.mark.parametrize("case", ["no trace", "other degree", "gantt without simulate"])
def test_plan_costs_from_bad_input_is_one_line(capsys, tmp_path, case):
    run = _traced_run(tmp_path / "run", _hand_traced_1f1b())
    args = ["plan", "--config", str(run / "config.toml"), "--nodes", "1", "--gpus-per-node", "2", "--simulate", "--costs-from", str(run)]
    expected = "--costs-from"
    if case == "no trace":
        (run / "pipeline" / "trace.json").unlink()
    elif case == "other degree":
        args[2:7] = ["train_configs/10b_2bw_muon.toml", "--nodes", "8", "--gpus-per-node", "8"]
        expected = "pipeline_parallel_degree = 2, the plan 8"
    else:
        args = args[:7] + ["--gantt", str(tmp_path / "g.png")]
        expected = "--gantt: applies only with --simulate"
    status, _, err = cli_in_process(capsys, *args)
    assert status == 2 and expected in err and len(err.strip().splitlines()) == 1, err
