#!/usr/bin/env bash
# Runs ON the GPU machine: the measurements that say where the time goes, in one call.
#   device run:  bash scripts/device-perf.sh      (carry: [".whl"])
# - benches/decode.py --quick --trace: batch 1 and 8 at 8K, the plain, L2-prefetch and balanced
#   variants timed in the same run, and one traced step of each summarized per task family;
# - benches/prefill.py --profile: torch.profiler over a 512- and an 8K-token prefill.
# Writes $OUT/{decode.json,prefill-profile.json,perf.log}.
set -uo pipefail
source "$(dirname "$0")/device-env.sh"
status=0
timeout 300 python3 benches/decode.py --quick --trace --json "$OUT/decode.json" >"$OUT/perf.log" 2>&1 || status=1
timeout 240 python3 benches/prefill.py --profile --json "$OUT/prefill-profile.json" >>"$OUT/perf.log" 2>&1 || status=1
grep -vE "^\{'|Warning|warn" "$OUT/perf.log" | tail -n 120
exit $status
