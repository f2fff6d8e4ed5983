#!/usr/bin/env bash
# Runs ON the GPU machine: megakernel variants compared. Between processes the step time varies
# more than the changes measured (docs/PERF.md, "Noise"), so source variants are compiled here and
# loaded together into one decode.py process
# ($MK_MEGAKERNEL_CUBIN=a:b:..., timed in alternation on the same buffers: mk_kernel<k>_ms),
# which runs ROUNDS times. A variant is NAME=KIND:DIR[:FLAGS], where KIND is
#   src   the cuda/ sources in DIR, compiled with FLAGS (comma-separated nvcc flags, e.g.
#         -DMK_STAGE_BOXES=2) as both images (narrow and wide) and loaded by the wheel in .whl/
#         (the same abi.h);
#   wheel the wheel in DIR with its embedded kernel (an earlier ABI), timed in its own process
#         after each round.
#   device run:  VARIANTS="old=src:.whl/old-cuda new=src:cuda" bash scripts/device-ab.sh
#   (src variants share the wheel's cuda/abi.h, which the launcher checks by the block size; a kernel
#   of an earlier ABI runs as a wheel variant: VARIANTS="base=wheel:.whl/base-wheel new=src:cuda")
# Environment: VARIANTS (required), ROUNDS (default 1), POINTS (default 1x8192,8x8192), SIZES
# (decode.py --sizes for every process, e.g. expert_queue=1).
# Writes $OUT/ab-<round>.json, $OUT/<wheel variant>-<round>.json and prints one line per variant
# and round.
set -uo pipefail
source "$(dirname "$0")/device-env.sh"
rounds=${ROUNDS:-1}
cubins=() names=() wheels=() compiles=()
for v in $VARIANTS; do
    name=${v%%=*}
    IFS=: read -r kind dir flags <<<"${v#*=}"
    case $kind in
        src)  # every variant compiles at once (two images each, one core apiece)
            # shellcheck disable=SC2086
            compile_megakernel "$dir" "nvcc-$name" ${flags//,/ } >"/tmp/images-$name" &
            compiles+=($!) names+=("$name") ;;
        wheel)
            python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
                --target "/tmp/site-$name" "$dir"/*.whl || exit 1
            wheels+=("$name") ;;
        *) echo "unknown variant kind: $v"; exit 1 ;;
    esac
done
for k in "${!compiles[@]}"; do
    wait "${compiles[$k]}" || { echo "variant ${names[$k]} did not compile"; exit 1; }
    cubins+=("$(cat "/tmp/images-${names[$k]}")")
done
bench() {  # json log [env...]
    local json=$1 log=$2
    shift 2
    env "$@" timeout 300 python3 benches/decode.py --plain --no-torch --points "${POINTS:-1x8192,8x8192}" \
        --sizes "${SIZES:-}" --json "$json" >"$log" 2>&1 || { echo "failed: $log"; tail -n 5 "$log"; return 1; }
}
show() {  # json, then the variant names of its kernels in order
    python3 - "$@" <<'EOF'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
names = sys.argv[2:]
for k, name in enumerate(names):
    key = f"mk_kernel{k}_ms" if len(names) > 1 else "mk_ms"
    cells = []
    for r in rows:
        if "skipped" in r:  # (a point that did not fit the card)
            cells.append(f"{r['batch']}x{r['ctx']}: skipped")
            continue
        extra = [f"{n[3:-3]} {v:.3f}" for n, v in r.items() if n.startswith("mk_") and n.endswith("_ms")
                 and n not in ("mk_ms", "mk_balanced_ms") and "kernel" not in n and v and k == 0]
        same = "" if k == 0 or r.get(f"kernel{k}_same_logits", True) else " (logits differ)"
        cells.append(f"{r['batch']}x{r['ctx']}: {r[key]:.3f} ms{same}" + (f" [{', '.join(extra)}]" if extra else ""))
    print(f"{name:>12}", "  ".join(cells), flush=True)
EOF
}
for r in $(seq 1 "$rounds"); do
    echo "-- round $r"
    if [ ${#cubins[@]} -gt 0 ]; then
        joined=$(IFS=:; echo "${cubins[*]}")
        bench "$OUT/ab-$r.json" "$OUT/ab-$r.log" MK_MEGAKERNEL_CUBIN="$joined" && show "$OUT/ab-$r.json" "${names[@]}"
    fi
    for name in "${wheels[@]}"; do
        bench "$OUT/$name-$r.json" "$OUT/$name-$r.log" PYTHONPATH="/tmp/site-$name:/tmp/site" \
            && show "$OUT/$name-$r.json" "$name"
    done
done
