"""A run as processes: what this process is within its job (`process`), starting the workers
(`launch`) and one worker's life (`worker`, which builds the trainer). The top of the package:
nothing below imports it, except for `process`'s facts about the job."""
