"""A run as processes and files: what this process is within its job (`process`), starting the
workers (`launch`), one worker's life (`worker`), the run directory and its files (`directory`),
its lock (`lock`), replacing a run without losing it (`overwrite`), checkpoint integrity
(`checkpoints`, `checksums`) and what rank 0 does after each save (`after_save`), what a run
directory recorded (`record`), benchmark results of its checkpoints (`benchmarks`) and the
per-rank communication log (`comm_log`)."""
