"""`titan-async plan`: will a config's parallel layout fit its GPUs, and how big is its bubble?

Needs no GPU, data or tokenizer. The model is built on the meta device with the config's
vocabulary size and split into pipeline stages as torchtitan's pipeline builder splits it;
each pipeline rank's memory is estimated by the cluster model (`titan_async.cluster`: `estimate`,
from the arithmetic in `memory`), which plan renders. A dry
run (`dry_run`) then sets up the real world size with torch's fake process group (what
torchtitan's `comm.mode = "fake_backend"` uses), one inspected rank at a time, and builds that
rank's stage, FSDP2 wrapping, optimizer state and weight versions on the meta device, and its
action list; the bytes those meta tensors stand for are compared with the estimate. `command`
puts both into one JSON-ready plan, which `render` prints; with `--simulate`, the cluster model's
`simulate` adds each schedule's simulated step time, tokens/s and bubble
(`titan_async.pipeline.simulation`), and with `--gpu-counts` its `advise` ranks them.

The layout is the one `train` would build (`titan_async.config.assemble`): FSDP2 wraps
every stage except the streaming schedules' stages without data parallelism; replicas
(DDP, HSDP) hold their FSDP group's shards and add one all-reduce per gradient reduction;
with gradient accumulation (K local batches per step) a streaming window holds K x m
microbatches, while torch's schedules flush K times per step. Mixture-of-experts models
(qwen3_moe) are planned on the layouts the streaming schedules run them on, experts sharded by
FSDP (no expert or tensor parallelism: refused in one line). Whatever `train` would refuse
about the config is reported as a warning.
"""
