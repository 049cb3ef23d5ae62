"""`python -m titan_async.native.train ARGS`: torchtitan's entry point (`python -m torchtitan.train
ARGS`) after titan-async has chosen the device, which on a machine without CUDA must happen before
torchtitan is imported (torchtitan caches the device type at import)."""

from __future__ import annotations

import runpy

from titan_async.core import platform


def main() -> None:
    platform.configure()
    runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
