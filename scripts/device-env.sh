# Sourced by the scripts that run ON the GPU machine: the repository root as working folder, $OUT
# made, and the wheels carried in .whl/ (mk's, built here with `make wheel`, and the packages the
# machine lacks) installed to /tmp/site, which PYTHONPATH puts first (mk never comes from python/,
# which has no compiled module there).
OUT=${OUT:-$PWD/bench-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site
