"""Loading a checkpoint with its checksums verified, after the process group is up, by the ranks
that load it: each node reads each file its ranks load once for verification, not once per rank.

DCP plans a load in three steps that `VerifyingReader` extends: each rank lists the files its
reads touch (and .metadata, which every rank reads) with its host name (`prepare_local_plan`);
the coordinator gives each file a node needs to one of that node's ranks that loads it, the rank
with the fewest bytes to verify so far, largest files first, with its recorded CRC-32
(`prepare_global_plan`, `share_out`); each rank verifies its share before it reads
(`read_data`). DCP gathers every rank's failure after the reads, so a mismatch fails the load on
all ranks alike, as one `DamagedCheckpoint` naming the file. Only files with a recorded checksum are
verified; the launcher's checks (`titan_async.rundir.checkpoints.damage`) make sure that a
checkpoint it resumes from has one for every file.

A damaged checkpoint of the run does not end it (`load_intact`): once no rank reads it any more,
rank 0 moves it to RUN/damaged_checkpoints/ and picks the latest intact checkpoint before it, which
every rank then loads, all its states (a full load overwrites each state the damaged one may have
partly written: DCP reads into the states' tensors in place and requires every key it loads, and
calls their `load_state_dict` only after a whole read), until a load succeeds; with no earlier
intact checkpoint, the load fails on every rank with one `AgreedError`.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import time
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import LoadPlan
from torchtitan.components.checkpointer.base import MODEL

from titan_async.core.errors import AgreedError, UserError
from titan_async.rundir import checkpoints, checksums
from titan_async.train.checkpoint_state import RNG, RNGState


def share_out(wanted: list[tuple[str, list[str]]], sizes: dict[str, int]) -> list[list[str]]:
    """Which files each rank verifies, given each rank's (host, files it loads) in rank order and
    the files' sizes: every file a host's ranks load goes to exactly one of them that loads it,
    the one with the fewest bytes so far (ties: the lowest rank), largest files first."""
    shares: list[list[str]] = [[] for _ in wanted]
    load = [0] * len(wanted)
    hosts: dict[str, list[int]] = {}
    for rank, (host, _) in enumerate(wanted):
        hosts.setdefault(host, []).append(rank)
    for ranks in hosts.values():
        files = {name for rank in ranks for name in wanted[rank][1]}
        for name in sorted(files, key=lambda name: (-sizes.get(name, 0), name)):
            rank = min((rank for rank in ranks if name in wanted[rank][1]), key=lambda rank: (load[rank], rank))
            shares[rank].append(name)
            load[rank] += sizes.get(name, 0)
    return shares


class DamagedCheckpoint(AgreedError):
    """A file of `checkpoint` that does not match its recorded checksum (`problem`), found by a load."""

    def __init__(self, checkpoint: str, problem: str) -> None:
        super().__init__(checkpoint, problem)  # the arguments, as pickle remakes it (DCP gathers failures)
        self.checkpoint, self.problem = Path(checkpoint), problem

    def __str__(self) -> str:
        return f"checkpoint {self.checkpoint}: {self.problem}; nothing was deleted"


class VerifyingReader(FileSystemReader):
    """DCP's FileSystemReader that verifies each rank's share of the checksums before it reads
    (see the module docstring)."""

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        files = {".metadata"} | {self.storage_data[item.storage_index].relative_path for item in plan.items}
        return dataclasses.replace(super().prepare_local_plan(plan), storage_data=(socket.gethostname(), sorted(files)))

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        checkpoint = Path(self.path)
        recorded = checksums.recorded(checkpoint)
        sizes = {path.name: path.stat().st_size for path in checkpoint.iterdir() if path.is_file()}
        shares = share_out([plan.storage_data for plan in plans], sizes)
        plans = [dataclasses.replace(plan, storage_data={name: recorded[name] for name in share if name in recorded})
                 for plan, share in zip(plans, shares)]
        return super().prepare_global_plan(plans)

    def read_data(self, plan: LoadPlan, planner):
        checkpoint = Path(self.path)
        start = time.perf_counter()
        problem, read = checksums.mismatch(checkpoint, plan.storage_data)
        logging.getLogger("titan_async").info(
            f"checksummed {len(plan.storage_data)} files ({read} bytes) of {checkpoint} in {time.perf_counter() - start:.2f} s")
        if problem is not None:
            raise DamagedCheckpoint(str(checkpoint), problem)
        return super().read_data(plan, planner)


def verify_loads(checkpointer) -> None:
    """Have torchtitan's `checkpointer` load DCP checkpoints through `VerifyingReader` (loads of
    Hugging Face weights are left to it), falling back from damaged ones (`load_intact`)."""
    torchtitan_load = checkpointer.dcp_load

    def dcp_load(state_dict, checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        if from_hf:
            return torchtitan_load(state_dict, checkpoint_id, from_hf, from_quantized)
        state_dict = without_absent_rng_state(state_dict, checkpoint_id)
        try:
            dcp.load(state_dict, storage_reader=VerifyingReader(checkpoint_id))
        except CheckpointException as failure:
            agreed = [error for error, _ in failure.failures.values() if isinstance(error, AgreedError)]
            if agreed:
                raise agreed[0] from None
            raise
        if MODEL in checkpointer.states:  # as torchtitan's dcp_load: the model's states are flattened into state_dict
            checkpointer.states[MODEL].load_state_dict(state_dict)

    checkpointer.dcp_load = dcp_load
    load_intact(checkpointer)


def without_absent_rng_state(state_dict: dict, checkpoint_id: str) -> dict:
    """`state_dict` without this rank's RNG states when the checkpoint has none for it (saved by
    fewer processes): that rank keeps the RNG states it was seeded with."""
    rng = state_dict.get(RNG)
    if not isinstance(rng, RNGState) or rng.saved_in(FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata, RNG):
        return state_dict
    logging.getLogger("titan_async").warning(f"{checkpoint_id} holds no RNG states for {rng.key} (saved by fewer processes); it keeps its seeded ones")
    return {key: value for key, value in state_dict.items() if key != RNG}


def load_intact(checkpointer) -> None:
    """Make `checkpointer.load(step)` load the latest intact checkpoint from `step` down: a damaged
    one (`DamagedCheckpoint`, on every rank alike) of the run's checkpoint folder is moved aside
    and the load retried from the step rank 0 picks (`_fallback`)."""
    load = checkpointer.load

    def load_falling_back(step: int = -1) -> bool:
        while True:
            try:
                return load(step)
            except DamagedCheckpoint as damaged:
                if damaged.checkpoint.parent.resolve() != Path(checkpointer.folder).resolve():
                    raise  # not one of the run's checkpoints (`checkpoint.initial_load_path`): left where it is
                step = _fallback(damaged.checkpoint, damaged.problem)

    checkpointer.load = load_falling_back


def _fallback(checkpoint: Path, problem: str) -> int:
    """The step every rank loads instead of the damaged `checkpoint`: after every rank has stopped
    reading it, rank 0 moves it aside (`checkpoints.quarantine`), picks the latest intact
    checkpoint before it with the cheap checks and warns in one line; AgreedError on every rank
    when there is none (a step-0 checkpoint holds the model only: no fallback for the other states)."""
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    if distributed:
        dist.barrier()
    choice: list[int | str | None] = [None]
    if not distributed or dist.get_rank() == 0:
        choice = [_rank0s_fallback(checkpoint, problem)]
    if distributed:
        dist.broadcast_object_list(choice, src=0)
    if isinstance(choice[0], str):
        raise AgreedError(choice[0])
    return choice[0]


def _rank0s_fallback(checkpoint: Path, problem: str) -> int | str:
    """Rank 0's part of `_fallback`: the step to load, or the one-line reason there is none."""
    run_dir, step = checkpoint.parent.parent, int(checkpoint.name.removeprefix("step-"))
    moved = checkpoints.quarantine(checkpoint)
    skipped: list[str] = []
    try:
        point = checkpoints.resume_point(run_dir, skipped.append, before=step)
    except UserError:  # every earlier one is damaged too
        point = None
    if point is None or point[0] == 0:
        return (f"no intact checkpoint to resume from: {checkpoint} is damaged ({problem}), and no earlier one is intact; "
                f"{checkpoints.quarantined_note(run_dir)}; nothing was deleted")
    log = logging.getLogger("titan_async")
    log.warning(f"checkpoint {checkpoint} is damaged ({problem}); moved to {moved}; resuming from {point[1].name} "
                f"(its later steps train again)")
    for line in skipped:
        log.warning(line)
    return point[0]

