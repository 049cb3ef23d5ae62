"""torchtitan's stateful data loader over token files (`data.source = "tokens"`).

Packs documents exactly as torchtitan's `HuggingFaceTextDataset` does: each document's tokens are
shifted within the document (inputs tokens[:-1], labels tokens[1:], so no label crosses into the
next document), concatenated, and cut into `seq_len` windows with per-document positions that
restart at 0 at each document and at each window. The data-parallel ranks split the documents into
contiguous ranges as `datasets.distributed.split_dataset_by_node` splits a map-style data set. The
state is a cursor (epoch, document, token offset), so resume is exact and small. Later epochs
repeat the rank's documents in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.tools.logging import logger

from titan_async.data.token_files import TokenCorpus, open_tokens


def rank_documents(documents: int, dp_rank: int, dp_world_size: int) -> range:
    """The contiguous documents of `dp_rank`, as `datasets`' `Dataset.shard(contiguous=True)` assigns them."""
    div, mod = divmod(documents, dp_world_size)
    start = div * dp_rank + min(dp_rank, mod)
    return range(start, start + div + (1 if dp_rank < mod else 0))


class TokenDataset(IterableDataset, Stateful):
    """`seq_len` windows of one data-parallel rank's documents: ({"input", "positions"}, labels)."""

    def __init__(self, corpus: TokenCorpus, seq_len: int, dp_rank: int = 0, dp_world_size: int = 1, infinite: bool = False):
        self._corpus = corpus
        self._documents = rank_documents(len(corpus), dp_rank, dp_world_size)
        self.seq_len = seq_len
        self.infinite = infinite
        self._epoch = 0
        self._document = 0
        """Index into this rank's documents of the next document to read from."""
        self._offset = 0
        """Tokens of that document's shifted stream already yielded."""

    def __iter__(self):
        while (window := self._next_window()) is not None:
            inputs, labels, positions = window
            yield {"input": inputs, "positions": positions}, labels

    def _next_window(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        inputs, labels, positions, need = [], [], [], self.seq_len
        empty_in_a_row = 0
        while need:
            if self._document == len(self._documents):
                if not self.infinite or empty_in_a_row >= len(self._documents):
                    logger.warning("Token data set has run out of data")
                    return None
                self._epoch, self._document, self._offset = self._epoch + 1, 0, 0
                logger.warning(f"Token data set is being re-looped (epoch {self._epoch})")
            tokens = self._corpus.document(self._documents[self._document])
            take = min(need, len(tokens) - 1 - self._offset)
            if take <= 0:
                empty_in_a_row += self._offset == 0
                self._document, self._offset = self._document + 1, 0
                continue
            inputs.append(tokens[self._offset : self._offset + take])
            labels.append(tokens[self._offset + 1 : self._offset + 1 + take])
            positions.append(np.arange(take))
            need -= take
            self._offset += take
            empty_in_a_row = 0
        return tuple(torch.from_numpy(np.concatenate(part).astype(np.int64)) for part in (inputs, labels, positions))

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._epoch, "document": self._document, "offset": self._offset, "documents": len(self._documents)}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        if state_dict["documents"] != len(self._documents):
            raise ValueError(f"the checkpoint's data rank read {state_dict['documents']} documents, "
                             f"this one has {len(self._documents)}: the token data changed")
        self._epoch, self._document, self._offset = state_dict["epoch"], state_dict["document"], state_dict["offset"]


class TokenDataLoader(ParallelAwareDataloader):
    """torchtitan's stateful data-parallel loader over a prepared directory or a Megatron-LM prefix."""

    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        infinite: bool = True
        """Whether to loop over the data without end."""

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, seq_len: int, local_batch_size: int,
                 snapshot_every_n_steps: int | None = 1, **kwargs):
        dataset = TokenDataset(open_tokens(config.dataset_path or "", "data.path"), seq_len, dp_rank, dp_world_size,
                               config.infinite)
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
