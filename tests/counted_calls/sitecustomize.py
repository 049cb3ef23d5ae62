"""Counted calls, for tests: a process started with this folder on PYTHONPATH imports this module at
start-up, and every call of a function of COUNTED (wrapped once its module is imported) then
appends a line "RANK MODULE.FUNCTION" to the file TITAN_ASYNC_TEST_CALLS. It needs no hook in
titan-async itself, so it counts older versions alike."""

import functools
import importlib.abc
import importlib.machinery
import os
import sys

COUNTED = {
    "titan_async.cluster.fits": ("check_fits",),  # plan's memory estimate of the launch check
    "titan_async.config.assemble": ("trainer_config",),  # the trainer config: a launch check, and each worker's build
    "titan_async.rundir.checkpoints": ("resume_point",),  # resume's scan of the checkpoints (metadata reads)
}


def _counted(module: str, function):
    @functools.wraps(function)
    def counted(*args, **kwargs):
        with open(os.environ["TITAN_ASYNC_TEST_CALLS"], "a") as calls:
            calls.write(f"{os.environ.get('RANK', '-')} {module}.{function.__name__}\n")
        return function(*args, **kwargs)

    return counted


class _CountingFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in COUNTED:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None:
            return None
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            for function in COUNTED[name]:
                setattr(module, function, _counted(name, getattr(module, function)))

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("TITAN_ASYNC_TEST_CALLS"):
    sys.meta_path.insert(0, _CountingFinder())
