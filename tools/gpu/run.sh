#!/usr/bin/env bash
# The GPU checklist on a machine with one CUDA GPU, run from the repository root:
#
#   bash tools/gpu/run.sh [probe] [fork] [ns] [tests] [streams] [split] [1b] [deep]   (no argument: probe fork tests streams split)
#
# probe: GPU, Python and package versions; fork: two workers started as the launcher starts them
# (after its config checks, float8's included) select cuda:0 and allocate (tools/gpu/fork_start.py);
# ns: Muon's Newton-Schulz times for the 10B shapes; tests: tests/test_cuda.py and the CUDA cases of
# tests/test_pipeline_references.py; streams: the stream hand-offs behind GPU work on an NCCL group of one
# (tools/gpu/stream_checks.py) and the CUDA tests under torch's CUDA sanitizer (TORCH_CUDA_SANITIZER=1); split: what a zero-bubble split backward costs for one 10B block,
# bf16 and float8, eager and compiled (tools/gpu/bench_split_backward.py); 1b: tokens/s and memory of the 1B config, bf16 against float8;
# deep: tools/bench_schedules.py on the CPU (CUDA hidden) at DEEP_ARGS (default p = 4, m = 8),
# threads per rank = the cores it may use / ranks, so `taskset -c 8-15 bash tools/gpu/run.sh deep`
# runs beside the GPU parts on the other half of the cores.
# Packages the machine lacks are installed from the wheels in .whl/ (see docs/results/gpu/README.md)
# into /tmp/site; tools/gpu/shim supplies the torch 2.15 names torchtitan 0.3.0 imports when the
# machine's torch is older. Results and logs go to $OUT (default: docs/results/gpu/raw).
# Environment: TESTS (pytest arguments, default the CUDA tests above), PYTEST_WORKERS (default 5), TESTS_TIMEOUT (default 420 s),
# BENCH_1B_ARGS (extra arguments of bench_1b.py), CALL_LIMIT (seconds this script may take in all:
# the tests and the 1B runs are cut to fit, and no 1B variant starts with less than MIN_1B_S, default
# 150 s, left), MIN_SPLIT_S (no split variant starts with less left, default 60 s).
set -o pipefail
OUT=${OUT:-docs/results/gpu/raw}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null && [ ! -e /tmp/site/.installed ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    touch /tmp/site/.installed
fi
export PYTHONPATH=.:/tmp/site:tools/gpu/shim PYTHONUNBUFFERED=1
LIMIT=${CALL_LIMIT:-100000}
left() { echo $(( LIMIT - SECONDS - 10 )); }

probe() {
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
    python3 --version
    python3 - <<'EOF'
import importlib.metadata as md
import torch
import torchao, torchtitan, titan_async  # noqa: F401
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(), torch.cuda.get_device_capability())
for name in ("torchao", "torchtitan", "triton", "transformers", "datasets", "tokenizers", "huggingface_hub", "fsspec", "pytest", "pytest-xdist"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "missing")
import torch.distributed as dist
print("torch.distributed.set_timeout is", dist.set_timeout.__qualname__)
EOF
}

fork() {
    timeout 300 python3 tools/gpu/fork_start.py 2>&1 | tee "$OUT/fork_start.txt"
}

ns() {
    timeout 240 python3 tools/gpu/bench_newton_schulz.py --config train_configs/10b_2bw_muon.toml --float32-reps 5 --out "$OUT/ns_10b.json"
}

tests() {
    local cap=${TESTS_TIMEOUT:-420}
    timeout $(( $(left) < cap ? $(left) : cap )) python3 -m pytest -v -rs -p no:cacheprovider --durations=0 -n "${PYTEST_WORKERS:-5}" ${TESTS:-tests/test_cuda.py tests/test_pipeline_references.py::test_emulation_under_fsdp_on_cuda_follows_the_rules} 2>&1 | tee "$OUT/tests.txt"
}

streams() {
    timeout 120 python3 tools/gpu/stream_checks.py --out "$OUT/stream_checks.json" 2>&1 | tee "$OUT/stream_checks.txt" || return 1
    TORCH_CUDA_SANITIZER=1 timeout $(( $(left) < 300 ? $(left) : 300 )) python3 -m pytest -q -rs -p no:cacheprovider -n 0 \
        tests/test_cuda.py 2>&1 | tee "$OUT/tests_cuda_sanitizer.txt"
}

split() {
    timeout "$(left)" python3 tools/gpu/bench_split_backward.py --config train_configs/10b_2bw_muon.toml \
        --deadline $(( $(left) - ${MIN_SPLIT_S:-60} )) --out "$OUT/split_backward.json" 2>&1 | tee "$OUT/split_backward.txt"
}

bench_1b() {
    local seconds=$(left)
    timeout "$seconds" python3 tools/gpu/bench_1b.py --out "$OUT" --deadline $(( seconds - ${MIN_1B_S:-150} )) $BENCH_1B_ARGS
}

deep() {
    CUDA_VISIBLE_DEVICES= timeout "$(left)" python3 tools/bench_schedules.py --out "$OUT" \
        ${DEEP_ARGS:---stages 4 --microbatches 8 --layers 15 --reps 3 --steps 12 --warmup 3 --schedules 1F1B,Interleaved1F1B,ZBVZeroBubble,PipeDream2BW,PACI}
}

status=0
for step in "${@:-probe fork tests streams split}"; do
    for part in $step; do
        echo "=== $part ($(date +%T))"
        case $part in
            probe) probe ;;
            fork) fork ;;
            ns) ns ;;
            tests) tests ;;
            streams) streams ;;
            split) split ;;
            1b) bench_1b ;;
            deep) deep ;;
            *) echo "unknown part: $part"; exit 2 ;;
        esac || status=1
    done
done
exit $status
