"""Train mk's embedded model: a small North-Mini-Code-architecture coder on the Python standard library.

Self-contained (torch, tokenizers and the mk package; no network), seeded and reproducible:

1. Corpus: every .py file of the running interpreter's standard library (`sysconfig` "stdlib"), except
   test folders (test/, tests/, idle_test/), site-/dist-packages and pydoc_data (a generated text dump).
   Files are ordered by SHA-256 of their path relative to the library root. Walking that order, whole files
   are held out until they give `--heldout` functions fit for the completion test (a docstring, 2-30 body
   lines; at most 4 from one file, picked by hash): those functions are the test set, their files the
   held-out loss set. The next files in that
   order, up to 2% of the bytes, are the validation set (loss curve, best-checkpoint choice). The rest is
   training text, minus any file that contains a copy of a held-out function (the stdlib has a few copies).
2. Documents: each training file (BOS + source + EOS, its trailing newlines dropped: a file's last newline
   before EOS taught the model that a bare newline ends the text, so after a docstring and a newline its
   first token was EOS); each fit training function alone, dedented, as the completion test prompts it, and
   once more cut in two where a prompt may end (the docstring's closing quotes, its newline, the next line's
   indentation, or inside the body) and tokenized half by half, so that a prompt ending in a bare newline is
   a place the model has seen; one chat example per fit training function, rendered with mk's Cohere-format
   chat template: either its signature and docstring as the user turn and its body as the answer, or "Write
   a Python function ..." with its docstring's first line and the whole function in a ```python block as the
   answer (half of them with a short reasoning block); 2,000 tool-call conversations (tools offered in the
   system turn, a `<|START_ACTION|>` block, tool results, a final answer), repeated.
3. Tokenizer: byte-level BPE (`mk.text.tokenizer_files.train_tokenizer`, the Cohere special tokens at mk's fixed
   ids) trained on the training documents only.
4. Model: `ModelConfig.embedded()` (or `--preset tiny`; `--geometry field=value,...` changes its fields,
   e.g. `hidden_size=384,vocab_size=16384`; `--dry-run` prints the size and the megakernel's verdict),
   trained with `mk.model.train.forward` (the reference model's math, batched; a test checks it equals
   `Model.logits`), AdamW, warmup then cosine decay, bf16 autocast on CUDA, a small load-balancing loss on
   the routers. Without `--steps`, the step count is fixed
   after a short timing calibration so that training fits `--time-budget` (capped by `--max-epochs`); the
   JSON's "replay" flags (`--steps N --max-steps M --warmup W --seed S`) rerun the same schedule and batches.
5. Outputs: the checkpoint of the lowest validation loss, in bf16 (`--out-dir`, by default
   python/mk/embedded/), written with `write_checkpoint` (in shards of at most SHIPPED_SHARD_BYTES when
   larger: the device machine returns files of at most 16 MiB); `<docs-dir>/embedded-model.json` (settings,
   metrics, curves, samples) and `<docs-dir>/embedded-model-loss.png` (when matplotlib is there). Metrics,
   all on the shipped bf16 weights: held-out next-token loss (and bits per byte), the share of the held-out
   functions whose greedy completion (signature + docstring as the prompt) makes the function parse with
   `ast.parse` and have a body (not `pass` or `...` alone), the same through the chat template, and the
   share of held-out tool prompts answered with a well-formed tool call. A table is printed last.

The steps are the modules of scripts/embedded/ (corpus, documents, tokens, training, unlikelihood,
evaluation, outputs); this script is the command line.

CPU smoke run: python scripts/train_embedded.py --max-steps 5 --device cpu  (defaults shrink on the CPU).
GPU run (the device machine): bash scripts/device-train.sh.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import random
import sys
import sysconfig
import time
from collections.abc import Sequence
from dataclasses import fields, replace
from pathlib import Path

import torch

from mk.config import ModelConfig, default_layer_types
from mk.model.names import expected_shapes
from mk.text import tokenizer_files

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))  # the recipe's package, embedded/, beside this script
from embedded.corpus import SITE, build_corpus, build_site_corpus, code_corpus  # noqa: E402
from embedded.documents import build_documents  # noqa: E402
from embedded.evaluation import (  # noqa: E402
    evaluate_chat,
    evaluate_completions,
    evaluate_tools,
    reference_agreement,
    reference_expectation,
)
from embedded.outputs import megakernel_verdict, plot, print_table, unshippable, write_shipped  # noqa: E402
from embedded.tokens import build_tokenizer, encode_chat, encode_code, encode_cut, token_stream  # noqa: E402
from embedded.training import stream_loss, train  # noqa: E402
from embedded.unlikelihood import UL_MAX_VAL_COST, UL_PROMPT_TOKENS, unlikelihood_phase  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEFAULTS = {  # per device type; every one can be given on the command line
    "cuda": dict(batch_size=64, seq_len=1024, eval_every=200, eval_batches=16, loss_batches=None, max_new_tokens=256),
    "cpu": dict(batch_size=4, seq_len=128, eval_every=50, eval_batches=2, loss_batches=16, max_new_tokens=24),
}
CPU_EVAL_FUNCTIONS = 8


def ul_on(args) -> bool:
    return args.unlikelihood_updates is not None or args.unlikelihood_seconds > 0


def preset_config(preset: str, geometry: str | None) -> ModelConfig:
    """The preset's config with the `--geometry` changes (`field=value,...`; a new layer count gets the
    default layer pattern)."""
    cfg = ModelConfig.embedded() if preset == "embedded" else ModelConfig.tiny()
    if not geometry:
        return cfg
    names = [f.name for f in fields(ModelConfig) if f.name != "layer_types"]
    changes: dict = {}
    for item in geometry.split(","):
        key, sep, value = (s.strip() for s in item.partition("="))
        if not sep or key not in names:
            raise SystemExit(f"--geometry: {item!r} is not field=value with a field among {', '.join(names)}")
        try:
            changes[key] = type(getattr(cfg, key))(value)
        except ValueError:
            raise SystemExit(f"--geometry: {key}={value!r} is not a {type(getattr(cfg, key)).__name__}") from None
    if "num_hidden_layers" in changes:
        changes["layer_types"] = default_layer_types(changes["num_hidden_layers"])
    try:
        return replace(cfg, **changes)
    except ValueError as e:
        raise SystemExit(f"--geometry: {e}") from None


def megabytes(mb: float | None) -> int | None:
    return None if mb is None else int(mb * 1e6)


def parse_args(argv: Sequence[str] | None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--preset", choices=["embedded", "tiny"], default="embedded")
    p.add_argument(
        "--geometry",
        default=None,
        help="changes to the preset's config, field=value,... (e.g. hidden_size=384,vocab_size=16384)",
    )
    p.add_argument(
        "--dry-run", action="store_true", help="print the geometry, its size and the megakernel's verdict, then exit"
    )
    p.add_argument("--time-budget", type=float, default=12.0, help="minutes of training (default 12)")
    p.add_argument("--steps", type=int, default=None, help="schedule length in steps, no timing calibration")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    p.add_argument("--max-epochs", type=float, default=40.0, help="upper bound on passes over the training tokens")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-frac", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--balance-coef", type=float, default=0.01)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument(
        "--unlikelihood-seconds",
        type=float,
        default=0.0,
        help="seconds of unlikelihood fine-tuning on the model's own looping continuations after the main\n"
        "schedule, taken from --time-budget (default 0: none)",
    )
    p.add_argument(
        "--unlikelihood-updates",
        type=int,
        default=None,
        help="exactly this many unlikelihood updates, without a time bound (the replay flags record it)",
    )
    p.add_argument("--unlikelihood-weight", type=float, default=1.0, help="the unlikelihood term's weight (default 1)")
    p.add_argument(
        "--unlikelihood-round", type=int, default=256, help="prompts continued per generation round (default 256)"
    )
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=None)
    p.add_argument("--eval-batches", type=int, default=None, help="validation batches per evaluation")
    p.add_argument("--loss-batches", type=int, default=None, help="batches of the final losses (default: all)")
    p.add_argument("--vocab-size", type=int, default=None, help="tokenizer size (default: the preset's vocab)")
    p.add_argument("--stdlib", default=None, help="library root (default: this interpreter's stdlib)")
    p.add_argument(
        "--held-out-packages",
        default=None,
        help="train on every installed package and the stdlib (scripts/code_corpus.py), holding these\n"
        "comma-separated packages out for the tests (default: the stdlib alone, held-out files)",
    )
    p.add_argument("--max-files", type=int, default=None, help="training files kept (quick runs)")
    p.add_argument(
        "--max-train-bytes",
        type=float,
        default=None,
        help="MB of training files kept, the first in hash order (a large site-packages corpus is\n"
        "more than one GPU run trains on; encoding it costs time and host memory)",
    )
    p.add_argument(
        "--tokenizer-bytes",
        type=float,
        default=None,
        help="MB of code files the tokenizer is trained on (default: all; BPE on hundreds of MB takes minutes)",
    )
    p.add_argument("--heldout", type=int, default=100, help="held-out functions")
    p.add_argument("--eval-functions", type=int, default=None, help="held-out functions generated from")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--gen-batch", type=int, default=128, help="sequences per greedy-generation batch")
    p.add_argument("--tool-examples", type=int, default=2000, help="tool-call conversations (default 2000)")
    p.add_argument("--tool-repeat", type=int, default=2)
    p.add_argument("--out-dir", default=str(REPO / "python" / "mk" / "embedded"))
    p.add_argument("--docs-dir", default=str(REPO / "docs"))
    args = p.parse_args(argv)
    if args.unlikelihood_updates is None and args.unlikelihood_seconds >= 0.5 * args.time_budget * 60:
        p.error("--unlikelihood-seconds must leave the main schedule at least half of --time-budget")
    if args.unlikelihood_round < 1:
        p.error("--unlikelihood-round must be at least 1")
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(args.device).type
    for k, v in DEFAULTS["cuda" if dev == "cuda" else "cpu"].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.eval_functions is None:
        args.eval_functions = args.heldout if dev == "cuda" else min(args.heldout, CPU_EVAL_FUNCTIONS)
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    cfg = preset_config(args.preset, args.geometry)
    vocab = args.vocab_size or cfg.vocab_size
    if vocab > cfg.vocab_size:
        raise SystemExit(f"--vocab-size {vocab} exceeds the model's vocab_size {cfg.vocab_size} (see --geometry)")
    too_big = unshippable(cfg)
    if args.dry_run:
        n_params = sum(math.prod(s) for s in expected_shapes(cfg).values())
        print(f"{args.preset} {cfg.to_dict()}")
        verdict = megakernel_verdict(cfg)
        print(f"{n_params / 1e6:.2f}M parameters, {2 * n_params / 1e6:.2f} MB in bf16; {verdict}")
        print(f"the device machine can return it: {too_big or 'yes'}")
        return {"config": cfg.to_dict(), "parameters": n_params, "megakernel": verdict, "unshippable": too_big}
    if too_big:
        raise SystemExit(f"--geometry: {too_big}")
    started = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - started:7.1f}s] {msg}", flush=True)

    random.seed(args.seed)
    torch.manual_seed(args.seed)
    manifest = None
    if args.held_out_packages:
        cc = code_corpus()
        held = {h.strip().lower() for h in args.held_out_packages.split(",") if h.strip()}
        packages = cc.installed_packages() + [cc.stdlib_package()]
        root = Path("site-packages")
        corpus, manifest = build_site_corpus(
            packages, held, args.heldout, args.max_files, os.cpu_count() or 1, megabytes(args.max_train_bytes)
        )
    else:
        root = Path(args.stdlib or sysconfig.get_paths()["stdlib"])
        corpus = build_corpus(root, args.heldout, args.max_files, megabytes(args.max_train_bytes))
    docs = build_documents(corpus, args.tool_examples, args.seed)
    log(
        f"corpus {root}: {len(corpus.train)} training files, {len(corpus.val)} validation, {len(corpus.heldout)} "
        f"held out ({len(corpus.test_functions)} test functions), {len(corpus.leak_excluded)} dropped as copies; "
        f"{len(docs.functions)} function documents, {len(docs.chat)} chat and {len(docs.tools)} tool examples"
    )
    tok = build_tokenizer(docs, vocab, megabytes(args.tokenizer_bytes))
    for name, i in tokenizer_files.SPECIAL_IDS.items():
        assert tok.token_to_id(name) == i, name
    pieces = (
        encode_code(tok, docs.code)
        + encode_code(tok, docs.functions)
        + encode_cut(tok, docs.cut)
        + encode_chat(tok, docs.chat)
        + encode_chat(tok, docs.tools) * args.tool_repeat
    )
    train_stream = token_stream(pieces, args.seed)
    val_stream = torch.tensor([t for d in encode_code(tok, list(corpus.val.values())) for t in d], dtype=torch.long)
    held_texts = list(corpus.heldout.values())
    held_stream = torch.tensor([t for d in encode_code(tok, held_texts) for t in d], dtype=torch.long)
    code_tokens = sum(len(p) for p in pieces[: len(docs.code)])
    log(
        f"tokenizer: {tok.get_vocab_size()} tokens; stream {len(train_stream):,} training tokens "
        f"({code_tokens:,} of raw code, {sum(map(len, corpus.train.values())) / max(1, code_tokens):.2f} "
        f"bytes/token), {len(val_stream):,} validation, {len(held_stream):,} held out"
    )
    if len(train_stream) <= args.seq_len + 1 or len(val_stream) <= args.seq_len + 1:
        raise SystemExit("corpus too small for --seq-len")

    result = train(args, cfg, train_stream, val_stream, device, log)
    ul_record = None
    if ul_on(args):
        heads = [f.prompt.removesuffix("\n") for f in corpus.train_functions]
        ul_prompts = [e.ids for e in tok.encode_batch(heads, add_special_tokens=True)]
        ul_prompts = [ids for ids in ul_prompts if len(ids) <= UL_PROMPT_TOKENS]
        # The best weights are the last ones (as in every run so far): go on with their optimizer.
        last, opt = result["state"] if result["best_step"] == result["steps"] else (result["weights"], None)

        def val_cost(w) -> float:
            loss, _ = stream_loss(cfg, w, val_stream, args.seq_len, args.batch_size, device, args.eval_batches)
            return loss - result["best_val_loss"]

        try:
            tuned, ul_record = unlikelihood_phase(
                args, cfg, last, train_stream, ul_prompts, tok, device, log, opt, val_cost
            )
            ul_record["val_loss_after"], _ = stream_loss(
                cfg, tuned, val_stream, args.seq_len, args.batch_size, device, args.eval_batches
            )
        except Exception as e:  # the main schedule's weights are worth more than the phase
            log(f"unlikelihood phase failed ({type(e).__name__}: {e}): the weights before it ship")
            tuned, ul_record = None, {"error": f"{type(e).__name__}: {e}", "updates": 0, "val_loss_after": math.inf}
            ul_record["looping_share_by_round"] = []
            ul_record["wall_seconds"] = 0.0
        ul_record["val_loss_before"] = result["best_val_loss"]
        ul_record["kept"] = ul_record["val_loss_after"] <= ul_record["val_loss_before"] + UL_MAX_VAL_COST
        if ul_record["kept"]:
            result["weights"] = {n: t.detach().clone() for n, t in tuned.items()}
        log(
            f"unlikelihood: {ul_record['updates']} updates in {ul_record['wall_seconds']:.0f} s; looping share "
            f"{ul_record['looping_share_by_round'][:1]} -> {ul_record['looping_share_by_round'][-1:]}; validation "
            f"loss {ul_record['val_loss_before']:.4f} -> {ul_record['val_loss_after']:.4f}: "
            + (
                "kept"
                if ul_record["kept"]
                else f"dropped (costs more than {UL_MAX_VAL_COST}), the weights before it ship"
            )
        )

    # The shipped weights: bf16. Every metric below is computed on them.
    shipped = {n: t.to(torch.bfloat16) for n, t in result["weights"].items()}
    eval_w = shipped if device.type == "cuda" else {n: t.float() for n, t in shipped.items()}
    out_dir = Path(args.out_dir)
    size = write_shipped(out_dir, cfg, shipped, tok)
    log(f"checkpoint written: {out_dir} ({size / 1e6:.2f} MB)")

    lw = args.loss_batches
    heldout_loss, held_load = stream_loss(cfg, eval_w, held_stream, args.seq_len, args.batch_size, device, lw)
    val_loss, _ = stream_loss(cfg, eval_w, val_stream, args.seq_len, args.batch_size, device, lw)
    held_bytes = sum(len(t.encode()) for t in held_texts)
    bits_per_byte = heldout_loss * (len(held_stream) - 1) / (held_bytes * math.log(2))
    fns = corpus.test_functions[: args.eval_functions]
    comp = evaluate_completions(cfg, eval_w, tok, fns, args, device)
    log(f"held-out loss {heldout_loss:.4f}; completion parse rate {comp['rate']:.1%} on {len(fns)} functions")
    chat = evaluate_chat(cfg, eval_w, tok, fns, args, device)
    tools = evaluate_tools(cfg, eval_w, tok, fns[: min(len(fns), 32)], corpus.root == SITE, args, device)
    log(f"chat parse rate {chat['rate']:.1%}; tool-call rate {tools['rate']:.1%}")
    cpu_w = {n: t.float().cpu() for n, t in shipped.items()}
    agreement = reference_agreement(out_dir, cfg, cpu_w, held_stream)
    expectation = reference_expectation(out_dir)
    log(f"reference model from the checkpoint agrees with the training forward: max |dlogit| {agreement:.2e}")

    n_params = sum(math.prod(s) for s in expected_shapes(cfg).values())
    settings = {k: v for k, v in vars(args).items() if k not in ("out_dir", "docs_dir")}
    report = {
        "settings": settings,
        "config": cfg.to_dict(),
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "stdlib": str(root),
            "corpus_sha256": hashlib.sha256(
                "".join(f"{p}\0{t}\0" for p, t in sorted(corpus.train.items())).encode()
            ).hexdigest(),
        },
        "corpus": {
            "manifest": manifest,  # packages, versions, licences, drops (None: the stdlib alone)
            "train_files": len(corpus.train),
            "val_files": sorted(corpus.val),
            "heldout_files": sorted(corpus.heldout),
            "leak_excluded": corpus.leak_excluded,
            "function_documents": len(docs.functions),
            "chat_examples": len(docs.chat),
            "tool_examples": len(docs.tools),
            "tool_repeat": args.tool_repeat,
            "train_tokens": len(train_stream),
            "val_tokens": len(val_stream),
            "heldout_tokens": len(held_stream),
            "vocab": tok.get_vocab_size(),
        },
        "model": {"parameters": n_params, "safetensors_bytes": size, "megakernel": megakernel_verdict(cfg)},
        "training": {k: v for k, v in result.items() if k not in ("weights", "state", "history")},
        "unlikelihood": ul_record,
        # The same run again (same schedule, same batches; on CUDA up to atomic-add order).
        "replay": f"--steps {result['planned_steps']} --max-steps {result['steps']} --warmup {result['warmup']} "
        f"--seed {args.seed}"
        + (
            f" --unlikelihood-updates {ul_record['updates']} --unlikelihood-weight {args.unlikelihood_weight}"
            f" --unlikelihood-round {args.unlikelihood_round}"
            if ul_record
            else ""
        ),
        "metrics": {
            "heldout_loss": heldout_loss,
            "heldout_bits_per_byte": bits_per_byte,
            "val_loss": val_loss,
            "completion_parse_rate": comp["rate"],
            "chat_parse_rate": chat["rate"],
            "tool_call_rate": tools["rate"],
            "eval_functions": len(fns),
            "reference_max_abs_logit_diff": agreement,
            # Share of the (token, slot) assignments per expert on the held-out files, one row per MoE layer
            # (uniform: 1 / num_experts).
            "heldout_expert_load": [[round(x, 4) for x in row] for row in held_load.tolist()],
        },
        "expectation": expectation,
        "history": result["history"],
        "samples": {
            "completions": comp["rows"],
            "chat": chat["rows"][:8],
            "tools": tools["rows"][:8],
        },
        "wall_seconds": time.perf_counter() - started,
    }
    docs_dir = Path(args.docs_dir)
    docs_dir.mkdir(parents=True, exist_ok=True)
    (docs_dir / "embedded-model.json").write_text(json.dumps(report, indent=1) + "\n")
    png = plot(docs_dir / "embedded-model-loss.png", result, heldout_loss)

    t = result
    print_table(
        [
            (
                "geometry",
                f"{args.preset}{f' with {args.geometry}' if args.geometry else ''}: {n_params / 1e6:.2f}M "
                f"parameters, {size / 1e6:.2f} MB bf16 safetensors",
            ),
            (
                "corpus",
                (
                    f"{len(manifest['packages'])} packages (held out: {', '.join(manifest['held_out'])})"
                    if manifest
                    else f"Python {platform.python_version()} stdlib"
                )
                + f", {len(train_stream):,} training tokens",
            ),
            ("steps", f"{t['steps']} ({t['steps_set_by']}), {t['epochs']:.1f} epochs, {t['train_seconds']:.0f} s"),
            ("throughput", f"{t['tokens_per_second']:,.0f} tokens/s on {args.device}"),
            ("best validation", f"{t['best_val_loss']:.4f} at step {t['best_step']}"),
            (
                "unlikelihood",
                (
                    f"{ul_record['updates']} updates, looping share {ul_record['looping_share_by_round'][0]:.2f} -> "
                    f"{ul_record['looping_share_by_round'][-1]:.2f}, validation {ul_record['val_loss_after']:.4f}, "
                    + ("kept" if ul_record["kept"] else "dropped")
                    + (f" ({ul_record['stopped']})" if "stopped" in ul_record else "")
                )
                if ul_record and ul_record["looping_share_by_round"]
                else "none",
            ),
            ("held-out loss", f"{heldout_loss:.4f} nats/token, {bits_per_byte:.3f} bits/byte"),
            ("completion parse", f"{comp['rate']:.1%} of {len(fns)} held-out functions"),
            ("chat parse", f"{chat['rate']:.1%}"),
            ("tool calls", f"{tools['rate']:.1%} well-formed"),
            (
                "expert load",
                f"{float(held_load.min()):.3f} .. {float(held_load.max()):.3f} (uniform {1 / cfg.num_experts:.3f})",
            ),
            ("reference check", f"max |dlogit| {agreement:.1e}"),
            ("outputs", f"{out_dir}, {docs_dir / 'embedded-model.json'}" + (" + loss PNG" if png else "")),
            ("wall time", f"{report['wall_seconds']:.0f} s"),
        ]
    )
    return report


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    main(sys.argv[1:])
