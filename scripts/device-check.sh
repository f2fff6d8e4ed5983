#!/usr/bin/env bash
# Runs ON the GPU machine: builds nothing. Installs the wheels carried
# in .whl/, runs every GPU test and benchmark, writes logs and JSON under $OUT, prints a table last.
#   device run:  bash scripts/device-check.sh [--quick|--tests|--sanitize|--bench]      (carry: [".whl"])
# --quick: the megakernel tests and a two-point decode benchmark only.
# --tests: every GPU test (PART=k/n: a share of the files); --sanitize: compute-sanitizer memcheck and racecheck; --bench: the
# benchmarks. The whole thing no longer fits one 10-minute device call: run them as separate calls.
set -uo pipefail
source "$(dirname "$0")/device-env.sh"
quick=${1:-}

{
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv
    python3 -c 'import torch, mk._native as n; print("torch", torch.__version__, "mk", n.build_info())'
} >"$OUT/env.txt" 2>&1

status=0
# Only the files with GPU tests: the others may import packages this machine lacks (the server's).
mapfile -t gpu_files < <(grep -l "mark.gpu" tests/test_*.py)
# PART=k/n: every n-th of those files from the k-th (the whole set outlasts one device call).
if [ -n "${PART:-}" ]; then
    part=() k=${PART%/*} n=${PART#*/}
    for i in "${!gpu_files[@]}"; do [ $((i % n)) = $((k - 1)) ] && part+=("${gpu_files[$i]}"); done
    gpu_files=("${part[@]}")
fi
# Files that start their own GPU server processes go first: those need the card's memory, and a
# module run before them in this process may still hold some.
[ "${#gpu_files[@]}" -gt 0 ] &&
    mapfile -t gpu_files < <(grep -l ServerProcess "${gpu_files[@]}"; grep -L ServerProcess "${gpu_files[@]}")
tests=(-m gpu "${gpu_files[@]}")
[ "$quick" = --quick ] && tests=(-m gpu tests/test_megakernel_gpu.py)
touch "$OUT/tests.log" "$OUT/bench.log"
if [ "$quick" != --bench ] && [ "$quick" != --sanitize ]; then
    # SIGINT at the limit: pytest stops like a ^C and still prints its summary (what ran and failed).
    timeout -s INT -k 20 530 python3 -m pytest -q -p no:cacheprovider --durations=20 "${tests[@]}" >"$OUT/tests.log" 2>&1 || status=1
fi

sanitize=0
{ [ -z "$quick" ] || [ "$quick" = --sanitize ]; } && sanitize=1
if [ $sanitize = 1 ] || [ "${SANITIZE:-}" = 1 ]; then
    # Steps of every way of running expert tiles and of learning the routing (megakernel_once.py),
    # and the racecheck probe of a plain shared-memory value handed over through an mbarrier (the
    # ring's tags).
    sanitize_steps "$OUT/tests.log" 400
    if nvcc -gencode=arch=compute_90a,code=sm_90a -o /tmp/racecheck-probe scripts/racecheck_probe.cu \
        >>"$OUT/tests.log" 2>&1; then
        timeout 60 compute-sanitizer --tool racecheck --racecheck-report all /tmp/racecheck-probe >>"$OUT/tests.log" 2>&1
        echo "racecheck (mbarrier hand-off probe) exit: $?" >>"$OUT/tests.log"
    fi
fi

benches=(benches/decode.py benches/prefill.py)
[ "$quick" = --quick ] && benches=(benches/decode.py)
{ [ "$quick" = --tests ] || [ "$quick" = --sanitize ]; } && benches=()
for bench in "${benches[@]}"; do
    name=$(basename "$bench" .py)
    args=(--json "$OUT/$name.json")
    [ "$quick" = --quick ] && [ "$name" = decode ] && args+=(--quick)
    python3 "$bench" "${args[@]}" >>"$OUT/bench.log" 2>&1 || { status=1; echo "$bench failed" >>"$OUT/bench.log"; }
done

echo "== tests =="
grep -E "passed|failed|exit:|ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/tests.log" | tail -n 8
grep -E "^FAILED|^ERROR" "$OUT/tests.log" | head -n 20
# Modules that left GPU memory in use after their teardown (tests/conftest.py).
grep -E "left .* GiB of the card in use" "$OUT/tests.log" | head -n 10
# The failures' assertion lines (with the seed a fresh-input test names), in the printed summary:
# tests.log itself may not come back (a call returns at most 8 files).
grep -E "^E  " "$OUT/tests.log" | head -n 20
echo "== benchmarks =="
grep -vE "^\{'" "$OUT/bench.log" | tail -n 60
exit $status
