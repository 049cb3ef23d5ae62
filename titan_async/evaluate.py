"""`titan-async eval`: validation loss of a DCP checkpoint, and a greedy sample.

The loss is computed exactly as torchtitan's Validator does during training
(same split, batch size, number of batches, and one data shard per data-parallel
rank of the training run), so it reproduces the validation loss logged at the
checkpoint's step.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from rich.console import Console
from rich.table import Table
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.tokenizer import HuggingFaceTokenizer

from titan_async import run_dir as runs
from titan_async.config.assemble import trainer_config
from titan_async.config.run_config import load_run_config
from titan_async.errors import UserError


def _load_model(checkpoint: Path, config):
    """The model of `config` with the weights stored in `checkpoint` (CPU, eval mode)."""
    model_config = config.model_spec.model
    model_config.update_from_config(config=config)
    with torch.device("meta"):
        model = model_config.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    state = model.state_dict()
    try:
        dcp.load(state, checkpoint_id=str(checkpoint))
    except (Exception, CheckpointException) as err:
        reason = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        raise UserError(f"--checkpoint {checkpoint}: cannot read the checkpoint ({reason})") from None
    model.load_state_dict(state)
    return model.eval()


def _forward(model, inputs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    masks = model.get_attention_masks(positions=positions)
    return model(inputs, attention_masks=masks, positions=positions)


@torch.no_grad()
def validation_loss(model, config, tokenizer, data_parallel_degree: int) -> tuple[float, int]:
    """(mean loss per valid token, valid tokens) over the validation batches of every DP shard."""
    loss_fn = config.loss.build()
    steps = config.validator.steps
    total_loss, total_tokens = 0.0, 0
    for rank in range(data_parallel_degree):
        loader = config.validator.dataloader.build(
            dp_world_size=data_parallel_degree,
            dp_rank=rank,
            tokenizer=tokenizer,
            seq_len=config.training.seq_len,
            local_batch_size=config.training.local_batch_size,
        )
        for index, (input_dict, labels) in enumerate(loader):
            if steps != -1 and index >= steps:
                break
            loss_sum, _ = loss_fn(_forward(model, input_dict["input"], input_dict["positions"]), labels)
            total_loss += float(loss_sum)
            total_tokens += int((labels != IGNORE_INDEX).sum())
    return total_loss / total_tokens, total_tokens


@torch.no_grad()
def greedy_continuation(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    """Up to `max_new_tokens` greedily decoded tokens after `prompt` (stops at end of text)."""
    tokens = tokenizer.encode(prompt, add_bos=True, add_eos=False)
    generated: list[int] = []
    for _ in range(max_new_tokens):
        ids = torch.tensor([tokens + generated])
        logits = _forward(model, ids, torch.arange(ids.shape[1]).unsqueeze(0))
        next_token = int(logits[0, -1].argmax())
        if next_token == tokenizer.eos_id:
            break
        generated.append(next_token)
    return tokenizer.decode(generated)


def evaluate_checkpoint(checkpoint: Path, *, as_json: bool, prompt: str, max_new_tokens: int) -> int:
    """Print the evaluation of `checkpoint`; returns the exit status."""
    match = re.fullmatch(r"step-(\d+)", checkpoint.name)
    if not checkpoint.is_dir() or match is None:
        raise UserError(f"--checkpoint {checkpoint}: expected a checkpoint directory RUN/checkpoint/step-N")
    if not (checkpoint / ".metadata").is_file():
        raise UserError(f"--checkpoint {checkpoint}: incomplete checkpoint (no .metadata; the save did not finish)")
    run_dir = checkpoint.parent.parent
    run = load_run_config(run_dir / "config.toml")
    config = trainer_config(run, run_dir)
    tokenizer = HuggingFaceTokenizer.Config().build(tokenizer_path=config.hf_assets_path)
    model = _load_model(checkpoint, config)
    world_size = runs.load_launch(run_dir).get("world_size", 1)
    loss, tokens = validation_loss(model, config, tokenizer, run.data_parallel_degree(world_size))
    result = {
        "checkpoint": str(checkpoint),
        "step": int(match.group(1)),
        "loss": loss,
        "perplexity": math.exp(loss),
        "tokens": tokens,
        "prompt": prompt,
        "continuation": greedy_continuation(model, tokenizer, prompt, max_new_tokens),
    }
    if as_json:
        print(json.dumps(result))
        return 0
    table = Table(title=f"eval {checkpoint}", show_header=False)
    for key, value in result.items():
        table.add_row(key, f"{value:.4f}" if isinstance(value, float) else repr(value) if key != "checkpoint" else value)
    Console().print(table)
    return 0
