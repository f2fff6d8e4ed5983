"""`python -m mk`: a short greedy generation through the reference model over a paged KV cache.

A smoke run of the model path without the engine or the server: tokenizer, prefill, paged decode.
Without --model it uses the built-in model (`mk.default_model`), a small coder trained on the Python
sources of a site-packages corpus and the standard library (docs/EMBEDDED.md).
"""

from __future__ import annotations

import argparse
import time

import torch

from mk.config import PAGE_SIZE
from mk.default_model import load_default
from mk.model import PageAllocator, load
from mk.text.tokenizer import Tokenizer


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mk", description=__doc__)
    p.add_argument("--prompt", default="def fibonacci(n):", help="text to continue (default: %(default)r)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate (default: %(default)s)")
    p.add_argument("--model", help="checkpoint folder (config.json, safetensors, tokenizer.json); default: built-in")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (GPU when present; default: %(default)s)")
    args = p.parse_args()
    if args.max_tokens < 1:
        p.error("--max-tokens must be at least 1")
    return args


def main() -> None:
    args = parse_args()
    device = torch.device(
        "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device.replace("auto", "cpu")
    )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.model:
        model, tokenizer = load(args.model, device=device, dtype=dtype), Tokenizer.from_dir(args.model)
    else:
        model, tokenizer = load_default(device, dtype)
    cfg = model.config
    prompt = tokenizer.encode(args.prompt)
    total = len(prompt) + args.max_tokens
    max_pages = -(-total // PAGE_SIZE)
    alloc = PageAllocator(cfg.num_hidden_layers * max_pages)
    kv = model.new_kv(alloc.num_free)
    table = alloc.new_table(cfg, max_pages)
    alloc.ensure(table, len(prompt))

    start = time.perf_counter()
    logits = model.forward(torch.tensor(prompt), 0, kv, table, last_only=True)
    generated = [int(logits[-1].argmax())]
    for pos in range(len(prompt), total - 1):
        alloc.release_out_of_window(table, cfg, pos)
        alloc.ensure(table, pos + 1, from_pos=pos)
        logits = model.decode(torch.tensor(generated[-1:]), torch.tensor([pos]), kv, [table])
        generated.append(int(logits[0].argmax()))
        if generated[-1] == cfg.eos_token_id:
            break
    elapsed = time.perf_counter() - start
    print(args.prompt + tokenizer.decode(generated, skip_special_tokens=True))
    rate = len(generated) / elapsed
    print(f"\n[{len(prompt)} prompt + {len(generated)} generated tokens on {device}, {rate:.1f} tok/s]")


if __name__ == "__main__":
    main()
