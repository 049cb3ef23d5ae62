"""The project's cross-stream hand-offs on a real GPU, where the order is the hardware's and not
the CPU stream model's: each value is written on the compute stream behind `torch.cuda._sleep`
(so the compute stream is still busy when the next call is issued) and must be read back as
written. `LateAllReduce` runs on an NCCL group of one (one GPU cannot host two NCCL ranks);
beside it, the order the stream model caught (the side stream waiting on itself) is run the same
way: on a GPU it may read the value before it is written, which this script reports but does not
fail on (whether it shows depends on timing).

    python tools/gpu/stream_checks.py [--out FILE]

Prints one line per check; exit status 1 when a check of the project's code reads a wrong value.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.distributed as dist

SLEEP_CYCLES = 200_000_000
"""About 0.1 s of GPU time: longer than the host takes to issue and read."""


def busy_write(value: torch.Tensor, fill: float) -> None:
    """`value.fill_(fill)` on the compute stream, queued behind ~0.1 s of GPU work."""
    torch.cuda._sleep(SLEEP_CYCLES)
    value.fill_(fill)


def late_all_reduce(step: int) -> list[float]:
    from titan_async.train.late_read import LateAllReduce

    value = torch.zeros(4, device="cuda")
    busy_write(value, step)
    return LateAllReduce(value, dist.ReduceOp.MAX).read()


def self_waiting_side_stream(step: int) -> list[float]:
    """The order before the fix: the side stream's wait written inside its own context."""
    value = torch.zeros(4, device="cuda")
    busy_write(value, step)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        side.wait_stream(torch.cuda.current_stream())  # the side stream itself
        work = dist.all_reduce(value, op=dist.ReduceOp.MAX, async_op=True)
        work.wait()
        host = value.to("cpu", non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
    copied.synchronize()
    return host.tolist()


def late_read(step: int) -> list[float]:
    from titan_async.train.late_read import LateRead

    value = torch.zeros(4, device="cuda")
    busy_write(value, step)
    return LateRead(value).read()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("stream_checks: needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
    results, failed = {}, False
    for check, must_hold in ((late_all_reduce, True), (late_read, True), (self_waiting_side_stream, False)):
        wrong = [step for step in range(1, 6) if check(step) != [float(step)] * 4]
        results[check.__name__] = {"wrong_reads": wrong}
        failed |= must_hold and bool(wrong)
        print(f"{check.__name__}: {len(wrong)} of 5 reads wrong{'' if must_hold else ' (the order before the fix)'}", flush=True)
    dist.destroy_process_group()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
