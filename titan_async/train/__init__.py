"""The training loop inside one worker: torchtitan's Trainer extended for the streaming
schedules (`trainer`), and the components it builds from the config: the non-finite gradient
guard (`health`) and what a run shows and records (`progress`: display, metrics.jsonl, validation)."""
