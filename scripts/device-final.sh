#!/usr/bin/env bash
# Runs ON the GPU machine: a run of record on the code that lands, in three calls that each fit
# one 10-minute device call:
#   tests 1/2, tests 2/2: every GPU test, in two calls (each half of the files);
#   grid:  the decode grid of record beside the yardstick of record, compute-sanitizer memcheck and
#          racecheck on the GPU-test steps (each within its own limit), and benches/engine.py's rows
#          (ENGINE=0 skips them).
# Carry the wheel built from that code, .whl/yardstick.py (the yardstick of record; docs/PERF.md,
# "Method") and, for the server's GPU tests, .whl/server-py312 (scripts/server-wheels.sh).
#   device run:  bash scripts/device-final.sh tests 1/2, then tests 2/2, then grid
#   (carry: [".whl"], timeout_s 600; send each next call at once, while the machine is warm)
# Writes $OUT/gpu-tests.log, or $OUT/{grid.log,grid.json,sanitize.log,engine.log,engine.json}
# (at most 8 files come back), and prints the tests' summary, or the grid's table, the sanitizers'
# summaries and the engine's tables.
# After the calls, record the run here, on the files that came back (the results of record:
# benches/results/<card>.json and the table of README.md and docs/PERF.md):
#   python scripts/record_results.py --commit <sha of that code> --date <day> grid.json engine.json
set -uo pipefail
source "$(dirname "$0")/device-env.sh"
final=$OUT
status=0
case ${1:-} in
tests)
    check=$(mktemp -d)
    OUT=$check PART=${2:-1/1} bash scripts/device-check.sh --tests || status=1
    cp "$check/tests.log" "$final/gpu-tests.log"
    ;;
grid)
    grid=$(mktemp -d)
    OUT=$grid bash scripts/device-grid.sh || status=1
    cp "$grid/grid.log" "$final/grid.log"
    python3 - "$grid" "$final/grid.json" <<'PY'
import glob, json, sys
src, dst = sys.argv[1:]
rows = {"decode": [], "yardstick": []}
card = {}  # the card the decode rows ran on and the bandwidth of their speed of light
for kind in rows:
    for f in sorted(glob.glob(f"{src}/{kind}-*.json")):
        data = json.load(open(f))  # a bench's record ({"rows": [...]}) or the yardstick's list of lines
        if isinstance(data, dict):
            card.update({k: data[k] for k in ("device", "sol_card", "sol_bytes_per_s") if k in data})
        rows[kind] += data["rows"] if isinstance(data, dict) else data
# Points that did not fit the card stay as they are: rows with "skipped" (the reason) and no timing.
json.dump({**card, **rows}, open(dst, "w"), indent=1)
PY
    sanitize_steps "$final/sanitize.log" 120
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$final/sanitize.log"
    if [ "${ENGINE:-1}" = 1 ]; then
        timeout 200 python3 benches/engine.py --json "$final/engine.json" >"$final/engine.log" 2>&1 || status=1
        grep -vE "^\{'|Warning|warn" "$final/engine.log" | tail -n 32
    fi
    ;;
*)
    echo "usage: device-final.sh tests [k/n]|grid"
    exit 2
    ;;
esac
exit $status
