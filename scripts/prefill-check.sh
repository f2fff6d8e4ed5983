#!/usr/bin/env bash
# Runs ON the GPU machine: the prefill GPU tests and the prefill benchmark, nothing else (the
# whole suite is scripts/device-check.sh). Installs the wheels carried in .whl/ (build them here
# first: `maturin build --release -o .whl`; tests import mk from the wheel), writes logs and JSON
# under $OUT, prints a summary last. Fits one 10-minute device call.
#   device run:  bash scripts/prefill-check.sh      (carry: [".whl"])
set -uo pipefail
source "$(dirname "$0")/device-env.sh"
python3 -c 'import mk.prefill.packed' || { echo "the wheel has no mk.prefill.packed: rebuild it"; exit 1; }

status=0
timeout 330 python3 -m pytest -q -p no:cacheprovider -rA -s -m gpu tests/test_prefill_gpu.py \
    >"$OUT/prefill-tests.log" 2>&1 || status=1
timeout 240 python3 benches/prefill.py --json "$OUT/prefill.json" >"$OUT/prefill-bench.log" 2>&1 \
    || { rc=$?; status=1; echo "benchmark failed (exit $rc)" >>"$OUT/prefill-bench.log"; }

echo "== prefill tests =="
grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/prefill-tests.log" | tail -n 20
grep -E "seed [0-9]+: (real geometry|32K)" "$OUT/prefill-tests.log" | cut -c1-400
grep -iE "warn.*(compil|flex)" "$OUT/prefill-tests.log" "$OUT/prefill-bench.log" | sort -u | head -n 5
echo "== prefill benchmark =="
grep -vE "^\{'" "$OUT/prefill-bench.log" | tail -n 30
exit $status
