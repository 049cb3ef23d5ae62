"""Token data: `titan-async prepare`'s shards, Megatron-LM indexed data sets, the packing loader's
windows and exact resume, the one-line refusals before launch, and a tokens run against a files run."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from conftest import TINY, cli_in_process, losses, metrics, run_cli, sets
from test_bad_input import fail
from titan_async.data.prepare import prepare_tokens
from titan_async.data.section import DataSection
from titan_async.core.errors import UserError
from titan_async.data.sources import prepare, tokenizer_dir
from titan_async.data.token_files import open_tokens, sha256
from titan_async.data.batch_ramp import BatchRamp
from titan_async.data.mixture import MixtureSchedule, MixtureState, next_sample
from titan_async.data.packed_windows import PackedWindows
from titan_async.data.token_loader import TokenDataLoader, TokenDataset

DOCUMENTS = ["def add(a, b):\n    return a + b\n", "hello world", "", "import os\nprint(os.getcwd())\n" * 3,
             "class A:\n    pass\n", "x = [i * i for i in range(10)]\n"]


@pytest.fixture(scope="module")
def builtin_tokenizer() -> Path:
    return tokenizer_dir(DataSection())


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def shard_documents(out: Path, shard: dict, dtype: str) -> list[list[int]]:
    tokens = np.fromfile(out / shard["tokens"], dtype=dtype)
    offsets = np.fromfile(out / shard["docs"], dtype=np.int64)
    return [tokens[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])]


def test_prepare_writes_the_tokenizers_own_encoding(tmp_path, builtin_tokenizer):
    source = write_jsonl(tmp_path / "docs.jsonl", DOCUMENTS)
    result = run_cli("prepare", str(source), "--out", str(tmp_path / "out"), "--workers", "1")
    assert "tokens/s per core" in result.stdout
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    tokenizer = Tokenizer.from_file(str(builtin_tokenizer / "tokenizer.json"))
    bos, eos = tokenizer.token_to_id("<|begin_of_text|>"), tokenizer.token_to_id("<|end_of_text|>")
    expected = [[bos, *tokenizer.encode(text).ids, eos] for text in DOCUMENTS]
    (shard,) = manifest["shards"]
    assert shard_documents(tmp_path / "out", shard, manifest["dtype"]) == expected
    assert manifest["dtype"] == "uint16" and manifest["vocab_size"] == tokenizer.get_vocab_size()
    assert manifest["tokenizer_sha256"] == sha256(builtin_tokenizer / "tokenizer.json")
    assert shard["document_count"] == len(DOCUMENTS) and shard["token_count"] == sum(map(len, expected))
    assert shard["max_token_id"] == max(max(d) for d in expected)
    assert shard["sha256"] == sha256(tmp_path / "out" / shard["tokens"])


def test_prepare_resumes_after_an_interruption(tmp_path, builtin_tokenizer):
    inputs = [str(write_jsonl(tmp_path / f"part{i}.jsonl", DOCUMENTS[i:] * 2)) for i in range(3)]
    out = tmp_path / "out"
    first = prepare_tokens(inputs, out, builtin_tokenizer, workers=2, progress=False)
    kept = {name: (out / name).stat().st_mtime_ns for name in ("shard-00000.tokens", "shard-00002.tokens")}
    # An interruption while shard 1 was written: its receipt and the manifest not yet there, a partial temp file.
    (out / "manifest.json").unlink()
    (out / "shard-00001.json").unlink()
    (out / "shard-00001.tokens").unlink()
    (out / "shard-00001.tokens.tmp").write_bytes(b"\x01\x02\x03")
    second = prepare_tokens(inputs, out, builtin_tokenizer, workers=2, progress=False, verify=True)
    assert second.shards_kept == 2 and second.tokens_written == first.manifest["shards"][1]["token_count"]
    assert second.manifest == first.manifest
    assert {name: (out / name).stat().st_mtime_ns for name in kept} == kept
    assert sha256(out / "shard-00001.tokens") == first.manifest["shards"][1]["sha256"]


def write_megatron(prefix: Path, documents: list[list[int]], dtype=np.uint16, code: int = 8,
                   magic: bytes = b"MMIDIDX\x00\x00") -> Path:
    """PREFIX.bin and PREFIX.idx in Megatron-LM's MMIDIDX layout, one sequence per document."""
    lengths = np.array([len(d) for d in documents], dtype=np.int32)
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64)]).astype(np.int64) * np.dtype(dtype).itemsize
    document_indices = np.arange(len(documents) + 1, dtype=np.int64)
    Path(f"{prefix}.bin").write_bytes(np.concatenate([np.array(d, dtype=dtype) for d in documents]).tobytes())
    with open(f"{prefix}.idx", "wb") as f:
        f.write(magic + struct.pack("<Q", 1) + struct.pack("<B", code))
        f.write(struct.pack("<Q", len(documents)) + struct.pack("<Q", len(document_indices)))
        f.write(lengths.tobytes() + pointers.tobytes() + document_indices.tobytes())
    return prefix


