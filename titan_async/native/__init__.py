"""titan-async inside torchtitan's own entry point: `python -m torchtitan.train --module
titan_async.native --config pipedream_2bw` (on the CPU through `python -m titan_async.native.train`,
which selects the CPU before torchtitan is imported). `config_registry` holds the config functions.
"""
