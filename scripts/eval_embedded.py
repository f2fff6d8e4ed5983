"""The built-in model's quality bars, on shipped weights through `mk.LLM`, on packages it never saw.

Prompts come from held-out packages of the machine's installed ones (scripts/code_corpus.py finds their
files; the functions are those train_embedded.py's completion test takes: a docstring, 2-30 body lines,
at most 4 per file, picked by hash). Greedy throughout.

- completion: signature + docstring (ending at the closing quotes) continued up to 96 tokens; counts when
  prompt + continuation, cut where the function ends, parses as one function with a body;
- first token after a docstring: the same prompts ending with the docstring's newline; the share whose
  first token is EOS (the bar: none);
- prompt forms: the completion again from the prompts users type (`Function.prompt_forms`: ending at the closing
  quotes, after the docstring's newline, after the next line's indentation), each counted as the
  completion is, and an answer that starts with a code fence or has an empty body as a failure (token
  healing, mk.LLM's default, is what makes the last two work: mk/text/healing.py);
- loops: of the completions, the share in which no non-blank line repeats more than 3 times;
- chat: 20 "Write a Python function that ..." requests through the chat template; counts when the answer
  (its first ```python block if it has one) parses and defines a function;
- tools: "what does `f` in module m do? Look it up." with train_embedded's four tools offered; counts a
  well-formed action block calling one of them.

  python scripts/eval_embedded.py --held-out networkx,jinja2 [--model DIR] [--json out.json]
Prints a table and writes JSON (rates and every prompt's output).
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


sys.path.insert(0, str(HERE))  # its siblings, imported by name (once)
import code_corpus as cc  # noqa: E402
from embedded.corpus import pick_test_functions  # noqa: E402
from embedded.documents import TOOLS, tool_prompt  # noqa: E402
from embedded.evaluation import action_ok, cut_completion, parses_with_body  # noqa: E402
from embedded.unlikelihood import loop_free  # noqa: E402

MAX_NEW = 96
CHAT_TASKS = (
    "reverses a string",
    "returns the factorial of n",
    "checks whether a number is prime",
    "counts the vowels in a string",
    "returns the largest element of a list",
    "merges two sorted lists into one sorted list",
    "removes duplicates from a list, keeping the order",
    "returns the n-th Fibonacci number",
    "checks whether a string is a palindrome",
    "sums the digits of an integer",
    "converts Celsius to Fahrenheit",
    "returns the words of a sentence in reverse order",
    "flattens a list of lists",
    "counts how often each word occurs in a text",
    "returns the greatest common divisor of two integers",
    "checks whether two strings are anagrams",
    "returns the squares of the even numbers in a list",
    "capitalizes the first letter of every word",
    "returns the second largest number in a list",
    "reads a text file and returns its number of lines",
)


def held_out_functions(held: list[str], count: int) -> list:
    """Up to `count` completion-test functions of the held-out packages, in hash order."""
    packages = [p for p in cc.installed_packages() if p.name in held]
    missing = set(held) - {p.name for p in packages}
    if missing:
        raise SystemExit(f"not installed here: {', '.join(sorted(missing))}")
    files = {path: text for texts in cc.build(packages, set(held)).held_out.values() for path, text in texts.items()}
    return pick_test_functions(files, count)  # the functions training held out, if it held these out


def form_ok(head: str, text: str, stopped: bool) -> bool:
    """A completion of `head` that parses as a function with a body, neither a code fence nor empty."""
    body = cut_completion(text, stopped)
    return not text.lstrip().startswith("```") and bool(body.strip()) and parses_with_body(head + body)


def chat_code(answer: str) -> bool:
    """The answer (its first fenced block, if any) parses and defines a function."""
    m = re.search(r"```(?:python)?\n(.*?)```", answer, re.DOTALL)
    code = m.group(1) if m else answer
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return False
    return any(isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) for n in ast.walk(tree))


def evaluate(llm, fns: list) -> dict:
    import mk

    tok, eos = llm._text, llm.model.config.eos_token_id
    greedy = mk.SamplingParams(max_tokens=MAX_NEW, temperature=0)

    def raw(out) -> str:  # the chat and tool answers' structure is in their special tokens
        return tok.decode(out.outputs[0].token_ids, skip_special_tokens=False)

    heads = [f.prompt_forms()["quotes"] for f in fns]
    completions = llm.generate(heads, greedy, use_tqdm=False)
    rows = []
    for f, head, out in zip(fns, heads, completions, strict=True):
        o = out.outputs[0]
        body = cut_completion(o.text, o.finish_reason == "stop")
        rows.append(
            {
                "name": f"{f.path}:{f.name}",
                "ok": parses_with_body(head + body),
                "loop_free": loop_free(o.text),
                "text": o.text,
            }
        )
    forms = {}
    for form in ("newline", "indent"):
        form_heads = [f.prompt_forms()[form] for f in fns]
        outs = llm.generate(form_heads, greedy, use_tqdm=False)
        stopped = [o.outputs[0].finish_reason == "stop" for o in outs]
        texts = [o.outputs[0].text for o in outs]
        oks = [form_ok(h, t, s) for h, t, s in zip(form_heads, texts, stopped, strict=True)]
        forms[form] = sum(oks) / max(1, len(oks))
    first = llm.generate([f.prompt for f in fns], mk.SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    eos_first = [bool(o.outputs[0].token_ids) and o.outputs[0].token_ids[0] == eos for o in first]

    chat_prompts = [
        tok.apply_chat_template([{"role": "user", "content": f"Write a Python function that {task}."}])
        for task in CHAT_TASKS
    ]
    chat_params = mk.SamplingParams(max_tokens=2 * MAX_NEW, temperature=0)
    chats = llm.generate([tok.encode(p, add_special_tokens=False) for p in chat_prompts], chat_params, use_tqdm=False)
    chat_rows = []
    for task, out in zip(CHAT_TASKS, chats, strict=True):
        text = raw(out)
        answer = text.split("<|START_RESPONSE|>", 1)[-1].split("<|END_RESPONSE|>", 1)[0]
        chat_rows.append({"task": task, "ok": "<|START_RESPONSE|>" in text and chat_code(answer), "text": text})

    # Held-out functions come from a site-packages corpus: their modules as imported (embedded.documents.import_path).
    tool_prompts = [tok.apply_chat_template(tool_prompt(f, site=True), tools=TOOLS) for f in fns]
    tools = llm.generate([tok.encode(p, add_special_tokens=False) for p in tool_prompts], greedy, use_tqdm=False)
    tool_ok = [action_ok(raw(o)) for o in tools]

    def share(values) -> float:
        values = list(values)
        return sum(values) / max(1, len(values))

    return {
        "functions": len(fns),
        "completion_parses": share(r["ok"] for r in rows),
        "completion_parses_after_newline": forms["newline"],
        "completion_parses_after_indent": forms["indent"],
        "first_token_eos": share(eos_first),
        "loop_free": share(r["loop_free"] for r in rows),
        "chat_parses": share(r["ok"] for r in chat_rows),
        "tool_calls_well_formed": share(tool_ok),
        "rows": rows,
        "chat": chat_rows,
    }


BARS = (
    ("completion_parses", ">= 0.40"),
    ("completion_parses_after_newline", ">= quotes"),
    ("completion_parses_after_indent", ">= quotes"),
    ("first_token_eos", "== 0"),
    ("loop_free", ">= 0.90"),
    ("chat_parses", ">= 0.30"),
    ("tool_calls_well_formed", ">= 0.90"),
)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--held-out", required=True, help="comma-separated packages the model never saw")
    p.add_argument("--model", help="a checkpoint folder (default: the built-in model)")
    p.add_argument("--functions", type=int, default=40, help="completion prompts (default: %(default)s)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when there is one)")
    p.add_argument("--json", help="write the figures and every output here")
    args = p.parse_args(argv)
    import mk

    held = [h.strip().lower() for h in args.held_out.split(",") if h.strip()]
    fns = held_out_functions(held, args.functions)
    with mk.LLM(args.model, device=args.device) as llm:
        result = evaluate(llm, fns)
    result["held_out"] = held
    print(f"{'bar':>32} {'value':>7} {'target':>8}")
    for name, target in BARS:
        print(f"{name:>32} {result[name]:>7.2f} {target:>8}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