MEGATRON_DOCUMENTS = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11, 12, 13, 14]]


def windows(dataset) -> list[tuple[list[int], list[int], list[int]]]:
    return [(x["input"].tolist(), y.tolist(), x["positions"].tolist()) for x, y in dataset]


def dataset(*prefixes: str, seq_len: int, stage_steps=(0,), stage_weights=((1.0,),), **kwargs) -> TokenDataset:
    sources = [PackedWindows(open_tokens(prefix, "data.path"), seq_len) for prefix in prefixes]
    return TokenDataset(sources, MixtureSchedule(tuple(stage_steps), tuple(stage_weights)), **kwargs)


def test_megatron_pair_packs_into_the_expected_windows(tmp_path):
    prefix = str(write_megatron(tmp_path / "corpus_text_document", MEGATRON_DOCUMENTS))
    # Each document shifted within itself, concatenated, cut into windows of 4; the rest is dropped.
    assert windows(dataset(prefix, seq_len=4)) == [
        ([1, 2, 3, 4], [2, 3, 4, 5], [0, 1, 2, 3]),
        ([6, 8, 9, 10], [7, 9, 10, 11], [0, 0, 1, 2]),
    ]


# The windows of 2 tokens of MEGATRON_DOCUMENTS, numbered in corpus order (13 -> 14 is dropped).
WINDOWS_OF_2 = [([1, 2], [2, 3], [0, 1]), ([3, 4], [4, 5], [0, 1]), ([6, 8], [7, 9], [0, 0]),
                ([9, 10], [10, 11], [0, 1]), ([11, 12], [12, 13], [0, 1])]


def test_data_ranks_take_turns_in_one_global_order(tmp_path):
    prefix = str(write_megatron(tmp_path / "corpus", MEGATRON_DOCUMENTS))
    # Rounds of 2 ranks x 1 sample: rank 0 gets windows 0, 2; rank 1 gets 1, 3; the round of
    # window 4 would need a sixth window, so the data ends there on both ranks.
    ranks = [windows(dataset(prefix, seq_len=2, dp_rank=r, dp_world_size=2)) for r in range(2)]
    assert ranks == [[WINDOWS_OF_2[0], WINDOWS_OF_2[2]], [WINDOWS_OF_2[1], WINDOWS_OF_2[3]]]
    # Looping: window 4, then the second epoch from window 0.
    looping = iter(dataset(prefix, seq_len=2, dp_rank=1, dp_world_size=2, infinite=True))
    assert windows(next(looping) for _ in range(3)) == [WINDOWS_OF_2[1], WINDOWS_OF_2[3], WINDOWS_OF_2[0]]


