"""The project's cross-stream hand-offs, run under the stream model (titan_async.core.stream_model)
on one gloo process: `stream_model_checks.py CHECK...` runs each named check and prints one line
per check, `CHECK ok` or `CHECK StreamRace: stream race: ...` (a race the model reported, naming both sides) or
`CHECK wrong: ...` (a value that is not the one written). Exit status 0 when every check is ok.

Checks, each the pattern a training step uses:
- late_all_reduce: the stop agreement and the lagged norms (`LateAllReduce`): a value written on
  the compute stream, all-reduced on a side stream, more compute queued, read a step later;
- late_read: the health flags (`LateRead`): a value copied to a pinned buffer, read after the copy's event;
- to_device: batches through pinned memory (`to_device`), each buffer freed after its copy;
- read_now: the logged loss (`read_now`), a device value the host waits for;
- self_waiting_side_stream (not run unless named): the stop agreement in the order the model found
  (the side stream's wait written inside its own context), the model reporting without stopping,
  so that its comm log ($TITAN_ASYNC_COMM_LOG) can be replayed.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from titan_async.core import comm_log, stream_model, streams


def late_all_reduce() -> None:
    from titan_async.train.late_read import LateAllReduce

    for step in range(3):
        code = torch.zeros(4)
        code.fill_(step + 1)  # written on the compute stream
        agreement = LateAllReduce(code, dist.ReduceOp.MAX)
        torch.ones(64, 64) @ torch.ones(64, 64)  # the step's compute, queued after the all-reduce
        assert agreement.read() == [step + 1.0] * 4, "wrong: the reduced value"


def late_read() -> None:
    from titan_async.train.late_read import LateRead

    for step in range(3):
        flags = torch.zeros(3)
        flags.add_(step)
        reading = LateRead(flags)
        flags.add_(100)  # written again after the copy was queued: the read must see the copy
        assert reading.read() == [float(step)] * 3, "wrong: the value read is not the one copied"


def to_device() -> None:
    backend = streams.for_device(torch.device("cpu"))
    total = 0.0
    for step in range(4):
        batch = backend.to_device(torch.full((8,), float(step)), torch.device("cpu"))
        total += float(batch.sum())
    assert total == 8 * (0 + 1 + 2 + 3), "wrong: the batches' values"


def read_now() -> None:
    backend = streams.for_device(torch.device("cpu"))
    loss = torch.ones(3) * 2
    assert backend.read_now(loss) == [2.0] * 3, "wrong: the value read"


def self_waiting_side_stream() -> None:
    model, backend = stream_model.MODEL, streams.for_device(torch.device("cpu"))
    model.raise_on_race = False
    side = backend.new_stream("side stream")
    for step in range(2):
        code = torch.zeros(4)
        code.fill_(step + 1)
        with comm_log.on_side_stream(backend.use(side)):
            side.wait_stream(backend.current())  # the side stream itself
            work = dist.all_reduce(code, op=dist.ReduceOp.MAX, async_op=True)
            work.wait()
    model.raise_on_race = True
    if model.races:
        raise stream_model.StreamRace(f"stream race: {model.races[0]}")


CHECKS = {check.__name__: check for check in (late_all_reduce, late_read, to_device, read_now)}
OTHER_CHECKS = {self_waiting_side_stream.__name__: self_waiting_side_stream}


def main(names: list[str]) -> int:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    comm_log.install_from_environment()
    model = stream_model.enable(raise_on_race=True)
    failed = 0
    for name in names:
        try:
            {**CHECKS, **OTHER_CHECKS}[name]()
            print(f"{name} ok", flush=True)
        except stream_model.StreamRace as race:
            failed += 1
            print(f"{name} StreamRace: {race}", flush=True)
        except AssertionError as wrong:
            failed += 1
            print(f"{name} {wrong}", flush=True)
        model.races.clear()
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or list(CHECKS)))
