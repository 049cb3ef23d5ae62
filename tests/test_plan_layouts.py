"""Every layout the config check accepts builds: `titan-async plan`'s dry run (one process, fake
ranks on the meta device) over PP x FSDP x replicas x TP x EP under both streaming schedules,
dense (llama3) and MoE (qwen3_moe), with the smallest model. The dry run builds each inspected
rank as the trainer does, FSDP traffic hooks, weight policies, load balancing and optimizers
included, so a layout that would crash the trainer at build crashes here; a layout `train`
refuses is refused in one line naming its key, before any launch."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from conftest import CONFIGS, TINY, cli_in_process, sets
from titan_async.config.run_config import load_run_config
from titan_async.core.errors import UserError

pytestmark = pytest.mark.filterwarnings("ignore:DTensor random operators", "ignore:In CPU autocast")
CONFIG = CONFIGS / "debug_cpu.toml"
MOE_BLOCKS = {2: [2, 2], 4: [1, 2, 1, 0]}
"""MoE blocks of each stage: TINY has 4 blocks, all MoE blocks under qwen3_moe, and torchtitan's
split weighs the embedding and the norm + output as one block each: 6 over 2 stages are 3 + 3,
over 4 stages 2 + 2 + 1 + 1."""
MOE = ("model.family=qwen3_moe", "model.num_experts=8", "model.top_k=2", "model.moe_hidden_dim=64",
       "model.load_balance_coeff=0.01", "parallelism.pipeline_parallel_microbatch_size=2", "training.local_batch_size=8")
MUON = ("optimizer.name=muon",)
MUON_EF = ("optimizer.name=muon", "optimizer.error_feedback.enabled=true")
PREDICT = ("training.weight_prediction=1",)


@dataclass(frozen=True)
class Case:
    """One layout: degrees, schedule, model family, extra settings, and the key its refusal names
    (None: it builds)."""

    pp: int
    fsdp: int
    replicas: int
    tp: int
    ep: int
    schedule: str
    moe: bool = False
    extra: tuple[str, ...] = ()
    refused_by: str | None = None

    @property
    def world(self) -> int:
        """Processes: EP borrows its ranks from the FSDP ones."""
        return self.pp * self.fsdp * self.replicas * self.tp

    def assignments(self) -> list[str]:
        p = "parallelism."
        return [*TINY, *(MOE if self.moe else ()), f"{p}pipeline_parallel_degree={self.pp}",
                f"{p}pipeline_parallel_schedule={self.schedule}", f"{p}data_parallel_shard_degree={self.fsdp}",
                f"{p}data_parallel_replicate_degree={self.replicas}", f"{p}tensor_parallel_degree={self.tp}",
                f"{p}expert_parallel_degree={self.ep}", *self.extra]

    def name(self) -> str:
        degrees = "-".join(f"{name}{n}" for name, n in
                           (("pp", self.pp), ("fsdp", self.fsdp), ("rep", self.replicas), ("tp", self.tp), ("ep", self.ep)) if n > 1)
        optimizer = ("-muon" if "optimizer.name=muon" in self.extra else "") + ("-ef" if MUON_EF[1] in self.extra else "")
        predict = "-predict" if PREDICT[0] in self.extra else ""
        return f"{'moe' if self.moe else 'dense'}-{degrees}-{self.schedule}{optimizer}{predict}"


EP = "parallelism.expert_parallel_degree"
TP = "parallelism.tensor_parallel_degree"
CASES = [
    Case(2, 2, 1, 1, 1, "PipeDream2BW", extra=MUON),
    Case(2, 2, 1, 2, 1, "PACI", extra=MUON),  # FSDP x TP: Muon exchanges over both
    Case(2, 2, 1, 2, 1, "PipeDream2BW", extra=MUON_EF),
    Case(2, 2, 2, 1, 1, "PACI"),  # HSDP
    Case(2, 1, 2, 1, 1, "PipeDream2BW"),  # replicas alone
    Case(2, 1, 1, 2, 1, "PipeDream2BW"),
    Case(4, 1, 1, 1, 1, "PACI"),
    Case(2, 2, 1, 1, 2, "PACI", refused_by=EP),  # EP of a dense model
    Case(2, 2, 1, 1, 2, "PACI", moe=True, extra=MUON_EF),
    Case(2, 2, 2, 1, 2, "PipeDream2BW", moe=True),  # replicas x EP: both groups' all-reduce hooks
    Case(2, 4, 1, 1, 2, "PACI", moe=True),  # experts FSDP-sharded over 2 ranks
    Case(2, 4, 1, 1, 4, "PipeDream2BW", moe=True, extra=MUON),
    Case(4, 2, 1, 1, 2, "PACI", moe=True),
    Case(2, 1, 2, 1, 1, "PACI", moe=True),
    Case(2, 1, 1, 1, 1, "PipeDream2BW", moe=True),  # plain parameters, expert biases versioned
    Case(2, 1, 2, 1, 2, "PACI", moe=True, refused_by=EP),  # EP wider than a stage's data ranks
    Case(2, 2, 1, 2, 2, "PipeDream2BW", moe=True, refused_by=TP),  # TP x EP
    Case(2, 2, 1, 1, 1, "PipeDream2BW", moe=True, extra=PREDICT),  # predicted shards, expert biases predicted
    Case(2, 2, 2, 1, 1, "PACI", extra=PREDICT),
    Case(2, 1, 1, 2, 1, "PipeDream2BW", extra=PREDICT),  # TP shards predicted
]


def plan(capsys, case: Case) -> tuple[int, str, str]:
    return cli_in_process(capsys, "plan", "--config", str(CONFIG), "--gpus-per-node", str(case.world), "--json",
                          *sets(*case.assignments()))


def expected_policy(case: Case, pp_rank: int) -> str:
    """The weight policy of a stage: PACI accumulates locally (predicting the forwards' weights on
    every stage but the last with weight prediction); 2BW keeps side shards where FSDP wraps the
    stage (any data or tensor parallelism) and whole versions otherwise, predicted ones with
    weight prediction."""
    predict = PREDICT[0] in case.extra
    if case.schedule == "PACI":
        return "PredictedAccumulation" if predict and pp_rank < case.pp - 1 else "LocalAccumulation"
    kind = "PredictedVersions" if predict else "TwoVersions"
    return f"Sharded{kind}" if case.fsdp * case.replicas * case.tp > 1 else kind


def assert_one_line_naming(message: str, key: str) -> None:
    assert key in message and len(message.strip().splitlines()) == 1, message


def assert_refused(capsys, case: Case) -> None:
    """`train`'s config check refuses the layout before launch, and plan says so in one line (its
    own refusal, status 2, or train's as its one warning) and builds nothing."""
    with pytest.raises(UserError) as refusal:
        load_run_config(CONFIG, case.assignments()).check(case.world)
    assert_one_line_naming(str(refusal.value), case.refused_by)
    status, out, err = plan(capsys, case)
    if status == 2:
        assert_one_line_naming(err, case.refused_by)
        return
    assert status == 0, err
    result = json.loads(out)
    (warning,) = result["warnings"]
    assert warning.startswith("titan-async train would stop with: ")
    assert_one_line_naming(warning, case.refused_by)
    assert result["dry_run"]["ranks"] == []