def packed(documents: list[list[int]], seq_len: int) -> list[tuple[list[int], list[int], list[int]]]:
    """Independent reference: the documents shifted, concatenated, cut into windows (rest dropped)."""
    stream = [(t, u, p) for d in documents for p, (t, u) in enumerate(zip(d, d[1:]))]
    cuts = [stream[i : i + seq_len] for i in range(0, len(stream) - seq_len + 1, seq_len)]
    result = []
    for cut in cuts:
        positions, last = [], None
        for t, u, p in cut:  # positions restart at each document and at each window
            positions.append(0 if last is None else (positions[-1] + 1 if p == last + 1 else 0))
            last = p
        result.append(([t for t, _, _ in cut], [u for _, u, _ in cut], positions))
    return result


def test_state_of_two_data_ranks_continues_on_one_and_on_three(tmp_path):
    documents = MEGATRON_DOCUMENTS * 4
    prefix = str(write_megatron(tmp_path / "corpus", documents))
    order = packed(documents, 2) * 2  # the global order, two epochs
    assert order[:5] == WINDOWS_OF_2
    two = [dataset(prefix, seq_len=2, dp_rank=r, dp_world_size=2, local_batch_size=2, infinite=True) for r in range(2)]
    running = [iter(d) for d in two]
    seen = [windows(next(rank) for _ in range(2)) for _ in range(3) for rank in running]  # 3 batches of 2 per rank
    assert [w for batch in seen for w in batch] == order[:12]
    state = two[1].state_dict()
    assert state == two[0].state_dict()
    for width in (1, 3):
        resumed = []
        for r in range(width):
            data = dataset(prefix, seq_len=2, dp_rank=r, dp_world_size=width, local_batch_size=2, infinite=True)
            data.load_state_dict(state)
            resumed.append(iter(data))
        rounds = [windows(next(rank) for _ in range(2)) for _ in range(4) for rank in resumed]
        assert [w for batch in rounds for w in batch] == order[12 : 12 + 8 * width]


def test_loader_resumes_mid_stream_with_the_exact_next_batch(tmp_path):
    prefix = str(write_megatron(tmp_path / "corpus", [list(range(i * 10, i * 10 + 3 + i)) for i in range(1, 8)]))
    config = TokenDataLoader.Config(sources=[prefix], source_keys=["data.path"])

    def loader():
        return config.build(dp_world_size=1, dp_rank=0, tokenizer=None, seq_len=5, local_batch_size=2)

    running = iter(first := loader())
    for _ in range(3):
        next(running)
    state = first.state_dict()
    expected = [next(running) for _ in range(6)]  # into the second epoch
    resumed = loader()
    resumed.load_state_dict(state)
    again = iter(resumed)
    for (x, y), (u, v) in zip(expected, (next(again) for _ in range(6))):
        assert torch.equal(x["input"], u["input"]) and torch.equal(y, v) and torch.equal(x["positions"], u["positions"])


@pytest.fixture
def prepared(tmp_path, builtin_tokenizer) -> Path:
    out = tmp_path / "tokens"
    prepare_tokens([str(write_jsonl(tmp_path / "docs.jsonl", DOCUMENTS))], out, builtin_tokenizer, workers=1, progress=False)
    return out


def refusal(capsys, tmp_path, *assignments: str) -> str:
    err = fail(capsys, "train", "--run-dir", str(tmp_path / "run"),
               *sets(*TINY, "data.source=tokens", "validation.enable=false", *assignments))
    assert not (tmp_path / "run").exists()
    return err


def test_truncated_shard_is_refused(capsys, tmp_path, prepared):
    tokens = prepared / "shard-00000.tokens"
    size = tokens.stat().st_size
    tokens.write_bytes(tokens.read_bytes()[:-2])
    err = refusal(capsys, tmp_path, f"data.path={prepared}")
    assert err == (f"titan-async: data.path = '{prepared}': shard file shard-00000.tokens has {size - 2} bytes, "
                   f"the manifest says {size}; rerun titan-async prepare")


