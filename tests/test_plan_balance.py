"""`plan --simulate --balance`: the split is checked against an exhaustive search written here,
and its simulated gain against `plan --simulate` of the same split written into the config."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from conftest import CONFIGS, cli_in_process
from titan_async.cluster.balance import contiguous_partition

CONFIG = str(CONFIGS / "10b_2bw_muon.toml")
CLUSTER = ("--nodes", "8", "--gpus-per-node", "8")
EVEN_LAYERS = ("--set", "parallelism.pipeline_parallel_first_stage_less_layers=0",
               "--set", "parallelism.pipeline_parallel_last_stage_less_layers=0")


def largest_part(costs: list[float], starts: list[int]) -> float:
    bounds = [0, *starts, len(costs)]
    return max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))


def test_contiguous_partition_is_as_good_as_every_cut():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 9)
        costs = [rng.choice([0.0, 0.5, 1.0, 2.0, rng.random() * 5]) for _ in range(n)]
        parts = rng.randint(1, n)
        starts = contiguous_partition(costs, parts)
        assert len(starts) == parts - 1 and starts == sorted(set(starts)) and all(0 < s < n for s in starts)
        best = min(largest_part(costs, list(cut)) for cut in itertools.combinations(range(1, n), parts - 1))
        assert largest_part(costs, starts) == pytest.approx(best)
    with pytest.raises(ValueError, match="cannot cut 2 modules into 3 stages"):
        contiguous_partition([1.0, 1.0], 3)


def simulated(capsys, *args: str) -> dict:
    code, out, _ = cli_in_process(capsys, "plan", "--config", CONFIG, *CLUSTER, "--simulate", "--json", *args)
    assert code == 0
    return json.loads(out)


def test_balance_evens_out_a_split_that_gives_the_head_a_stage_of_blocks(capsys):
    """torchtitan's even split puts 5 blocks and the 128k-vocabulary head on the last rank: the
    balanced split takes blocks off it, and `plan --simulate` of that split, written into the
    config, gives the tokens/s the balance table promised. The shipped config, already uneven by
    hand (first/last stage less layers), is kept."""
    plan = simulated(capsys, *EVEN_LAYERS, "--balance")
    balance = plan["balance"]
    split = balance["module_fqns_per_model_part"]
    assert balance["balanced"] and len(split) == 8 and split[-1][-2:] == ["norm", "lm_head"]
    assert len(split[-1]) - 2 < 5 and max(balance["shares"]) < max(balance["configured_shares"])
    gains = {row["name"]: row for row in balance["schedules"]}
    assert gains["PipeDream2BW"]["gain"] > 1.1
    rerun = simulated(capsys, *EVEN_LAYERS, "--set", f"parallelism.module_fqns_per_model_part={json.dumps(split)}")
    for row in rerun["simulation"]["schedules"]:
        assert row["tokens_per_second"] == pytest.approx(gains[row["name"]]["balanced"], rel=1e-9), row["name"]

    # The split has one stage per rank: a V-shaped schedule, two per rank, is refused in one line
    # (each schedule's memory in the balanced plan above is then left out with that line).
    code, _, err = cli_in_process(capsys, "plan", "--config", CONFIG, *CLUSTER, *EVEN_LAYERS,
                                  "--set", "parallelism.pipeline_parallel_schedule=ZBVZeroBubble", "--set", "validation.enable=false",
                                  "--set", f"parallelism.module_fqns_per_model_part={json.dumps(split)}")
    assert code == 2 and "module_fqns_per_model_part has 8 stages; ZBVZeroBubble on 8 pipeline ranks needs 16" in err
    assert len(err.strip().splitlines()) == 1

    shipped = simulated(capsys, "--balance")["balance"]
    assert not shipped["balanced"] and all(row["gain"] == 1.0 for row in shipped["schedules"])


def test_balance_needs_simulate(capsys):
    code, _, err = cli_in_process(capsys, "plan", "--config", CONFIG, *CLUSTER, "--balance")
    assert code == 2 and err.strip().endswith("--balance: applies only with --simulate")


def test_balance_keeps_the_configured_split_where_it_simulates_faster():
    from titan_async.commands.plan.render import balance_advice

    split = [["tok_embeddings", "layers.0"], ["layers.1", "norm", "lm_head"]]
    schedules = [{"name": "1F1B", "configured": 100.0, "balanced": 110.0, "gain": 1.1, "selected": False},
                 {"name": "PipeDream2BW", "configured": 100.0, "balanced": 96.9, "gain": 0.969, "selected": True}]
    advice = balance_advice({"module_fqns_per_model_part": split, "schedules": schedules})
    assert advice.startswith("keep the configured split for PipeDream2BW (this config's schedule)") and "0.969x" in advice
    assert advice.endswith('module_fqns_per_model_part = [["tok_embeddings", "layers.0"], ["layers.1", "norm", "lm_head"]]')
    schedules[1]["gain"] = 1.02
    assert balance_advice({"module_fqns_per_model_part": split, "schedules": schedules}).startswith("module_fqns_per_model_part = ")
