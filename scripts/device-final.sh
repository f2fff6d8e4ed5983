#!/usr/bin/env bash
# Runs ON the GPU machine: the end-of-session call on the code that lands (~8 min on the H200, the
# GPU tests ~6 of them: run it alone in a call with timeout_s 600):
# every GPU test, the decode grid of record beside the yardstick of record, and compute-sanitizer
# memcheck and racecheck on one GPU-test step, each in its own time limit. Carry the wheel built
# from that code, .whl/yardstick.py (a copy of shared/tools/yardstick.py) and, for the server's GPU
# test, .whl/server-py312 (scripts/server-wheels.sh).
#   device run:  bash scripts/device-final.sh      (carry: [".whl"])
# Writes $OUT/{gpu-tests.log,grid.log,grid.json,sanitize.log} (at most 8 files come back) and
# prints the tests' summary, the grid's table and the sanitizers' summaries.
set -uo pipefail
source "$(dirname "$0")/device-env.sh"
final=$OUT
status=0
check=$(mktemp -d)
OUT=$check bash scripts/device-check.sh --tests || status=1
cp "$check/tests.log" "$final/gpu-tests.log"
grid=$(mktemp -d)
OUT=$grid bash scripts/device-grid.sh || status=1
cp "$grid/grid.log" "$final/grid.log"
python3 - "$grid" "$final/grid.json" <<'PY'
import glob, json, sys
src, dst = sys.argv[1:]
rows = {"decode": [], "yardstick": []}
for kind in rows:
    for f in sorted(glob.glob(f"{src}/{kind}-*.json")):
        data = json.load(open(f))
        rows[kind] += data["rows"] if isinstance(data, dict) else data
json.dump(rows, open(dst, "w"), indent=1)
PY
sanitize_steps "$final/sanitize.log" 200
grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$final/sanitize.log"
exit $status