def test_shards_of_another_tokenizer_are_refused(capsys, tmp_path, prepared, builtin_tokenizer):
    other = tmp_path / "other_tokenizer"
    shutil.copytree(builtin_tokenizer, other)
    (other / "tokenizer.json").write_text((builtin_tokenizer / "tokenizer.json").read_text() + "\n")  # same ids, other file
    err = refusal(capsys, tmp_path, f"data.path={prepared}", f"data.tokenizer={other}")
    assert err == (f"titan-async: data.path = '{prepared}': was tokenized by another tokenizer.json than data.tokenizer's "
                   f"('{other}'); prepare it with that tokenizer, or set data.tokenizer to the one it used")


def test_token_id_beyond_the_vocabulary_is_refused(capsys, tmp_path, prepared):
    largest = json.loads((prepared / "manifest.json").read_text())["shards"][0]["max_token_id"]
    err = refusal(capsys, tmp_path, f"data.path={prepared}", f"model.vocab_size={largest}")
    assert err.startswith(f"titan-async: data.path = '{prepared}': holds token id {largest}, beyond the model's vocabulary of {largest}")


def test_a_source_without_one_window_is_refused_before_launch(capsys, tmp_path):
    prefix = write_megatron(tmp_path / "small", MEGATRON_DOCUMENTS)  # 14 tokens in 3 documents: 11 shifted
    err = refusal(capsys, tmp_path, f"data.path={prefix}")
    assert err == (f"titan-async: data.path = '{prefix}': holds 14 tokens in 3 documents, not one window of training.seq_len = 64 "
                   "tokens (each document gives its length - 1); give more data or a shorter seq_len")
    # An empty document gives no token, not -1: 8 tokens in 3 documents shift to 4 + 0 + 2 = 6, one window of 6.
    data = prepare(DataSection(source="tokens", path=str(write_megatron(tmp_path / "empty", [[1, 2, 3, 4, 5], [], [6, 7, 8]]))), False)
    data.check_tokens(vocab_size=16, seq_len=6)
    with pytest.raises(UserError, match="holds 8 tokens in 3 documents, not one window of training.seq_len = 7 tokens"):
        data.check_tokens(vocab_size=16, seq_len=7)


def test_megatron_bad_magic_and_short_bin_are_refused(capsys, tmp_path):
    prefix = write_megatron(tmp_path / "bad", MEGATRON_DOCUMENTS, magic=b"NOTIDX\x00\x00\x00")
    err = refusal(capsys, tmp_path, f"data.path={prefix}")
    assert err == f"titan-async: data.path = '{prefix}': bad.idx does not start with Megatron-LM's MMIDIDX magic"
    prefix = write_megatron(tmp_path / "short", MEGATRON_DOCUMENTS)
    Path(f"{prefix}.bin").write_bytes(Path(f"{prefix}.bin").read_bytes()[:-4])
    err = refusal(capsys, tmp_path, f"data.path={prefix}")
    assert err == f"titan-async: data.path = '{prefix}': short.bin has 24 bytes, its index points up to byte 28"


def test_tokens_run_matches_a_files_run_of_the_same_text(tmp_path, builtin_tokenizer):
    """The same token stream, so the same training and validation losses: torchtitan's loader reads
    a files run's text unshuffled in its first epoch, as the tokens loader reads the shards."""
    train = write_jsonl(tmp_path / "train.jsonl", [f"{text}\n# variant {i}\n" for i in range(40) for text in DOCUMENTS])
    held_out = write_jsonl(tmp_path / "validation.jsonl", [f"{text}\n# held out {i}\n" for i in range(10) for text in DOCUMENTS])
    for source in (train, held_out):
        prepare_tokens([str(source)], tmp_path / f"{source.stem}-tokens", builtin_tokenizer, workers=1, progress=False)
    runs = {}
    for name, suffix in (("files", ".jsonl"), ("tokens", "-tokens")):
        run_cli("train", "--run-dir", str(tmp_path / name),
                *sets(*TINY, "training.steps=2", "validation.freq=2", f"data.source={name}",
                      f"data.path={tmp_path / ('train' + suffix)}", f"data.validation_path={tmp_path / ('validation' + suffix)}"))
        runs[name] = losses(tmp_path / name), metrics(tmp_path / name, "validation")[2]["validation_metrics/loss"]
    assert runs["tokens"][0] == pytest.approx(runs["files"][0], rel=1e-6)
    assert runs["tokens"][1] == pytest.approx(runs["files"][1], rel=1e-6)


