"""A chat prompt's tokenizing on the server's CPU: a conversation rendered again with one more message
(a next turn), encoded in full by `tokenizers` and through mk's segment cache (`mk.text.tokenizer`),
whose earlier messages come from the cache. Histories of about 1K to 32K tokens; the built-in
model's tokenizer, or the one of `--model DIR`. Prints a table and writes JSON.

  python benches/chat_tokens.py [--model DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mk
from mk.text.tokenizer import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_json  # noqa: E402

HISTORY_MESSAGES = (2, 8, 32, 64)  # of about 1,400 tokens each (the built-in tokenizer)
RUNS = 20


def conversation(n: int) -> list[dict]:
    """n alternating messages of code-like text, each unlike the others."""
    return [
        {
            "role": "user" if i % 2 == 0 else "assistant",
            "content": "\n".join(
                f"def step_{i}_{j}(x):\n    return x * {j} + {i}  # step {j} of {i}" for j in range(60)
            ),
        }
        for i in range(n)
    ]


def median_ms(fn) -> float:
    times = []
    for _ in range(RUNS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a checkpoint folder whose tokenizer to use (default: the built-in model's)")
    p.add_argument("--json", default="bench-out/chat_tokens.json")
    args = p.parse_args()
    tok = Tokenizer.from_dir(args.model or Path(mk.__file__).parent / "embedded")
    if tok._segments is None:
        sys.exit("this tokenizer is not one the segment cache is exact for: nothing to compare")
    rows = []
    for n in HISTORY_MESSAGES:
        history = conversation(n)
        tok.encode(tok.apply_chat_template(history), add_special_tokens=False)  # the previous turn
        text = tok.apply_chat_template([*history, {"role": "user", "content": "and now test it, please"}])
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == tok.hf.encode(text, add_special_tokens=False).ids
        full = median_ms(lambda text=text: tok.hf.encode(text, add_special_tokens=False))
        cached = median_ms(lambda text=text: tok.encode(text, add_special_tokens=False))
        rows.append({"messages": n + 1, "tokens": len(ids), "full_ms": full, "cached_ms": cached})
    print_table(f"tokenizing a next turn's prompt (CPU, median of {RUNS})", rows, list(rows[0]))
    write_json(args.json, "chat_tokens", rows)


if __name__ == "__main__":
    main()
