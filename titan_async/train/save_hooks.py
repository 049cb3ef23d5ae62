"""The one wrapper of torchtitan's `checkpointer.save`, with hooks before and after it."""

from __future__ import annotations

from collections.abc import Callable


class SaveHooks:
    """torchtitan calls `checkpointer.save(step, last_step)` at every step and saves on the
    interval. `before` hooks run, in order, when that call will save (a streaming schedule drains
    there); `after` hooks run after every call with whether it saved (checksums, benchmarks).

    A step is saved once: a later call for the step last saved (a stop at a checkpoint step, after
    torchtitan's periodic save of it) saves nothing, the checkpoint on disk being that step's."""

    def __init__(self, checkpointer) -> None:
        self.checkpointer = checkpointer
        self.before: list[Callable[[int, bool], None]] = []
        self.after: list[Callable[[int, bool, bool], None]] = []
        self.saved_step: int | None = None
        self._save = checkpointer.save
        checkpointer.save = self.save

    def save(self, step: int, last_step: bool = False) -> bool:
        saved = False
        if step != self.saved_step:
            if self.before and self.checkpointer._should_save(step, last_step):
                for hook in self.before:
                    hook(step, last_step)
            saved = self._save(step, last_step=last_step)
        if saved:
            self.saved_step = step
        for hook in self.after:
            hook(step, last_step, saved)
        return saved