def test_prepare_refuses_bad_arguments_in_one_line(capsys, tmp_path):
    err = fail(capsys, "prepare", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "out"))
    assert err == f"titan-async: INPUT = '{tmp_path / 'none.jsonl'}': no jsonl/json/parquet/txt files found there"
    source = write_jsonl(tmp_path / "docs.jsonl", DOCUMENTS)
    err = fail(capsys, "prepare", str(source), "--out", str(tmp_path / "out"), "--tokenizer", str(tmp_path))
    assert err == f"titan-async: --tokenizer {tmp_path}: expected a directory containing tokenizer.json"
    err = fail(capsys, "prepare", str(source), "--out", str(tmp_path / "out"), "--text-field", "body", "--workers", "1")
    assert err.startswith(f"titan-async: --text-field 'body': document 0 of {source} has no such field")


def logged_samples(batches: Path) -> list[list[int]]:
    """Every sample's input tokens that the ranks logged (TITAN_ASYNC_BATCH_LOG)."""
    records = [json.loads(line) for path in sorted(batches.glob("rank*.jsonl")) for line in path.read_text().splitlines()]
    return [row for record in records for row in record["input"]]


def test_resume_on_another_number_of_data_ranks_continues_the_global_order(tmp_path, builtin_tokenizer):
    """2 data ranks for 2 steps then 1 for 2 more, and 1 then 2 (global batch 8): each of the corpus's
    first 4 x 8 windows is trained on exactly once, and the losses are those of 2 ranks throughout."""
    source = write_jsonl(tmp_path / "docs.jsonl", [f"{text}\n# variant {i}\n" for i in range(60) for text in DOCUMENTS])
    prepare_tokens([str(source)], tmp_path / "tokens", builtin_tokenizer, workers=1, progress=False)
    manifest = json.loads((tmp_path / "tokens" / "manifest.json").read_text())
    documents = [d for shard in manifest["shards"] for d in shard_documents(tmp_path / "tokens", shard, manifest["dtype"])]
    expected = sorted(inputs for inputs, _, _ in packed(documents, 64)[:32])
    assert len({tuple(w) for w in expected}) == 32
    common = sets(*TINY, "validation.enable=false", "data.source=tokens", f"data.path={tmp_path / 'tokens'}",
                  "training.global_batch_size=8", "lr_scheduler.total_steps=4", "checkpoint.interval=2")
    run_cli("train", "--run-dir", str(tmp_path / "full"), "--nproc-per-node", "2", *common, *sets("training.steps=4"))
    full = losses(tmp_path / "full")
    assert sorted(full) == [1, 2, 3, 4]
    for first, then in ((2, 1), (1, 2)):
        run, env = tmp_path / f"{first}-then-{then}", {"TITAN_ASYNC_BATCH_LOG": str(tmp_path / f"batches-{first}-{then}")}
        run_cli("train", "--run-dir", str(run), "--nproc-per-node", str(first), *common, *sets("training.steps=2"), env=env)
        run_cli("resume", "--run-dir", str(run), "--nproc-per-node", str(then), *sets("training.steps=4"), env=env)
        assert sorted(logged_samples(tmp_path / f"batches-{first}-{then}")) == expected
        split = losses(run)
        assert [split[step] for step in range(1, 5)] == pytest.approx([full[step] for step in range(1, 5)], rel=1e-5)


