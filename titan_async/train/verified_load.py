"""Loading a checkpoint with its checksums verified, after the process group is up, by the ranks
that load it: each node reads each file its ranks load once for verification, not once per rank.

DCP plans a load in three steps that `VerifyingReader` extends: each rank lists the files its
reads touch (and .metadata, which every rank reads) with its host name (`prepare_local_plan`);
the coordinator gives each file a node needs to one of that node's ranks that loads it, the rank
with the fewest bytes to verify so far, largest files first, with its recorded CRC-32
(`prepare_global_plan`, `share_out`); each rank verifies its share before it reads
(`read_data`). DCP gathers every rank's failure after the reads, so a mismatch fails the load on
all ranks alike: `verify_loads` turns it into one `AgreedError` naming the file. Only files with a
recorded checksum are verified; the launcher's checks (`titan_async.rundir.checkpoints.damage`)
make sure that a checkpoint it resumes from has one for every file.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import time
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import LoadPlan
from torchtitan.components.checkpointer.base import MODEL

from titan_async.core.errors import AgreedError
from titan_async.rundir import checksums


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
            raise AgreedError(f"checkpoint {checkpoint}: {problem}; nothing was deleted: move {checkpoint.name} "
                              f"out of {checkpoint.parent} to resume from an earlier checkpoint")
        return super().read_data(plan, planner)


def verify_loads(checkpointer) -> None:
    """Have torchtitan's `checkpointer` load DCP checkpoints through `VerifyingReader` (loads of
    Hugging Face weights are left to it); a checksum mismatch on any rank raises the same
    `AgreedError` on every rank."""
    torchtitan_load = checkpointer.dcp_load

    def dcp_load(state_dict, checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        if from_hf:
            return torchtitan_load(state_dict, checkpoint_id, from_hf, from_quantized)
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
