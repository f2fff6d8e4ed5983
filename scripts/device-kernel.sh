#!/usr/bin/env bash
# Runs ON the GPU machine: one megakernel iteration without a wheel rebuild. Compiles
# cuda/megakernel.cu with that machine's nvcc into the images (narrow and wide) the installed wheel
# loads instead of its embedded ones ($MK_MEGAKERNEL_CUBIN; the wheel must come from the same cuda/abi.h), then in
# the same call runs the megakernel's GPU tests, the decode benchmark with one trace, and the
# yardstick of record (carried beside the wheels as .whl/yardstick.py; docs/PERF.md, "Method").
#   device run:  bash scripts/device-kernel.sh      (carry: [".whl"])
# Environment: TESTS (pytest files/args, default the megakernel tests; "none" skips them),
# POINTS (decode points, default 1x8192,8x8192), TRACE=0 (no trace), YARDSTICK=0 (skip it),
# NVCC_FLAGS (extra nvcc flags, e.g. -D switches of a variant), KERNEL_SRC (the folder holding
# megakernel.cu, default cuda: e.g. an earlier version's copy with the same abi.h), BENCH_ARGS (more decode.py arguments,
# e.g. "--sizes gate_up_groups=3").
# Writes $OUT/{nvcc-8.log,nvcc-16.log,tests.log,decode.json,bench.log,yardstick.json}; prints a summary last.
set -uo pipefail
source "$(dirname "$0")/device-env.sh"
# The flags of build.rs, both images.
src=${KERNEL_SRC:-cuda}
# shellcheck disable=SC2086
MK_MEGAKERNEL_CUBIN=$(compile_megakernel "$src" nvcc ${NVCC_FLAGS:-}) || exit 1
export MK_MEGAKERNEL_CUBIN

status=0
tests=${TESTS:-tests/test_megakernel_gpu.py}
if [ "$tests" != none ]; then
    # shellcheck disable=SC2086
    timeout "${TEST_S:-300}" python3 -m pytest -q -x -p no:cacheprovider -m gpu $tests >"$OUT/tests.log" 2>&1 || status=1
fi
trace=(--trace)
[ "${TRACE:-1}" = 0 ] && trace=()
# shellcheck disable=SC2086
timeout "${BENCH_S:-240}" python3 benches/decode.py --plain "${trace[@]}" --points "${POINTS:-1x8192,8x8192}" \
    ${BENCH_ARGS:-} --json "$OUT/decode.json" >"$OUT/bench.log" 2>&1 || status=1
if [ "${YARDSTICK:-1}" = 1 ] && [ -f .whl/yardstick.py ]; then
    timeout 200 python3 .whl/yardstick.py --points "${POINTS:-1x8192,8x8192}" --json "$OUT/yardstick.json" \
        >"$OUT/yardstick.log" 2>&1 || status=1
fi

for log in "$OUT"/nvcc-*.log; do
    echo "== nvcc (mk_decode_step, $(basename "$log" .log)) =="
    grep -A2 "Function properties for mk_decode_step" "$log" | grep -E "stack frame|registers"
done
echo "== tests =="
[ -f "$OUT/tests.log" ] && { grep -E "passed|failed|error" "$OUT/tests.log" | tail -n 3; grep -E "^(FAILED|ERROR)|Error|assert" "$OUT/tests.log" | head -n 15; }
echo "== decode =="
grep -vE "^\{'" "$OUT/bench.log" | tail -n 60
echo "== yardstick =="
[ -f "$OUT/yardstick.log" ] && tail -n 4 "$OUT/yardstick.log"
exit $status
