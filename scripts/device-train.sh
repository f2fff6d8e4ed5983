#!/usr/bin/env bash
# Runs ON the GPU machine: trains the embedded model with
# scripts/train_embedded.py. The device returns at most 8 files of at most 16 MiB (64 MiB in all), so
# the weights come back as they are (one model.safetensors, or shards of at most 15 MiB with their
# index) and everything else in one tar:
#   $OUT/embedded/*.safetensors                                   -> python/mk/embedded/
#   $OUT/bundle.tar: embedded/{config.json,tokenizer.json,tokenizer_config.json[,model.safetensors.index.json]},
#                    docs/{embedded-model.json,embedded-model-loss.png}, train.log
#     unpack (the old weights first out: the loader prefers shards to a model.safetensors):
#       rm -f python/mk/embedded/*.safetensors python/mk/embedded/model.safetensors.index.json
#       cp <files_at>/embedded/*.safetensors python/mk/embedded/
#       tar -xf <files_at>/bundle.tar -C /tmp/train && cp /tmp/train/embedded/* python/mk/embedded/ && cp /tmp/train/docs/* docs/
# The table of results is printed last.
#   device run:  bash scripts/device-train.sh [extra train_embedded.py flags]     (carry: none needed)
#   (CALL_S=<the call's timeout_s> when it is below 600; BUDGET must then leave the evaluations time)
# One `run` command lasts at most 600 s, and the corpus, the tokenizer and the encoding of a
# site-packages corpus take minutes of it before training, so training gets 5 minutes (BUDGET) and
# the evaluations here are 40 functions with 96 new tokens, which leaves the report time to be
# written; scripts/eval_embedded.py measures the bars afterwards (on the CPU too).
# mk always comes from this tree's python/ (training needs no compiled code, and a carried mk wheel could
# predate the training code); other wheels carried in .whl/ are installed to /tmp/site as in device-check.sh.
set -uo pipefail
OUT=${OUT:-$PWD/train-out}
BUDGET=${BUDGET:-5}
mkdir -p "$OUT/embedded" "$OUT/docs"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true
cd "$(dirname "$0")/.."

mapfile -t wheels < <(ls .whl/*.whl 2>/dev/null | grep -v '/mk-')
if [ "${#wheels[@]}" -gt 0 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "${wheels[@]}" || { echo "wheel install failed"; exit 1; }
fi
export PYTHONPATH=$PWD/python:/tmp/site

{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c 'import sys, torch, tokenizers; print("python", sys.version.split()[0], "torch", torch.__version__,
"tokenizers", tokenizers.__version__, "cuda", torch.cuda.is_available())'
    git log -1 --format='commit %H %s' 2>/dev/null
} 2>&1 | tee "$OUT/train.log"

# The run must end before the call does (CALL_S: the `run` call's timeout_s; a call ended by its own
# limit returns no bundle, not even the tokenizer).
# ($SECONDS: what the set-up above took.)
run_s=$(( ${CALL_S:-600} - SECONDS - 40 ))
[ "$run_s" -ge 60 ] || { echo "CALL_S=${CALL_S:-600} leaves no time to train" | tee -a "$OUT/train.log"; exit 1; }
timeout "$run_s" python3 scripts/train_embedded.py --device cuda --time-budget "$BUDGET" --eval-functions 40 \
    --max-new-tokens 96 --out-dir "$OUT/embedded" --docs-dir "$OUT/docs" "$@" 2>&1 | tee -a "$OUT/train.log"
status=${PIPESTATUS[0]}
[ "$status" -eq 0 ] || echo "train_embedded.py exit status $status (124: killed by the $run_s s timeout)" | tee -a "$OUT/train.log"
# Everything but the weights into one file (even after a failed run: the log says why).
(cd "$OUT" && tar -cf bundle.tar --ignore-failed-read embedded/*.json docs train.log 2>/dev/null \
    && rm -rf embedded/*.json docs train.log)
exit "$status"
