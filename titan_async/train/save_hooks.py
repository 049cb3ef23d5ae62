"""The one wrapper of torchtitan's `checkpointer.save`, with hooks before and after it."""

from __future__ import annotations

from collections.abc import Callable


class SaveHooks:
    """torchtitan calls `checkpointer.save(step, last_step)` at every step and saves on the
    interval. `before` hooks run, in order, when that call will save (a streaming schedule drains
    there); `after` hooks run after every call with whether it saved (checksums, benchmarks)."""

    def __init__(self, checkpointer) -> None:
        self.checkpointer = checkpointer
        self.before: list[Callable[[int, bool], None]] = []
        self.after: list[Callable[[int, bool, bool], None]] = []
        self._save = checkpointer.save
        checkpointer.save = self.save

    def save(self, step: int, last_step: bool = False) -> bool:
        if self.before and self.checkpointer._should_save(step, last_step):
            for hook in self.before:
                hook(step, last_step)
        saved = self._save(step, last_step=last_step)
        for hook in self.after:
            hook(step, last_step, saved)
        return saved