def assert_builds(capsys, case: Case) -> None:
    """The config check accepts the layout, and the dry run builds the first rank of every
    pipeline rank and the last rank, each with its stage's weight policy and MoE blocks."""
    load_run_config(CONFIG, case.assignments()).check(case.world)
    status, out, err = plan(capsys, case)
    assert status == 0, err
    result = json.loads(out)
    assert result["warnings"] == []
    ranks = result["dry_run"]["ranks"]
    per_stage = case.world // case.pp  # pp is the outermost mesh dimension
    assert [r["rank"] for r in ranks] == sorted({s * per_stage for s in range(case.pp)} | {case.world - 1})
    for rank in ranks:
        assert rank["pp_rank"] == rank["rank"] // per_stage
        assert rank["weight_policies"] == [expected_policy(case, rank["pp_rank"])], rank["rank"]
        assert rank["balanced_moe_blocks"] == (MOE_BLOCKS[case.pp][rank["pp_rank"]] if case.moe else 0), rank["rank"]
        assert rank["fsdp_wrapped"] == (case.fsdp * case.replicas * case.tp > 1), rank["rank"]


@pytest.mark.parametrize("case", CASES, ids=[case.name() for case in CASES])
def test_a_layout_the_config_check_accepts_builds_and_any_other_is_refused_in_one_line(case, capsys):
    if case.refused_by:
        assert_refused(capsys, case)
    else:
        assert_builds(capsys, case)
