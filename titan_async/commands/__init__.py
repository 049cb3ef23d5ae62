"""The CLI's commands other than train and resume, one module (or package) each: `plan`,
`report`, `compare`, `export`, `evaluate`; `pages` holds the HTML page parts that report and
compare share. A command imports no other command: what two commands need lies in the package
that owns it (the Hugging Face conversion in `model`, run-directory files in `run`).

A new command goes here as one module with one entry function, which `cli.py` registers as a
subcommand and calls.
"""