def test_blend_follows_the_weights_deterministically():
    # Weights 3:1 -> 0.75, 0.25: the source with the largest w * (i + 1) - n, ties to the first.
    state = MixtureState(0, [0, 0], [0, 0])
    schedule = MixtureSchedule((0,), ((3.0, 1.0),))
    assert [next_sample(schedule, state, 0) for _ in range(8)] == [
        (0, 0), (0, 1), (1, 0), (0, 2), (0, 3), (0, 4), (1, 1), (0, 5)]
    assert state == MixtureState(0, [6, 2], [6, 2])


def test_mixture_and_stages_in_the_global_order_resume_on_another_width(tmp_path):
    a = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18]]
    b = [[101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111, 112, 113, 114, 115, 116, 117]]
    paths = str(write_megatron(tmp_path / "a", a)), str(write_megatron(tmp_path / "b", b))
    wa, wb = packed(a, 2), packed(b, 2)
    # Weights 3:1 on 2 ranks x 2 samples: samples A0 A1 B0 A2 | A3 A4 B1 A5.
    mixed = [iter(dataset(*paths, seq_len=2, stage_weights=((3.0, 1.0),), dp_rank=r, dp_world_size=2,
                          local_batch_size=2, infinite=True)) for r in range(2)]
    assert [windows(next(mixed[r]) for _ in range(2)) for r in range(2)] == [[wa[0], wa[1]], [wb[0], wa[2]]]
    assert [windows(next(mixed[r]) for _ in range(2)) for r in range(2)] == [[wa[3], wa[4]], [wb[1], wa[5]]]
    # Stages of 4 samples a step: only A in step 0, only B in step 1, then 1:1 from a fresh count (A first on the tie).
    staged = dataset(*paths, seq_len=2, stage_steps=(0, 1, 2), stage_weights=((1.0, 0.0), (0.0, 1.0), (1.0, 1.0)),
                     local_batch_size=2, ramp=BatchRamp((0,), (4,)), infinite=True)
    running = iter(staged)
    assert windows(next(running) for _ in range(4)) == [wa[0], wa[1], wa[2], wa[3]]
    state = staged.state_dict()
    assert state == {"sample": 4, "step": 1, "stage": 0, "stage_counts": [4, 0], "positions": [4, 0]}
    resumed = [dataset(*paths, seq_len=2, stage_steps=(0, 1, 2), stage_weights=((1.0, 0.0), (0.0, 1.0), (1.0, 1.0)),
                       dp_rank=r, dp_world_size=2, local_batch_size=1, ramp=BatchRamp((0,), (4,)), infinite=True) for r in range(2)]
    for data in resumed:
        data.load_state_dict(state)
    running = [iter(data) for data in resumed]
    assert [windows([next(running[r])]) for _ in range(4) for r in range(2)] == [
        [wb[0]], [wb[1]], [wb[2]], [wb[3]], [wa[4]], [wb[4]], [wa[5]], [wb[5]]]


@pytest.mark.parametrize("assignments, message", [
    (["data.weights=[0.5, -0.5]"], "--set 'data.weights=[0.5, -0.5]': data.weights: expected a number >= 0, got -0.5"),
    (["data.weights=[0, 0]"], "data.weights = [0.0, 0.0]: the weights sum to zero; give at least one source a positive weight"),
    (["data.weights=[1, 2, 3]"], "data.weights has 3 entries, data.paths has 2: give one per source"),
    (["data.names=['x']"], "data.names has 1 entries, data.paths has 2: give one per source"),
    (["data.stage_steps=[0, 5, 5]", "data.stage_weights=[[1, 0], [0, 1], [1, 1]]"],
     "data.stage_steps = [0, 5, 5]: expected steps strictly increasing from 0, one per stage"),
    (["data.stage_steps=[1]", "data.stage_weights=[[1, 0]]"], "data.stage_steps = [1]: expected steps strictly increasing from 0, one per stage"),
    (["data.stage_steps=[0, 5]", "data.stage_weights=[[1, 0]]"],
     "data.stage_weights has 1 stages, data.stage_steps has 2: give one weight list per stage"),
    (["data.stage_steps=[0]", "data.stage_weights=[[1, 0, 1]]"],
     "data.stage_weights[0] has 3 weights, data.paths has 2: give one per source"),
])
def test_bad_mixtures_are_refused_in_one_line(capsys, tmp_path, prepared, assignments, message):
    err = refusal(capsys, tmp_path, f"data.paths=['{prepared}', '{prepared}']", "data.names=['a', 'b']", *assignments)
    assert err == f"titan-async: {message}"


