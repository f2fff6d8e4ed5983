#!/usr/bin/env bash
# Runs HERE (not on the GPU machine): downloads the server's packages that the GPU machine's image
# lacks, as wheels for its Python 3.12, into .whl/server-py312, which scripts/device-env.sh installs
# there (so the server's GPU tests run instead of skipping; the image has their other needs). The versions are
# this machine's (.venv, made by `make test`): the ones the CPU tests ran with.
#   bash scripts/server-wheels.sh      then carry [".whl"] as usual
set -euo pipefail
cd "$(dirname "$0")/.."
out=.whl/server-py312
rm -rf "$out" && mkdir -p "$out"
packages=(pydantic pydantic-core annotated-types typing-inspection typing-extensions granian cohere-melody)
specs=()
for p in "${packages[@]}"; do
    v=$(.venv/bin/python -m pip show "$p" 2>/dev/null | sed -n 's/^Version: //p')
    [ -n "$v" ] || { echo "$p is not in .venv: run make test first"; exit 1; }
    specs+=("$p==$v")
done
platforms=()
for n in 17 24 27 28 31 34 35 38 39; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" --platform manylinux2014_x86_64 --platform any -d "$out" "${specs[@]}"
ls "$out"
