"""`titan-async export` read back by transformers, and runs started from Hugging Face weights.

transformers' own LlamaForCausalLM and AutoTokenizer are the reference: an export must give
the logits of titan-async's forward, its token ids, `titan-async eval`'s validation loss,
and a run started from the export must see the exported model's loss on its first batches.
Attention is per document in titan-async; transformers gets the same block-causal mask.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from itertools import islice
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.tokenizer import HuggingFaceTokenizer

from conftest import CONFIGS, TINY, checkpoint_weights, losses, run_cli, sets
from test_bad_input import fail
from titan_async import cli
from titan_async.commands import export
from titan_async.model import hf_conversion
from titan_async.config.assemble import trainer_config
from titan_async.config.run_config import load_run_config
from titan_async.data.sources import tokenizer_dir
from titan_async.core.errors import UserError
from titan_async.model.llama import ModelSection, build_model_spec

STEPS = 3
RUN = (*TINY, f"training.steps={STEPS}", "model.n_kv_heads=2", "validation.enable=false")
LAYOUTS = {
    "single": ("--config", str(CONFIGS / "debug_cpu.toml")),
    "pp2-2bw": ("--config", str(CONFIGS / "debug_cpu_pp2_2bw.toml"), "--nproc-per-node", "2"),
    "fsdp2-tied": ("--config", str(CONFIGS / "debug_cpu_fsdp2.toml"), "--nproc-per-node", "2", *sets("model.weight_tying=yes")),
}


_EXPORTS: dict[str, tuple[Path, Path, Path]] = {}


def export_of(layout: str, tmp_path_factory) -> tuple[Path, Path, Path]:
    """(run directory, its last checkpoint, the export of that checkpoint) of a tiny run in
    `layout`, trained and exported once per test session."""
    if layout not in _EXPORTS:
        root = tmp_path_factory.mktemp(layout)
        run_cli("train", *LAYOUTS[layout], "--run-dir", str(root / "run"), *sets(*RUN))
        checkpoint = root / "run" / "checkpoint" / f"step-{STEPS}"
        export_cli(checkpoint, root / "hf")
        _EXPORTS[layout] = (root / "run", checkpoint, root / "hf")
    return _EXPORTS[layout]


@pytest.fixture(scope="module", params=list(LAYOUTS))
def exported(request, tmp_path_factory):
    return export_of(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def single_export(tmp_path_factory):
    return export_of("single", tmp_path_factory)


def hf_model(directory: Path) -> transformers.LlamaForCausalLM:
    return transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def document_mask(positions: torch.Tensor) -> torch.Tensor:
    """[batch, 1, L, L] True where a token may attend: earlier tokens of its own document
    (a document starts where its position is 0)."""
    document = (positions == 0).cumsum(-1)
    same = document[:, :, None] == document[:, None, :]
    return (same & torch.ones_like(same[0]).tril())[:, None]


@torch.no_grad()
def hf_logits(model, input_dict) -> torch.Tensor:
    positions = input_dict["positions"]
    return model(input_ids=input_dict["input"], position_ids=positions, attention_mask=document_mask(positions)).logits


def run_tokenizer(run_dir: Path) -> HuggingFaceTokenizer:
    return HuggingFaceTokenizer(tokenizer_path=str(tokenizer_dir(load_run_config(run_dir / "config.toml").data)))


def loaders(run_dir: Path, split: str, dp_degree: int = 1) -> list:
    """The run's torchtitan loaders of `split` ("train" or "validation"), one per data-parallel rank."""
    run = load_run_config(run_dir / "config.toml")
    with tempfile.TemporaryDirectory() as scratch:
        config = trainer_config(run, Path(scratch), dp_degree)
    loader = config.dataloader if split == "train" else config.validator.dataloader
    return [
        loader.build(dp_world_size=dp_degree, dp_rank=rank, tokenizer=run_tokenizer(run_dir),
                     seq_len=run.training.seq_len, local_batch_size=run.training.local_batch_size)
        for rank in range(dp_degree)
    ]


