"""A run directory and its files: the layout (`directory`), its lock (`lock`), replacing a run
without losing it (`overwrite`), checkpoint integrity (`checkpoints`, `checksums`) and what each
rank does after each save (`after_save`), what a run recorded (`record`), the JSON-lines files
it appends to (`jsonl`) and the benchmark results of its checkpoints (`benchmarks`). The ground
floor: it imports only `titan_async.core`."""
