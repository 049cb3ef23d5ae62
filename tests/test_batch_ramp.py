"""The global batch-size ramp with a mixture's stages: a run stopped and resumed across a batch
change and a stage switch (PP 2, PipeDream2BW and 1F1B) has the uninterrupted losses, takes its
samples in the blending rule's order worked out by hand, and trains the rule of its schedule
(`independent_reference.py`, on the batches the run logged, grouped by the ramp); bad ramps are
refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import independent_reference as ref
from conftest import TINY, checkpoint_weights, cli_in_process, losses, run_cli, sets
from test_bad_input import fail
from test_token_data import DOCUMENTS, packed, shard_documents, write_jsonl
from titan_async.data.batch_ramp import BatchRamp
from titan_async.data.prepare import prepare_tokens
from titan_async.data.section import DataSection
from titan_async.data.sources import tokenizer_dir

STEPS = 5
RAMP = ("training.batch_ramp_steps=[0, 2]", "training.batch_ramp_sizes=[4, 8]")
"""4 sequences (one local batch, 2 microbatches) for steps 1-2, then 8 (two local batches)."""
SIZES = [4, 4, 8, 8, 8]
# Weights 3:1 for steps 1-3 (samples 0-15), 1:3 from step 4 (samples 16-31, a fresh count; A first on ties).
ORDER = ["a0", "a1", "b0", "a2", "a3", "a4", "b1", "a5", "a6", "a7", "b2", "a8", "a9", "a10", "b3", "a11",
         "b4", "a12", "b5", "b6", "b7", "a13", "b8", "b9", "b10", "a14", "b11", "b12", "b13", "a15", "b14", "b15"]


def test_the_ramp_maps_samples_to_steps_from_any_resumed_position():
    ramp = BatchRamp((0, 2, 5), (4, 8, 16))
    by_hand = [step for step, size in enumerate([4, 4, 8, 8, 8, 16, 16]) for _ in range(size)]
    assert [ramp.size_at(k) for k in range(8)] == [4, 4, 8, 8, 8, 16, 16, 16]
    assert [ramp.step_of(s) for s in range(len(by_hand))] == by_hand
    assert [ramp.step_of(s, 3, 16) for s in range(16, len(by_hand))] == by_hand[16:]


@pytest.mark.parametrize("assignments, message", [
    (["training.batch_ramp_steps=[0, 2]", "training.batch_ramp_sizes=[4]"],
     "training.batch_ramp_sizes has 1 entries, training.batch_ramp_steps has 2: give one size per step"),
    (["training.batch_ramp_steps=[0, 3, 3]", "training.batch_ramp_sizes=[4, 8, 12]"],
     "training.batch_ramp_steps = [0, 3, 3]: expected steps strictly increasing from 0, one per size"),
    (["training.batch_ramp_steps=[1]", "training.batch_ramp_sizes=[4]"],
     "training.batch_ramp_steps = [1]: expected steps strictly increasing from 0, one per size"),
    (["training.batch_ramp_steps=[0, 2]", "training.batch_ramp_sizes=[4, 6]"],
     "training.batch_ramp_sizes[1] = 6 must be a multiple of training.local_batch_size x data-parallel degree (4 x 1)"),
    (["training.batch_ramp_steps=[0, 2]", "training.batch_ramp_sizes=[4, 8]", "training.global_batch_size=4"],
     "training.global_batch_size = 4: with a batch ramp the run's batch is the ramp's last, training.batch_ramp_sizes[-1] = 8; "
     "leave global_batch_size unset or equal to it"),
    (["training.batch_ramp_steps=[0, 2]", "training.batch_ramp_sizes=[4, 0]"],
     "--set 'training.batch_ramp_sizes=[4, 0]': training.batch_ramp_sizes: expected a positive integer, got 0"),
    ([*RAMP, "parallelism.pipeline_parallel_schedule=PACI", "parallelism.emulated_stages=2"],
     "training.batch_ramp_steps: a batch-size ramp does not run with PACI yet (its local steps count microbatches across "
     "the run); use PipeDream2BW or a synchronous schedule"),
    ([*RAMP, "parallelism.pipeline_parallel_schedule=PipeDream2BW", "parallelism.emulated_stages=4",
      "parallelism.pipeline_parallel_microbatch_size=4"],
     "training.batch_ramp_sizes = [4, 8] give [1, 2] microbatches per step on 4 stages, so PipeDream2BW's delay "
     "ceil((stages - 1) / microbatches) would change ([3, 2]); a ramp keeps it: give every step at least 3 microbatches"),
])
def test_bad_ramps_are_refused_in_one_line(capsys, tmp_path, assignments, message):
    err = fail(capsys, "train", "--run-dir", str(tmp_path / "run"), *sets(*TINY, "validation.enable=false", *assignments))
    assert err.endswith(f": {message}")
    assert not (tmp_path / "run").exists()


def test_plan_is_of_the_batch_after_the_ramp(capsys):
    code, out, _ = cli_in_process(capsys, "plan", "--json", "--gpus-per-node", "2", "--config", "train_configs/debug_cpu_pp2.toml",
                                  *sets("training.seq_len=64", "training.local_batch_size=4", *RAMP))
    assert code == 0
    assert json.loads(out)["layout"]["tokens_per_step"] == 8 * 64


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Path:
    """Token directories a (code) and b (prose), and each one's windows of 64 tokens by name (a0, b3, ...)."""
    root = tmp_path_factory.mktemp("sources")
    builtin = tokenizer_dir(DataSection())
    names = {}
    for name, texts in (("a", [f"{text}\n# variant {i}\n" for i in range(20) for text in DOCUMENTS]),
                        ("b", [f"Lorem ipsum {i} dolor sit amet, consectetur adipiscing elit.\n" * 3 for i in range(80)])):
        prepare_tokens([str(write_jsonl(root / f"{name}.jsonl", texts))], root / name, builtin, workers=1, progress=False)
        manifest = json.loads((root / name / "manifest.json").read_text())
        documents = [d for shard in manifest["shards"] for d in shard_documents(root / name, shard, manifest["dtype"])]
        names.update({tuple(inputs): f"{name}{w}" for w, (inputs, _, _) in enumerate(packed(documents, 64))})
    (root / "names.json").write_text(json.dumps([[list(k), v] for k, v in names.items()]))
    return root