def mean_loss(model, pairs) -> float:
    """transformers' cross-entropy per valid token over (input dict, labels) batches."""
    total, tokens = 0.0, 0
    for input_dict, labels in pairs:
        logits = hf_logits(model, input_dict)
        total += float(F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"))
        tokens += int((labels != IGNORE_INDEX).sum())
    return total / tokens


def titan_model(run_dir: Path, checkpoint: Path) -> torch.nn.Module:
    """titan-async's model of the run with the checkpoint's weights, on one process."""
    run = load_run_config(run_dir / "config.toml")
    model = build_model_spec(run.model, run_tokenizer(run_dir).get_vocab_size()).model.build()
    model.init_states(buffer_device=None)
    model.load_state_dict(checkpoint_weights(checkpoint))
    return model.eval()


def test_export_files(exported):
    _, _, out = exported
    names = sorted(p.name for p in out.iterdir())
    assert names == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert json.loads((out / "config.json").read_text())["num_key_value_heads"] == 2


def test_transformers_logits_equal_titan_forward_on_held_out_tokens(exported):
    run_dir, checkpoint, out = exported
    input_dict, _ = next(iter(loaders(run_dir, "validation")[0]))
    model = titan_model(run_dir, checkpoint)
    with torch.no_grad():
        positions = input_dict["positions"]
        ours = model(input_dict["input"], attention_masks=model.get_attention_masks(positions=positions), positions=positions)
    theirs = hf_logits(hf_model(out), input_dict)
    assert torch.allclose(theirs, ours, rtol=1e-4, atol=1e-4 * float(ours.abs().max()))


def test_auto_tokenizer_gives_the_run_tokenizers_ids(exported):
    run_dir, _, out = exported
    ours = run_tokenizer(run_dir)
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    text = "def main():\n    print('Hello, world!')  # naïve café\n"
    assert theirs(text)["input_ids"] == ours.encode(text, add_bos=True, add_eos=False)
    assert theirs.decode(theirs(text)["input_ids"], skip_special_tokens=True) == text


def test_transformers_validation_loss_equals_titan_eval(exported):
    run_dir, checkpoint, out = exported
    result = json.loads(run_cli("eval", "--checkpoint", str(checkpoint), "--json", "--max-new-tokens", "1").stdout)
    run = load_run_config(run_dir / "config.toml")
    dp_degree = run.data_parallel_degree(json.loads((run_dir / "launch.json").read_text())["world_size"])
    pairs = [pair for loader in loaders(run_dir, "validation", dp_degree) for pair in islice(loader, run.validation.steps)]
    assert mean_loss(hf_model(out), pairs) == pytest.approx(result["loss"], rel=1e-5)


def test_run_started_from_the_export_sees_its_loss(single_export, tmp_path):
    """gradient_delay = 1 computes steps 1 and 2 at W[-1] = W[0]: both must be the exported weights."""
    _, _, out = single_export
    run_dir = tmp_path / "run"
    run_cli("train", "--run-dir", str(run_dir), *sets(*RUN, "training.steps=2", "training.gradient_delay=1",
                                                      f"checkpoint.initial_load_path={out}", "checkpoint.initial_load_in_hf=true"))
    model = hf_model(out)
    first, second = islice(loaders(run_dir, "train")[0], 2)
    assert losses(run_dir)[1] == pytest.approx(mean_loss(model, [first]), rel=1e-5)
    assert losses(run_dir)[2] == pytest.approx(mean_loss(model, [second]), rel=1e-5)


def test_export_of_a_missing_checkpoint(capsys, tmp_path):
    err = fail(capsys, "export", "--checkpoint", str(tmp_path / "run" / "checkpoint" / "step-3"), "--out", str(tmp_path / "hf"))
    assert "step-3: no such checkpoint (the run has: none)" in err
    assert not (tmp_path / "hf").exists()


def test_export_of_a_corrupt_checkpoint(capsys, tmp_path):
    step = tmp_path / "checkpoint" / "step-3"
    step.mkdir(parents=True)
    (step / ".metadata").write_text("not a pickle")
    shutil.copy(CONFIGS / "debug_cpu.toml", tmp_path / "config.toml")
    err = fail(capsys, "export", "--checkpoint", str(step), "--out", str(tmp_path / "hf"))
    assert f"--checkpoint {step}: cannot read the checkpoint" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint", "config.toml"]


def export_cli(checkpoint: Path, out: Path, *options: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["export", "--checkpoint", str(checkpoint), "--out", str(out), *options])
    assert exit_info.value.code == 0


def test_export_keeps_a_non_empty_directory_unless_overwrite(capsys, single_export, tmp_path):
    _, checkpoint, _ = single_export
    (tmp_path / "notes.txt").write_text("mine")
    err = fail(capsys, "export", "--checkpoint", str(checkpoint), "--out", str(tmp_path))
    assert err == f"titan-async: --out {tmp_path}: exists and is not empty; pass --overwrite to replace it"
    assert (tmp_path / "notes.txt").read_text() == "mine"
    export_cli(checkpoint, tmp_path, "--overwrite", "--dtype", "bfloat16")
    assert not (tmp_path / "notes.txt").exists()
    assert {t.dtype for t in load_file(tmp_path / "model.safetensors").values()} == {torch.bfloat16}


def test_sharded_export_loads_the_same_weights(single_export, tmp_path, monkeypatch):
    _, checkpoint, whole = single_export
    monkeypatch.setattr(export, "SHARD_BYTES", 2**18)
    export_cli(checkpoint, tmp_path / "sharded")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert not (tmp_path / "sharded" / "model.safetensors").exists()
    expected, loaded = hf_model(whole).state_dict(), hf_model(tmp_path / "sharded").state_dict()
    assert expected.keys() == loaded.keys() and all(torch.equal(expected[k], loaded[k]) for k in expected)


@pytest.mark.parametrize("assignment, message", [
    ("model.vocab_size=4096", "its vocabulary has 2048 tokens, the config's model 4096"),
    ("model.n_layers=2", "model.layers.2.input_layernorm.weight has no place in the config's model"),
])
def test_start_from_hf_weights_that_do_not_fit_the_config(capsys, single_export, tmp_path, assignment, message):
    _, _, out = single_export
    err = fail(capsys, "train", "--run-dir", str(tmp_path / "run"), *sets(
        *RUN, assignment, f"checkpoint.initial_load_path={out}", "checkpoint.initial_load_in_hf=true"))
    assert f"checkpoint.initial_load_path = '{out}': {message}" in err


def test_model_transformers_cannot_express_is_refused():
    config = build_model_spec(ModelSection(), 2048).model
    for layer in config.layers:
        layer.attention.rope.scaling = "yarn"
    with pytest.raises(UserError, match="rope scaling 'yarn' has no Hugging Face Llama equivalent"):
        hf_conversion.hf_llama_config(config, 0, 1, "float32")
