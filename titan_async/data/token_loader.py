"""torchtitan's stateful data loader over token files (`data.source = "tokens"`).

Every source is packed as torchtitan's `HuggingFaceTextDataset` packs (packed_windows.py). The run
reads one global sequence of samples, whatever the data-parallel width: global sample g (from 0,
over the whole run) is the next window of the source the mixture schedule draws at g's step
(mixture.py), the step following from the batch-size ramp (batch_ramp.py); one source is a
mixture of one. Samples are served in rounds of
dp_world_size x local_batch_size: in the round that starts at global sample b, data rank r gets
samples b + r * local_batch_size ... b + (r + 1) * local_batch_size - 1 as its batch. A step takes
whole rounds, so after every step the run has consumed a prefix of the order, and a run resumed on
another number of data ranks continues it with no sample repeated or skipped.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field

from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.tools.logging import logger

from titan_async.data.batch_ramp import BatchRamp
from titan_async.data.mixture import MixtureSchedule, MixtureState, next_sample
from titan_async.data.packed_windows import PackedWindows
from titan_async.data.token_files import open_tokens

STATE_KEY = "dp_rank_0"
"""The one key the loader's checkpointed state is saved and loaded under, on every rank: the state
is the same on all of them, so a checkpoint of any data-parallel width loads on any other."""


class TokenDataset(IterableDataset, Stateful):
    """Data rank `dp_rank`'s samples of the global order: ({"input", "positions"}, labels).

    `ramp` (its sizes multiples of a round; default: one round a step) maps samples to steps, which
    pick the mixture's stage.
    With `infinite`, a source past its end starts over (same order); otherwise the data ends before
    the first round that would need a window past a source's end, on every rank alike. The state,
    the same on every rank after each batch: the next global sample, the step it falls in, and the
    mixture's state.
    """

    def __init__(self, sources: list[PackedWindows], schedule: MixtureSchedule, *, dp_rank: int = 0,
                 dp_world_size: int = 1, local_batch_size: int = 1, ramp: BatchRamp | None = None, infinite: bool = False):
        self._sources, self._schedule = sources, schedule
        self._dp_rank, self._local_batch_size = dp_rank, local_batch_size
        self._round = dp_world_size * local_batch_size
        self._ramp = ramp or BatchRamp((0,), (self._round,))
        self.infinite = infinite
        self._sample, self._step_base, self._sample_base = 0, 0, 0
        self._mixture = MixtureState(0, [0] * len(sources), [0] * len(sources))

    def _step_of(self, sample: int) -> int:
        return self._ramp.step_of(sample, self._step_base, self._sample_base)

    def __iter__(self):
        while (drawn := self._next_round()) is not None:
            first = self._dp_rank * self._local_batch_size
            for source, window in drawn[first : first + self._local_batch_size]:
                windows = self._sources[source]
                if window and window % len(windows) == 0:
                    logger.warning(f"Token source {source} is being re-looped (epoch {window // len(windows)})")
                inputs, labels, positions = windows.window(window % len(windows))
                yield {"input": inputs, "positions": positions}, labels

    def _next_round(self) -> list[tuple[int, int]] | None:
        """(source, window) of every sample of the next round, and the state moved past it; None
        (state kept) when the data has run out."""
        mixture = MixtureState(self._mixture.stage, list(self._mixture.stage_counts), list(self._mixture.positions))
        drawn = [next_sample(self._schedule, mixture, self._step_of(self._sample + i)) for i in range(self._round)]
        for source, window in drawn:
            if not len(self._sources[source]):
                raise ValueError(f"token source {source} holds no window of {self._sources[source].seq_len} tokens")
            if not self.infinite and window >= len(self._sources[source]):
                logger.warning("Token data set has run out of data")
                return None
        self._sample, self._mixture = self._sample + self._round, mixture
        return drawn

    def state_dict(self) -> dict:
        return {"sample": self._sample, "step": self._step_of(self._sample), "stage": self._mixture.stage,
                "stage_counts": list(self._mixture.stage_counts), "positions": list(self._mixture.positions)}

    def load_state_dict(self, state_dict: dict) -> None:
        if "sample" not in state_dict:
            raise ValueError("the checkpoint's token loader state is of the per-rank document split, "
                             "which this version cannot continue; start a new run")
        if len(state_dict["positions"]) != len(self._sources):
            raise ValueError(f"the checkpoint's token data had {len(state_dict['positions'])} sources, "
                             f"this run has {len(self._sources)}")
        self._sample = self._sample_base = state_dict["sample"]
        self._step_base = state_dict["step"]
        self._mixture = MixtureState(state_dict["stage"], list(state_dict["stage_counts"]), list(state_dict["positions"]))


class TokenDataLoader(ParallelAwareDataloader):
    """torchtitan's stateful data-parallel loader over a prepared directory or a Megatron-LM prefix."""

    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        sources: list[str] = field(default_factory=list)
        """Each source's directory or Megatron-LM prefix."""
        source_keys: list[str] = field(default_factory=list)
        """The config key that names each source, for messages."""
        stage_steps: list[int] = field(default_factory=lambda: [0])
        """The first step of each stage of the mixture."""
        stage_weights: list[list[float]] = field(default_factory=lambda: [[1.0]])
        """Each stage's weight per source."""
        batch_steps: list[int] = field(default_factory=list)
        batch_sizes: list[int] = field(default_factory=list)
        """Global samples a step takes (the batch ramp, `BatchRamp`); empty: one round of the data ranks."""
        infinite: bool = True
        """Whether to loop over the data without end."""

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, seq_len: int, local_batch_size: int,
                 snapshot_every_n_steps: int | None = 1, **kwargs):
        sources = [PackedWindows(open_tokens(path, key), seq_len) for path, key in zip(config.sources, config.source_keys)]
        schedule = MixtureSchedule(tuple(config.stage_steps), tuple(map(tuple, config.stage_weights)))
        dataset = TokenDataset(sources, schedule, dp_rank=dp_rank, dp_world_size=dp_world_size, local_batch_size=local_batch_size,
                               ramp=BatchRamp(tuple(config.batch_steps), tuple(config.batch_sizes)) if config.batch_steps else None,
                               infinite=config.infinite)
        super().__init__(
            dataset,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            batch_size=local_batch_size,
            num_workers=config.num_workers,
            persistent_workers=config.persistent_workers,
            pin_memory=config.pin_memory,
            prefetch_factor=config.prefetch_factor,
            snapshot_every_n_steps=snapshot_every_n_steps,
        )

    def state_dict(self) -> dict:
        """The state under STATE_KEY on every rank (the same state), with the width that saved it."""
        return {STATE_KEY: pickle.dumps(StatefulDataLoader.state_dict(self)), "world_size": self.dp_world_size}

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads the state whatever width saved it (torchtitan's loader refuses another width)."""
        if not state_dict:
            return
        if state_dict["world_size"] != self.dp_world_size:
            logger.info(f"Token loader: continuing the global sample order of {state_dict['world_size']} "
                        f"data ranks on {self.dp_world_size}")
        StatefulDataLoader.load_state_dict(self, pickle.loads(state_dict[STATE_KEY]))
