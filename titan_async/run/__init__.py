"""A run as processes and files: what this process is within its job (`process`), starting the
workers (`launch`), one worker's life (`worker`), the run directory and its files (`directory`),
its lock (`lock`), which checkpoint to resume from (`checkpoints`), what a run directory
recorded (`record`) and the per-rank communication log (`comm_log`)."""
