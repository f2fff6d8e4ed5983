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
# made here by scripts/server-wheels.sh; the server's GPU test skips without them).
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
