#!/usr/bin/env bash
# Runs ON the GPU machine: benches/engine.py --prefill-only twice in one call, with the
# engine's defaults (a) and with B_ARGS (b; default: `--fresh-split off --whole-chunk-tokens 0`, a
# fresh prompt in one bucket and every chunk past the budget sliced), on the prompts PROMPTS
# (default: 4500,5281,6000, just past the 4K bucket). Each run also has the reuse, burst and admit
# rows, so the two runs' admit rows compare a next turn replayed whole with the same one sliced.
#   device run:  bash scripts/device-engine-ab.sh      (carry: [".whl"], timeout_s 600)
# Writes $OUT/engine-{a,b}.{json,log} and prints both runs' tables.
set -uo pipefail
source "$(dirname "$0")/device-env.sh"
prompts=${PROMPTS:-4500,5281,6000}
read -r -a b_args <<<"${B_ARGS:---fresh-split off --whole-chunk-tokens 0}"
status=0
for run in a b; do
    args=()
    [ $run = b ] && args=("${b_args[@]}")
    timeout 280 python3 benches/engine.py --prefill-only --prompts "$prompts" "${args[@]}" \
        --json "$OUT/engine-$run.json" >"$OUT/engine-$run.log" 2>&1 || status=1
    echo "== $run: ${args[*]:-the defaults}"
    grep -vE "^\{'|Warning|warn" "$OUT/engine-$run.log" | tail -n 24
done
exit $status
