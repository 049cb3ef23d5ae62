"""`titan-async eval` without `--tasks`: validation loss of a DCP checkpoint, and a greedy sample.

The loss is computed exactly as torchtitan's Validator does during training
(same split, batch size, number of batches, and one data shard per data-parallel
rank of the training run), so it reproduces the validation loss logged at the
checkpoint's step.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tempfile
from pathlib import Path

import datasets
import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from torch.distributed.checkpoint.api import CheckpointException
from torchtitan.components.loss import IGNORE_INDEX

from titan_async.config.assemble import trainer_config
from titan_async.config.run_config import RunConfig, load_run_config
from titan_async.run import process
from titan_async.rundir import directory as runs
from titan_async.rundir.checkpoints import checked_step


def _single_process(run: RunConfig) -> RunConfig:
    """`run` with every parallel degree 1, evaluation-only settings."""
    parallelism = dataclasses.replace(
        run.parallelism,
        pipeline_parallel_degree=1,
        data_parallel_shard_degree=-1,
        data_parallel_replicate_degree=1,
        tensor_parallel_degree=1,
        context_parallel_degree=1,
        expert_parallel_degree=1,
    )
    metrics = dataclasses.replace(run.metrics, enable_tensorboard=False)
    return dataclasses.replace(run, parallelism=parallelism, metrics=metrics)


def _build_trainer(run: RunConfig, checkpoint: Path, scratch: Path):
    """The trainer of `run` on one process, built as training builds it (same parallelize
    function, so the same mixed-precision compute), set to load only the model weights of
    `checkpoint`, with its outputs in `scratch`."""
    process.become_single_process()
    config = trainer_config(_single_process(run), scratch)
    config.checkpoint = dataclasses.replace(
        config.checkpoint, initial_load_path=str(checkpoint.resolve()), initial_load_model_only=True
    )
    config.validator.enable = False
    return config.build()


def _load_weights(trainer, checkpoint: Path) -> None:
    """Load the checkpoint's model weights; UserError naming `checkpoint` if it cannot be read."""
    try:
        trainer.checkpointer.load()
    except (Exception, CheckpointException) as err:
        raise runs.unreadable_checkpoint(checkpoint, err) from None


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
    step = checked_step(checkpoint)
    datasets.disable_progress_bars()  # a cold cache would print its data-preparation bars
    run_dir = checkpoint.parent.parent
    run = load_run_config(run_dir / runs.CONFIG_FILE)
    world_size = runs.load_launch(run_dir).get("world_size", 1)
    with tempfile.TemporaryDirectory() as scratch:
        trainer = _build_trainer(run, checkpoint, Path(scratch))
        try:
            _load_weights(trainer, checkpoint)
            model = trainer.model_parts[0].eval()
            loss, tokens = validation_loss(model, trainer.config, trainer.tokenizer, run.data_parallel_degree(world_size))
            continuation = greedy_continuation(model, trainer.tokenizer, prompt, max_new_tokens)
        finally:
            trainer.close()
            dist.destroy_process_group()
    result = {
        "checkpoint": str(checkpoint),
        "step": step,
        "loss": loss,
        "perplexity": math.exp(loss),
        "tokens": tokens,
        "prompt": prompt,
        "continuation": continuation,
    }
    if as_json:
        print(json.dumps(result))
        return 0
    table = Table(title=f"eval {checkpoint}", show_header=False)
    for key, value in result.items():
        table.add_row(key, f"{value:.4f}" if isinstance(value, float) else repr(value) if key != "checkpoint" else value)
    Console().print(table)
    return 0

