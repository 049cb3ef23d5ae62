"""Random access to one token corpus's packed windows, in memory that does not grow with the corpus.

Packing is torchtitan's `HuggingFaceTextDataset`'s: each document is shifted within itself (inputs
tokens[:-1], labels tokens[1:], so no label crosses into the next document), the shifted documents
are concatenated into one stream in corpus order, and the stream is cut into `seq_len` windows (the
rest dropped), with positions that restart at 0 at each document and at each window. Window w
covers stream positions [w * seq_len, (w + 1) * seq_len).

No per-document index is built: a cursor (a document and the stream position where it starts)
moves forward over the memory-mapped document lengths, CHUNK documents at a time. Reading windows
in increasing order is one pass over the lengths; a window before the cursor (a new epoch, a
resume) restarts the scan at document 0. The window count takes one pass, on first use.
"""

from __future__ import annotations

import numpy as np
import torch

from titan_async.data.token_files import TokenCorpus

CHUNK = 1 << 14
"""Document lengths read at a time."""


class PackedWindows:
    """Window w of `corpus` cut into `seq_len` windows: (inputs, labels, positions), int64 tensors."""

    def __init__(self, corpus: TokenCorpus, seq_len: int):
        self._corpus, self.seq_len = corpus, seq_len
        self._document, self._start = 0, 0
        """The cursor: a document, and the stream position of its first shifted token."""
        self._count: int | None = None

    def __len__(self) -> int:
        if self._count is None:
            tokens, document = 0, 0
            while document < len(self._corpus):
                lengths = self._corpus.lengths_between(document, document + CHUNK)
                tokens += int(np.maximum(lengths - 1, 0).sum())
                document += len(lengths)
            self._count = tokens // self.seq_len
        return self._count

    def window(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Window `index` (0 <= index < len(self))."""
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} of {len(self)}")
        document, offset = self._seek(index * self.seq_len)
        inputs, labels, positions, need = [], [], [], self.seq_len
        while need:
            tokens = self._corpus.document(document)
            take = min(need, len(tokens) - 1 - offset)
            if take > 0:
                inputs.append(tokens[offset : offset + take])
                labels.append(tokens[offset + 1 : offset + 1 + take])
                positions.append(np.arange(take))
                need -= take
            document, offset = document + 1, 0
        return tuple(torch.from_numpy(np.concatenate(part).astype(np.int64)) for part in (inputs, labels, positions))

    def _seek(self, position: int) -> tuple[int, int]:
        """(document, offset within its shifted tokens) of stream position `position`, which exists;
        moves the cursor to that document."""
        if position < self._start:
            self._document, self._start = 0, 0
        while True:
            shifted = np.maximum(self._corpus.lengths_between(self._document, self._document + CHUNK) - 1, 0)
            ends = self._start + np.cumsum(shifted)
            inside = int(np.searchsorted(ends, position, side="right"))
            if inside < len(ends):
                if inside:
                    self._document, self._start = self._document + inside, int(ends[inside - 1])
                return self._document, position - self._start
            self._document, self._start = self._document + len(ends), int(ends[-1])
