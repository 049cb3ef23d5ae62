"""What checkpoint checksums cost: seconds per GiB of `titan_async.rundir.checksums.crc32` on a file
of this machine's disk (page cache warm after the first repetition), min/median/max.

    python tools/bench_checksums.py [--mib 1024] [--reps 5] [--dir /path/on/the/checkpoint/disk]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from titan_async.rundir.checksums import crc32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024, help="file size in MiB (default: 1024)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where to write the file (default: the temp directory)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        path = Path(folder) / "data.distcp"
        with open(path, "wb") as handle:
            for _ in range(args.mib):
                handle.write(os.urandom(1 << 20))
        per_gib = []
        for _ in range(args.reps):
            start = time.perf_counter()
            crc32(path)
            per_gib.append((time.perf_counter() - start) * 1024 / args.mib)
    print(f"crc32 of a {args.mib} MiB file, {args.reps} repetitions: "
          f"{min(per_gib):.3f} / {statistics.median(per_gib):.3f} / {max(per_gib):.3f} s per GiB (min / median / max)")


if __name__ == "__main__":
    main()
