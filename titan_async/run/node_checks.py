"""Checks that one worker of each node makes for all the node's workers, under torchrun or Slurm.

Every worker of an externally launched job runs titan-async's command line, so each would repeat
the launcher's checks (the config's, the trainer config's, the memory estimate). `once_per_node`
runs them in local rank 0 alone, which hands their outcome to the node's other workers in a small
file in the node's temporary directory (`handoff`), named after what the node's workers share and
no other launch does: the job id, the Slurm step, the pid and start time of their parent (torchrun's
agent, or Slurm's step daemon) and the restart count. The other workers wait for it (at most
`TIMEOUT_S`) and fail with the same one-line error, or go on. Without an external launcher the one
launching process checks for all its workers, and so does a node of one worker.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from titan_async.core.errors import UserError
from titan_async.run import process

TIMEOUT_S = 900.0
"""How long a worker waits for its node's local rank 0 to finish the checks."""
HANDOFF_PREFIX = "titan-async-node-checks-"


def _parent_start() -> str:
    """The start time of this process's parent (Linux /proc; elsewhere empty): with its pid, a
    name no later process with a recycled pid shares."""
    try:
        return Path(f"/proc/{os.getppid()}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def handoff(what: str) -> Path:
    """The node-local file in which local rank 0 hands the outcome of the checks `what` to the
    node's other workers."""
    env = os.environ
    key = "-".join([process.job_id() or "job", env.get("SLURM_STEP_ID", ""), str(os.getppid()), _parent_start(),
                    str(process.restart_count()), what])
    return Path(tempfile.gettempdir()) / f"{HANDOFF_PREFIX}{key}.json"


def _hand_on(path: Path, error: str | None) -> None:
    temporary = path.with_name(path.name + f".{os.getpid()}.tmp")
    temporary.write_text(json.dumps({"error": error}))
    os.replace(temporary, path)


def once_per_node(what: str, checks: Callable[[], None]) -> None:
    """Run `checks` (a UserError when they fail), named `what`, once for this node's workers (see
    the module docstring); a UserError here too when they failed in local rank 0."""
    if not process.launched_externally() or process.local_workers() == 1:
        checks()
        return
    path = handoff(what)
    if os.environ.get("LOCAL_RANK", "0") == "0":
        try:
            checks()
        except UserError as err:
            _hand_on(path, str(err))
            raise
        except BaseException:
            _hand_on(path, f"{what}: failed on local rank 0 of this node (its traceback says why)")
            raise
        _hand_on(path, None)
        return
    deadline = time.monotonic() + TIMEOUT_S
    while not path.is_file():
        if time.monotonic() >= deadline:
            raise UserError(f"{what}: local rank 0 of this node did not finish them within {TIMEOUT_S:g} s")
        time.sleep(0.1)
    error = json.loads(path.read_text())["error"]
    if error is not None:
        raise UserError(error)