def test_missing_mixture_source_is_refused(capsys, tmp_path, prepared):
    err = refusal(capsys, tmp_path, f"data.paths=['{prepared}', '{tmp_path / 'none'}']", "data.weights=[1, 1]")
    assert err.startswith(f"titan-async: data.paths[1] = '{tmp_path / 'none'}': expected a directory with manifest.json")


def test_each_source_is_validated_apart_and_reported(capsys, tmp_path, builtin_tokenizer):
    """A mixture with weights [1, 0] trains as a run on its first source alone: its validation loss per
    source is what such runs log on that source's validation data, and the report shows both."""
    texts = {"a": [f"{text}\n# variant {i}\n" for i in range(20) for text in DOCUMENTS],
             "b": [f"Lorem ipsum {i} dolor sit amet, consectetur adipiscing elit.\n" * 3 for i in range(80)],
             "va": [f"{text}\n# held out {i}\n" for i in range(5) for text in DOCUMENTS],
             "vb": [f"Lorem ipsum {i} sed do eiusmod tempor.\n" * 3 for i in range(20)]}
    for name, documents in texts.items():
        prepare_tokens([str(write_jsonl(tmp_path / f"{name}.jsonl", documents))], tmp_path / name, builtin_tokenizer, workers=1, progress=False)
    common = sets(*TINY, "training.steps=2", "validation.freq=2", "data.source=tokens")
    for held_out in ("va", "vb"):
        run_cli("train", "--run-dir", str(tmp_path / f"alone-{held_out}"),
                *common, *sets(f"data.path={tmp_path / 'a'}", f"data.validation_path={tmp_path / held_out}"))
    run_cli("train", "--run-dir", str(tmp_path / "mixture"), *common,
            *sets(f"data.paths=['{tmp_path / 'a'}', '{tmp_path / 'b'}']", "data.weights=[1, 0]", "data.names=['code', 'lorem']",
                  f"data.validation_paths=['{tmp_path / 'va'}', '{tmp_path / 'vb'}']"))
    alone = {held_out: metrics(tmp_path / f"alone-{held_out}", "validation")[2]["validation_metrics/loss"] for held_out in ("va", "vb")}
    row = metrics(tmp_path / "mixture", "validation")[2]
    assert row["validation_metrics/loss/code"] == pytest.approx(alone["va"], rel=1e-6)
    assert row["validation_metrics/loss/lorem"] == pytest.approx(alone["vb"], rel=1e-6)
    assert row["validation_metrics/loss"] == pytest.approx(alone["va"], rel=1e-6)  # the mixture's weights: va only
    assert cli_in_process(capsys, "report", "--run-dir", str(tmp_path / "mixture"))[0] == 0
    page = (tmp_path / "mixture" / "report" / "report.html").read_text()
    assert f"final validation loss, lorem</td><td>{row['validation_metrics/loss/lorem']:.4f} (step 2)" in page


def test_mixture_keys_are_refused_for_text_sources(capsys, tmp_path):
    err = fail(capsys, "train", "--run-dir", str(tmp_path / "run"), *sets(*TINY, "data.weights=[1, 2]"))
    assert err == "titan-async: data.weights applies to data.source = 'tokens' only"
