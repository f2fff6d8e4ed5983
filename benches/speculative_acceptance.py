"""How many tokens a decode step would gain with drafts taken from the conversation itself
(rust/speculative: the n-gram drafter and its adaptive length), for the built-in model on
code-editing prompts, on the CPU.

Each prompt is a held-out function (scripts/eval_embedded.py's: a docstring and 2-30 body lines,
from packages training never saw), an edit request as a comment, and the edited function's
signature and docstring, in three forms:
- rename: the same function under a new name;
- parameter: the same with one more keyword parameter (functions whose signature is on one line);
- diff: a unified diff that changes one body line, then the function after it.
The drafter is replayed over two outputs of each prompt (`source`): the model's own greedy
continuation (up to MAX_NEW tokens), and the edit itself (the function's body, edited as asked: what
a model that makes the edit writes; the built-in model, 16.6M parameters, mostly writes another
body). Each step it proposes up to MAX_DRAFT tokens from the prompt and the output so far, the step
accepts the longest prefix that matches the output and gains one token more. For greedy decoding
that is exactly what verification rows give (tests/test_speculative.py), so no verification runs
here.

Rows, per form and in all: prompts, generated tokens, steps, tokens gained per step, draft tokens
accepted per step, draft rows per step (the rows a launch would carry beside each sequence's own),
and the share of drafted tokens accepted.

Usage: python benches/speculative_acceptance.py [--held-out jinja2] [--count 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import eval_embedded  # noqa: E402

import mk  # noqa: E402
from common import print_table, write_json  # noqa: E402
from mk import _native  # noqa: E402

MAX_NEW = 128
NEW_NAME = "{}_edited"


def edits(fn) -> dict[str, tuple[str, str]]:
    """Each edit form that applies to `fn` (a scripts/embedded/corpus.py Function): its prompt, ending at
    the edited docstring's closing quotes (where the completion test ends its prompts), and the edit's
    own continuation (the body, edited as asked)."""
    renamed = fn.prompt.replace(f"def {fn.name}(", f"def {NEW_NAME.format(fn.name)}(", 1)
    body = "\n" + fn.body
    out = {"rename": (f"{fn.source}\n\n# {fn.name} again, renamed to {NEW_NAME.format(fn.name)}:\n{renamed}", body)}
    one_line = re.search(rf"^(\s*(?:async )?def {re.escape(fn.name)}\((.+)\))(\s*(->.*)?:)$", fn.prompt, re.M)
    if one_line and "*" not in one_line.group(2):
        head = one_line.group(1)
        wider = fn.prompt.replace(head, f"{head[:-1]}, verbose=False)", 1)
        out["parameter"] = (f"{fn.source}\n\n# {fn.name} again, with a keyword parameter verbose=False:\n{wider}", body)
    lines = [line for line in fn.body.splitlines() if line.strip() and not line.strip().startswith("#")]
    if lines:
        changed = lines[0]
        diff = f"--- a.py\n+++ b.py\n@@\n-{changed}\n+{changed}  # checked\n"
        prompt = f"{fn.source}\n\n# This diff applied to {fn.name}:\n{diff}\n# {fn.name} after it:\n{fn.prompt}"
        out["diff"] = (prompt, body.replace(changed, f"{changed}  # checked", 1))
    return {form: (prompt.removesuffix("\n"), edit) for form, (prompt, edit) in out.items()}


def replay(prompt: list[int], output: list[int]) -> dict[str, int]:
    """The steps that `output` takes with drafts, and the draft tokens tried and accepted."""
    speculator = _native.Speculator(prompt)
    pos = steps = drafted = accepted = 0
    while pos < len(output):
        draft = speculator.draft(_native.MAX_DRAFT)
        truth = output[pos : pos + len(draft)]
        a = next((i for i, (d, t) in enumerate(zip(draft, truth, strict=False)) if d != t), len(truth))
        gained = output[pos : pos + a + 1]
        speculator.advance(len(draft), gained)
        pos, steps, drafted, accepted = pos + len(gained), steps + 1, drafted + len(draft), accepted + a
    return {"tokens": len(output), "steps": steps, "drafted": drafted, "accepted": accepted}


def row(form: str, runs: list[dict[str, int]]) -> dict:
    total = {k: sum(r[k] for r in runs) for k in ("tokens", "steps", "drafted", "accepted")}
    steps = max(total["steps"], 1)
    return {
        "form": form,
        "prompts": len(runs),
        **total,
        "tokens_per_step": total["tokens"] / steps,
        "accepted_per_step": total["accepted"] / steps,
        "draft_rows_per_step": total["drafted"] / steps,
        "accepted_share": total["accepted"] / max(total["drafted"], 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--held-out", default="jinja2", help="packages the functions come from (default: %(default)s)")
    p.add_argument("--count", type=int, default=20, help="functions (default: %(default)s)")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()
    fns = eval_embedded.held_out_functions(args.held_out.split(","), args.count)
    llm = mk.LLM()
    cases = [(form, llm.encode(prompt), edit) for fn in fns for form, (prompt, edit) in edits(fn).items()]
    params = mk.SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    generated = llm.generate([ids for _, ids, _ in cases], params)
    rows = []
    for source in ("model", "edit"):
        runs: dict[str, list[dict[str, int]]] = {}
        for (form, ids, edit), out in zip(cases, generated, strict=True):
            edited = llm.tokenizer.encode(edit, add_special_tokens=False).ids[:MAX_NEW]
            output = list(out.outputs[0].token_ids) if source == "model" else edited
            runs.setdefault(form, []).append(replay(ids, output))
        rows += [{"source": source, **row(form, r)} for form, r in runs.items()]
        rows.append({"source": source, **row("all", [x for r in runs.values() for x in r])})
    columns = ["source", "form", "prompts", "tokens", "steps", "tokens_per_step", "accepted_per_step",
               "draft_rows_per_step", "accepted_share"]  # fmt: skip
    title = f"speculative acceptance: the built-in model's greedy output, and the edit itself, up to {MAX_NEW} tokens"
    print_table(title, rows, columns)
    if args.json:
        write_json(args.json, "speculative_acceptance", rows, held_out=args.held_out, max_new=MAX_NEW)


if __name__ == "__main__":
    main()
