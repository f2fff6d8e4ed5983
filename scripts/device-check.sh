#!/usr/bin/env bash
# Runs ON the GPU machine (see shared/design/GPU.md): builds nothing. Installs the wheels carried
# in .whl/, runs every GPU test and benchmark, writes logs and JSON under $OUT, prints a table last.
#   device run:  bash scripts/device-check.sh        (carry: [".whl"])
set -uo pipefail
OUT=${OUT:-$PWD/bench-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site
# Tests import mk from the installed wheel, never from python/ (that copy has no compiled module).
cd "$(dirname "$0")/.."

{
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv
    python3 -c 'import torch, mk._native as n; print("torch", torch.__version__, "mk", n.build_info())'
} 2>&1 | tee "$OUT/env.txt"

status=0
python3 -m pytest -m gpu -q -p no:cacheprovider --junitxml="$OUT/gpu-tests.xml" 2>&1 | tee "$OUT/gpu-tests.log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1

if command -v compute-sanitizer >/dev/null; then
    timeout 300 compute-sanitizer --tool memcheck --error-exitcode 3 \
        python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_ops.py -k "matches and 2048" \
        >"$OUT/memcheck.log" 2>&1
    echo "memcheck exit: $?" | tee -a "$OUT/memcheck.log"
fi

for bench in benches/norm.py benches/gemv.py; do
    name=$(basename "$bench" .py)
    python3 "$bench" --json "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
done

echo
echo "== summary =="
tail -n 1 "$OUT/gpu-tests.log"
tail -n 1 "$OUT/memcheck.log" 2>/dev/null
for f in "$OUT"/*.log; do case "$f" in *gpu-tests.log|*memcheck.log) ;; *) sed -n '/^$/,$p' "$f";; esac; done
exit $status
