#!/usr/bin/env bash
# Runs ON the GPU machine: the decode grid of record (a few minutes). benches/decode.py over
# batch {1, 2, 4, 8, 16} x context {1K, 8K, 32K, 128K} and batch 1 at 256K (batch 16 in one launch of the
# wide image; two in the swizzled variant, as the engine runs it), and the yardstick of record
# (carried as .whl/yardstick.py; docs/PERF.md, "Method") at the same points in the same call,
# in chunks with their own time limits so that one slow or failing point costs only its chunk.
#   device run:  bash scripts/device-grid.sh      (carry: [".whl"])
# The batch-1 chunk runs BATCH1_RUNS times (default 3), each in its own process: its step moves
# between processes by about as much as its margin over its target (docs/PERF.md, "Noise"); the
# table shows each point's median process.
# Writes $OUT/decode-<chunk>[-<run>].json, $OUT/yardstick-<chunk>.json and prints one table: mk's
# step time, tokens/s and SOL fraction beside the yardstick's step time and the ratio.
set -uo pipefail
source "$(dirname "$0")/device-env.sh"
chunks=(
    "1x1024,1x8192,1x32768,1x131072,1x262144"
    "2x1024,2x8192,2x32768,2x131072"
    "4x1024,4x8192,4x32768,4x131072"
    "8x1024,8x8192,8x32768,8x131072"
    "16x1024,16x8192,16x32768,16x131072"
)
status=0
for i in "${!chunks[@]}"; do
    runs=1
    [ "$i" = 0 ] && runs=${BATCH1_RUNS:-3}
    for r in $(seq 1 "$runs"); do
        json=$OUT/decode-$i.json
        [ "$runs" -gt 1 ] && json=$OUT/decode-$i-$r.json
        timeout "${CHUNK_S:-80}" python3 benches/decode.py --plain --no-torch --iters 10 --points "${chunks[$i]}" \
            --json "$json" >>"$OUT/grid.log" 2>&1 || { status=1; echo "decode chunk $i failed" >>"$OUT/grid.log"; }
    done
    timeout "${CHUNK_S:-80}" python3 .whl/yardstick.py --points "${chunks[$i]}" --json "$OUT/yardstick-$i.json" \
        >>"$OUT/grid.log" 2>&1 || { status=1; echo "yardstick chunk $i failed" >>"$OUT/grid.log"; }
done
rm -f "$OUT"/decode-*.png
python3 - "$OUT" <<'PY'
import glob, json, sys
out = sys.argv[1]
runs, ys = {}, {}


def rows_of(path):  # a bench's record ({"rows": [...]}) or the yardstick of record's list of lines
    data = json.load(open(path))
    return data["rows"] if isinstance(data, dict) else data


for f in sorted(glob.glob(f"{out}/decode-*.json")):
    for r in rows_of(f):
        runs.setdefault((r["batch"], r["ctx"]), []).append(r)
# Each point's median process (the lower middle of an even count) among those that timed it; a point
# skipped (it did not fit the card) or with no timing in every process prints as skipped.
mk = {}
for key, rs in runs.items():
    timed = sorted((r for r in rs if r.get("mk_ms") is not None), key=lambda r: r["mk_ms"])
    mk[key] = timed[(len(timed) - 1) // 2] if timed else None
for f in sorted(glob.glob(f"{out}/yardstick-*.json")):
    for r in rows_of(f):
        b = r.get("B", r.get("batch"))
        if b is None or "ctx" not in r:
            continue  # the yardstick's first line: the card, torch, the copy bandwidth
        ys[(b, r["ctx"])] = r.get("graph_ms") or "skipped"
print(f"{'batch':>5} {'ctx':>7} {'mk_ms':>7} {'tok_s':>6} {'sol':>5} {'ys_ms':>7} {'mk/ys':>6}  sol of each run")
for key in sorted(set(mk) | set(ys)):
    r, y = mk.get(key), ys.get(key)
    ys_ms = "-" if y is None else y if isinstance(y, str) else f"{y:.2f}"  # (a str: "skipped")
    if r is None:
        mk_cells = f"{'skipped' if key in runs else '-':>7} {'-':>6} {'-':>5}"
        ratio, each = "-", ""
    else:
        mk_cells = f"{r['mk_ms']:7.2f} {r['mk_tok_s']:6.0f} {r['sol_fraction']:5.2f}"
        ratio = f"{y / r['mk_ms']:.2f}x" if isinstance(y, (int, float)) else "-"
        each = [f"{x['sol_fraction']:.3f}" if x.get("mk_ms") is not None else "skipped" for x in runs[key]]
        each = " ".join(each) if len(each) > 1 else ""
    print(f"{key[0]:>5} {key[1]:>7} {mk_cells} {ys_ms:>7} {ratio:>6}  {each}")
PY
grep -E "failed|Error" "$OUT/grid.log" | head -n 10
exit $status
