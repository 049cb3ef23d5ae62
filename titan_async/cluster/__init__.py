"""A model of a cluster running a config: the GPUs a plan is for (`cluster`), each rank's memory
(`estimate`, from the arithmetic in `memory` and `schedule_memory`), whether a launch fits the
memory each rank has (`fits`: the launcher's check), each schedule's simulated step time and
traffic (`simulate`), the stage split that evens out the ranks' work (`balance`), and the
advisor's search over GPU counts (`advise`). `train`, `resume` and `eval` check launches with
it, and `plan` (`titan_async.commands.plan`) renders it; it imports no command."""