def ramped_batches(batch_log: Path, settings: ref.Settings) -> list[list[ref.Microbatch]]:
    """The run's batches as the ramp groups them: SIZES[k] logged samples for step k + 1, in
    microbatches of the run's size."""
    log, size, batches, first = ref.read_rank_log(batch_log, 0), settings.microbatch_size, [], 0
    assert log["input"].shape[0] == sum(SIZES)
    for count in SIZES:
        batches.append([ref.Microbatch(*(log[key][i:i + size] for key in ("input", "positions", "labels")))
                        for i in range(first, first + count, size)])
        first += count
    return batches


@pytest.mark.parametrize("schedule", ["PipeDream2BW", "1F1B"])
def test_resume_across_a_batch_change_and_a_stage_switch_has_the_uninterrupted_losses(capsys, tmp_path, sources, schedule):
    """Stopped at step 2, before the batch grows (step 3) and the mixture switches (step 4). A
    resume that changes the number of sources is refused. With max_norm high enough that no
    stage clips, PipeDream2BW trains W[k+1] = W[k] - Opt(grad f_k(W[k-1])) and 1F1B the
    gradient at W[k]; each is also checked against the other rule, which it must not match."""
    launch = ["--config", "train_configs/debug_cpu_pp2.toml", "--nproc-per-node", "2",
              "--set", f"parallelism.pipeline_parallel_schedule={schedule}", "--set", "parallelism.pipeline_parallel_microbatch_size=2"]
    paths = f"data.paths=['{sources / 'a'}', '{sources / 'b'}']"
    common = [*launch, *sets(*TINY, *RAMP, "validation.enable=false", "data.source=tokens", paths, "data.stage_steps=[0, 3]",
                             "data.stage_weights=[[3, 1], [1, 3]]", f"lr_scheduler.total_steps={STEPS}", "checkpoint.interval=2",
                             "training.max_norm=1000")]
    run_cli("train", "--run-dir", str(tmp_path / "full"), *common, *sets(f"training.steps={STEPS}"),
            env={"TITAN_ASYNC_BATCH_LOG": str(tmp_path / "full-batches")})
    split_log = {"TITAN_ASYNC_BATCH_LOG": str(tmp_path / "split-batches")}
    run_cli("train", "--run-dir", str(tmp_path / "split"), *common, *sets("training.steps=2"), env=split_log)
    err = fail(capsys, "resume", "--run-dir", str(tmp_path / "split"), *sets(
        f"data.paths=['{sources / 'a'}', '{sources / 'b'}', '{sources / 'a'}']", "data.stage_weights=[[1, 1, 1], [1, 1, 1]]",
        "data.names=['a', 'b', 'a2']"))
    assert err.startswith("titan-async: data.source, data.paths: the checkpoints hold state for 'the tokens loader with 2 sources', "
                          "resume cannot switch to 'the tokens loader with 3 sources'")
    run_cli("resume", "--run-dir", str(tmp_path / "split"), *launch[2:4], *sets(f"training.steps={STEPS}"), env=split_log)
    full, split = losses(tmp_path / "full"), losses(tmp_path / "split")
    assert sorted(split) == sorted(full) == list(range(1, STEPS + 1))
    assert [split[step] for step in full] == pytest.approx([full[step] for step in full], rel=1e-6)

    names = {tuple(k): v for k, v in json.loads((sources / "names.json").read_text())}
    for log in ("full-batches", "split-batches"):
        rows = [row for line in (tmp_path / log / "rank0.jsonl").read_text().splitlines() for row in json.loads(line)["input"]]
        assert [names[tuple(row)] for row in rows] == ORDER

    weights = checkpoint_weights(tmp_path / "full" / "checkpoint" / f"step-{STEPS}")
    settings = ref.read_settings(tmp_path / "full", vocab_size=weights["tok_embeddings.weight"].shape[0])
    batches = ramped_batches(tmp_path / "full-batches", settings)
    rules = {"PipeDream2BW": "exact", "1F1B": "no_delay"}
    for rule in rules.values():
        result = ref.two_bw(settings, batches, variant=rule)
        found = {"loss": max(abs(result.losses[s] / full[s] - 1) for s in full),
                 "weights": max(float((result.weights[k] - weights[k]).norm() / weights[k].norm()) for k in weights)}
        print(rule, found)
        if rule == rules[schedule]:
            assert max(found.values()) < 1e-5, found
        else:
            assert found["loss"] > 1e-4 and found["weights"] > 1e-3, found
