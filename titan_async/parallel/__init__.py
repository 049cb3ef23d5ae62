"""How the parameters of a streaming pipeline stage are spread over the ranks that share it,
and what that costs in collectives: FSDP2 driven by the weight policies (`fsdp_stage`) and
FSDP2's all-gather and reduce-scatter bytes counted where they are issued (`fsdp_traffic`).

A new parallel layout of the streaming stages (replicas, tensor or expert parallelism) goes
here as one module that wraps a stage; `pipeline/config.py` says which layouts a schedule
accepts, and `cluster/` estimates their memory and traffic.
"""
