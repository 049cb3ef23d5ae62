"""The CLI's commands other than train and resume, one module (or package) each: `plan`,
`report`, `compare`, `export`, `evaluate`; `pages` holds the HTML page parts that report and
compare share. A command imports no other command.

A new command goes here as one module with one entry function, which `cli.py` registers as a
subcommand and calls.
"""
