# Sourced by the scripts that run ON the GPU machine: the repository root as working folder, $OUT
# made, and the wheels carried in .whl/ (mk's, built here with `make wheel`, and the packages the
# machine lacks) installed to /tmp/site, which PYTHONPATH puts first (mk never comes from python/,
# which has no compiled module there).
OUT=${OUT:-$PWD/bench-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# Once per set of carried wheels (the scripts source this file in turn within one call).
stamp=/tmp/site/.installed-$(cat .whl/*.whl | md5sum | cut -c1-16)
if [ ! -f "$stamp" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "wheel install failed"; exit 1; }
    # `make wheel` leaves the built-in model's weights out (the carry limit): the tree's copy.
    cp python/mk/embedded/*.safetensors /tmp/site/mk/embedded/ || { echo "built-in weights copy failed"; exit 1; }
    touch "$stamp"
fi
# The server's packages, where a folder of wheels for this Python was carried (.whl/server-py312,
# made here by scripts/server-wheels.sh; the server's GPU tests, tests/test_server_gpu.py, skip without them).
server_wheels=.whl/server-py$(python3 -c 'import sys; print("%d%d" % sys.version_info[:2])')
if [ -d "$server_wheels" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$server_wheels"/*.whl || echo "server wheels failed to install: the server's GPU tests will skip"
fi
export PYTHONPATH=/tmp/site
# The installed wheel's build variant (cuda/abi.h): a kernel compiled here from source and loaded by
# that wheel (device-kernel.sh, device-ab.sh) must be built with the same defines.
WHEEL_DEFINES=$(python3 -c 'import mk._native as n; print(" ".join(n.build_info()["defines"]))')
export WHEEL_DEFINES
# sanitize_steps LOG SECONDS: compute-sanitizer's memcheck and racecheck on megakernel_once.py's
# steps (racecheck: the 4-row steps alone; a 12-row step outlasts the kernel's wait limit under it),
# each within SECONDS, their reports appended to LOG and each tool's exit status printed there too.
sanitize_steps() {
    local log=$1 limit=$2 tool report steps
    for tool in memcheck racecheck; do
        report=() steps=()
        [ $tool = racecheck ] && report=(--racecheck-report all) steps=(--narrow)
        timeout "$limit" compute-sanitizer --tool $tool "${report[@]}" --error-exitcode 3 \
            python3 scripts/megakernel_once.py "${steps[@]}" >>"$log" 2>&1
        echo "$tool (megakernel steps) exit: $?" | tee -a "$log"
    done
}
# compile_megakernel DIR NAME [nvcc flags...]: DIR/megakernel.cu as this wheel's images, the narrow
# one and (unless the wheel is the swizzled variant) the wide one, in parallel with build.rs's flags,
# to /tmp/NAME-<rows>.cubin; ptxas's reports go to $OUT/NAME-<rows>.log. Prints the variant for
# $MK_MEGAKERNEL_CUBIN ("/tmp/NAME-8.cubin,/tmp/NAME-16.cubin"); fails if an image does not compile.
compile_megakernel() {
    local dir=$1 name=$2 nvcc=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
    shift 2
    local rows=(8) images=() pids=() status=0 r
    [[ " $WHEEL_DEFINES " == *" -DMK_WEIGHT_SWIZZLE=1 "* ]] || rows+=(16)
    for r in "${rows[@]}"; do
        local image=(); [ "$r" = 16 ] && image=(-DMK_IMAGE_ROWS=MK_WIDE_ROWS)
        # shellcheck disable=SC2086
        "$nvcc" -cubin -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -I"$dir" -Xptxas=-v,-warn-spills \
            $WHEEL_DEFINES "${image[@]}" "$@" -o "/tmp/$name-$r.cubin" "$dir/megakernel.cu" >"$OUT/$name-$r.log" 2>&1 &
        pids+=($!) images+=("/tmp/$name-$r.cubin")
    done
    for r in "${!pids[@]}"; do
        wait "${pids[$r]}" || { cat "$OUT/$name-${rows[$r]}.log" >&2; status=1; }
    done
    [ "$status" = 0 ] && (IFS=,; echo "${images[*]}")
}
