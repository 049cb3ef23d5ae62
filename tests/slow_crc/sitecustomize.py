"""Slow checkpoint checksums, for tests: a process started with this folder on PYTHONPATH imports
this module at start-up, and every CRC-32 chunk that titan_async.rundir.checksums computes then
sleeps TITAN_ASYNC_TEST_CRC_DELAY seconds first (its forked workers inherit the change). It needs
no hook in titan-async itself, so it slows older versions alike."""

import os
import sys
import time
import zlib

_crc32 = zlib.crc32
_DELAY = float(os.environ.get("TITAN_ASYNC_TEST_CRC_DELAY", "0"))
_CHECKSUMS = os.path.join("titan_async", "rundir", "checksums.py")


def _slow_crc32(data, value=0):
    if sys._getframe(1).f_code.co_filename.endswith(_CHECKSUMS):
        time.sleep(_DELAY)
    return _crc32(data, value)


zlib.crc32 = _slow_crc32
