"""Whether the token loader keeps up with training, and whether its memory grows with the data.

1. Writes two synthetic data sets in `titan-async prepare`'s layout (random token ids, documents of
   random lengths): a small one and one --scale times larger.
2. Tokens/s of the loader (`data.source = "tokens"`, one data rank, the default config's seq_len
   and local batch size) over the small one, min/median/max over --reps repetitions of --batches
   batches each.
3. Tokens/s the default model consumes: `titan-async train` of the default config for --steps
   steps, the median of its logged throughput(tps) past the first step; the ratio of the two.
4. For each data set, in a fresh process: open it, resume the loader near its end (the cursor
   scans every document length) and read --batches batches; that process's peak RSS, and its
   anonymous and file-backed resident memory at the end (memory-mapped data counts as file-backed).

    python tools/loader_throughput.py [--reps 5] [--batches 200] [--steps 6] [--scale 10]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
SEQ_LEN, LOCAL_BATCH, VOCAB = 256, 8, 2048
"""The default config's (train_configs/debug_cpu.toml)."""
SMALL_DOCUMENTS = 200_000
"""About 60M tokens."""


def write_synthetic(out: Path, documents: int, seed: int = 0) -> int:
    """A prepared directory of `documents` random documents in one shard; returns its token count."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(20, 600, size=documents, dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "shard-00000.tokens", "wb") as f:
        for start in range(0, documents, 100_000):
            chunk = int(lengths[start : start + 100_000].sum())
            f.write(rng.integers(0, VOCAB, size=chunk, dtype=np.uint16).tobytes())
    offsets.tofile(out / "shard-00000.docs")
    shard = {"tokens": "shard-00000.tokens", "docs": "shard-00000.docs", "token_count": int(offsets[-1]),
             "document_count": documents, "max_token_id": VOCAB - 1, "sha256": ""}
    (out / "manifest.json").write_text(json.dumps({"format_version": 1, "dtype": "uint16", "vocab_size": VOCAB,
                                                  "tokenizer_sha256": None, "text_field": "text", "shards": [shard]}))
    return int(offsets[-1])


def build_loader(path: Path):
    from titan_async.data.token_loader import TokenDataLoader

    config = TokenDataLoader.Config(sources=[str(path)], source_keys=["data.path"])
    return config.build(dp_world_size=1, dp_rank=0, tokenizer=None, seq_len=SEQ_LEN, local_batch_size=LOCAL_BATCH)


def loader_tokens_per_second(path: Path, batches: int) -> float:
    batches_iter = iter(build_loader(path))
    start = time.perf_counter()
    for _ in range(batches):
        next(batches_iter)
    return batches * LOCAL_BATCH * SEQ_LEN / (time.perf_counter() - start)


def model_tokens_per_second(steps: int, scratch: Path) -> float:
    run_dir = scratch / "run"
    subprocess.run([sys.executable, "-m", "titan_async.cli", "train", "--run-dir", str(run_dir),
                    "--set", f"training.steps={steps}", "--set", "validation.enable=false", "--set", "checkpoint.enable=false"],
                   cwd=REPO, check=True, capture_output=True)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    tps = [row["throughput(tps)"] for row in rows if row["kind"] == "train" and row.get("throughput(tps)")]
    return statistics.median(tps[1:] or tps)


def memory_probe(path: str, batches: int) -> None:
    """(In a fresh process) resume near the end of `path`, read `batches` batches, print memory as JSON."""
    loader = build_loader(Path(path))
    windows = len(loader.dataset._sources[0])
    start = max(0, windows - 2 * batches * LOCAL_BATCH)
    loader.dataset.load_state_dict({"sample": start, "step": 0, "stage": 0, "stage_counts": [start], "positions": [start]})
    batches_iter = iter(loader)
    for _ in range(batches):
        next(batches_iter)
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    kib = {key: int(status[key].split()[0]) for key in ("RssAnon", "RssFile")}
    print(json.dumps({"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "anon_mib": kib["RssAnon"] / 1024, "file_mib": kib["RssFile"] / 1024}))


def measure_memory(path: Path, batches: int) -> dict:
    result = subprocess.run([sys.executable, __file__, "--probe", str(path), "--batches", str(batches)],
                            cwd=REPO, check=True, capture_output=True, text=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--scale", type=int, default=10)
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        memory_probe(args.probe, args.batches)
        return
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        sizes = {"small": write_synthetic(scratch / "small", SMALL_DOCUMENTS),
                 f"{args.scale}x": write_synthetic(scratch / "large", SMALL_DOCUMENTS * args.scale, seed=1)}
        rates = [loader_tokens_per_second(scratch / "small", args.batches) for _ in range(args.reps)]
        print(f"loader tokens/s (seq_len {SEQ_LEN}, batch {LOCAL_BATCH}, {args.reps} x {args.batches} batches): "
              f"min {min(rates):,.0f}  median {statistics.median(rates):,.0f}  max {max(rates):,.0f}")
        model = model_tokens_per_second(args.steps, scratch)
        print(f"default model tokens/s (debug_cpu, median of steps 2-{args.steps}): {model:,.0f}")
        print(f"loader / model: {statistics.median(rates) / model:,.0f}x")
        for (name, tokens), folder in zip(sizes.items(), ("small", "large")):
            memory = measure_memory(scratch / folder, args.batches)
            print(f"{name} data set ({tokens / 1e6:,.0f}M tokens): peak RSS {memory['peak_rss_mib']:,.0f} MiB, "
                  f"anonymous {memory['anon_mib']:,.0f} MiB, file-backed {memory['file_mib']:,.0f} MiB")


if __name__ == "__main__":
    main()
