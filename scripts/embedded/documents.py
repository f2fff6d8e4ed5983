"""The training documents built from a corpus: raw files, each fit function alone, chat examples and
tool-call conversations in mk's chat template (`build_documents`); the tools offered (`TOOLS`)."""

from __future__ import annotations

import ast
import hashlib
import json
import random
from dataclasses import dataclass

from mk.text import tokenizer_files

from .corpus import SITE, Corpus, Function

# The code of a request is fenced: a user turn that ended with a bare docstring and its newline taught
# the model that EOS (<|END_OF_TURN_TOKEN|>) follows a docstring's newline, which is how the completion
# test's prompts end (every first token was EOS).
CHAT_ASKS = (
    "```python\n{code}```",
    "Complete this Python function:\n\n```python\n{code}```",
    "Write the body of `{name}`.\n\n```python\n{code}```",
    "Implement the following function.\n\n```python\n{code}```",
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a source file of the Python standard library.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_python",
            "description": "Run a Python snippet and return what it prints.",
            "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search_stdlib",
            "description": "List the standard-library files that mention a name.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "list_directory",
            "description": "List the modules of a standard-library package.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    },
]
TOOL_NAMES = frozenset(t["function"]["name"] for t in TOOLS)


def _pick(key: str, n: int) -> int:
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % n


def _summary(fn: Function) -> str:
    doc = ast.get_docstring(ast.parse(fn.source).body[0]) or ""
    return (doc.strip().split("\n")[0].strip() or f"it is the function {fn.name}").rstrip(".") + "."


# "Write a Python function ..." requests: the function's docstring summary as the task, the whole
# function as the answer.
WRITE_ASKS = (
    "Write a Python function that does this: {summary}",
    "Write a Python function `{name}`. {summary}",
    "Write a Python function. {summary}",
)


def chat_example(fn: Function) -> str:
    """One chat conversation for a training function: its prompt as the user turn and its body as the
    answer, or (one in two) a request to write it from its summary, answered with the function in a
    fenced block."""
    key = f"{fn.path}:{fn.lineno}"
    if _pick(key + "/write", 2):
        ask = WRITE_ASKS[_pick(key, len(WRITE_ASKS))].format(summary=_summary(fn), name=fn.name)
        answer = {"role": "assistant", "content": f"```python\n{fn.source}```"}
        reasoning = f"`{fn.name}`: {_summary(fn)} I write the function."
    else:
        ask = CHAT_ASKS[_pick(key, len(CHAT_ASKS))].format(code=fn.prompt, name=fn.name)
        answer = {"role": "assistant", "content": fn.body}
        reasoning = f"`{fn.name}`: {_summary(fn)} I write its body."
    if _pick(key + "/think", 2):
        answer["reasoning"] = reasoning
    return tokenizer_files.render_chat([{"role": "user", "content": ask}, answer])


def _call(i: int, name: str, **params) -> dict:
    return {"id": str(i), "type": "function", "function": {"name": name, "arguments": params}}


def import_path(path: str, site: bool) -> str:
    """A corpus path as the module's import path: a site-packages corpus files every module under its
    distribution's folder (scripts/code_corpus.py), which is no part of the name. Shown with it (a
    question about `networkx.networkx.algorithms`, a read_file of networkx/networkx/...), the repeated
    folder made a model loop while copying the path into its answer (most of its malformed tool
    calls)."""
    return path.split("/", 1)[1] if site and "/" in path else path


def tool_prompt(fn: Function, site: bool) -> list[dict]:
    """The user turn of a read_file conversation (used for training and, on held-out functions, for eval)."""
    module = import_path(fn.path, site)[:-3].replace("/", ".").removesuffix(".__init__")
    return [{"role": "user", "content": f"What does `{fn.name}` in the `{module}` module do? Look it up."}]


def tool_examples(corpus: Corpus, count: int, seed: int) -> list[str]:
    """`count` tool-call conversations in the template's format, built from the training files (paths
    and modules as imported: `import_path`)."""
    rng = random.Random(seed)
    site = corpus.root == SITE

    def shown(path: str) -> str:
        return import_path(path, site)

    fns = sorted(corpus.train_functions, key=lambda f: (f.path, f.lineno))
    files = sorted(shown(p) for p in corpus.train)
    packages = sorted({p.rsplit("/", 1)[0] for p in files if "/" in p})

    if not fns:
        return []
    out = []
    for i in range(count):
        kind = i % 5
        if kind == 0:  # read a file, answer from it
            fn = rng.choice(fns)
            msgs = tool_prompt(fn, site) + [
                {
                    "role": "assistant",
                    "content": f"I will read {shown(fn.path)} and find `{fn.name}`.",
                    "tool_calls": [_call(0, "read_file", path=shown(fn.path))],
                },
                {"role": "tool", "tool_call_id": "0", "content": fn.prompt},
                {"role": "assistant", "content": f"`{fn.name}` ({shown(fn.path)}): {_summary(fn)}"},
            ]
        elif kind == 1:  # run code
            a, b = rng.randint(2, 999), rng.randint(2, 99)
            op = rng.choice(["+", "-", "*", "//", "%", "**"])
            if op == "**":
                b = rng.randint(2, 6)
            expr = f"{a} {op} {b}"
            value = eval(expr)  # noqa: S307 - integers and an operator chosen above
            msgs = [
                {"role": "user", "content": f"What is {expr} in Python?"},
                {
                    "role": "assistant",
                    "content": "I will run it.",
                    "tool_calls": [_call(0, "run_python", code=f"print({expr})")],
                },
                {"role": "tool", "tool_call_id": "0", "content": f"{value}\n"},
                {"role": "assistant", "content": f"`{expr}` is {value}."},
            ]
        elif kind == 2:  # search
            fn = rng.choice(fns)
            hits = sorted(shown(p) for p, t in corpus.train.items() if fn.name in t)[:4]
            msgs = [
                {"role": "user", "content": f"Which standard-library files mention `{fn.name}`?"},
                {
                    "role": "assistant",
                    "content": "I will search the library.",
                    "tool_calls": [_call(0, "search_stdlib", query=fn.name)],
                },
                {"role": "tool", "tool_call_id": "0", "content": json.dumps(hits)},
                {"role": "assistant", "content": f"`{fn.name}` appears in " + ", ".join(hits) + "."},
            ]
        elif kind == 3 and packages:  # list a package
            pkg = rng.choice(packages)
            mods = sorted(p.rsplit("/", 1)[1] for p in files if p.rsplit("/", 1)[0] == pkg)
            msgs = [
                {"role": "user", "content": f"Which modules does the `{pkg.replace('/', '.')}` package have?"},
                {
                    "role": "assistant",
                    "content": f"I will list {pkg}.",
                    "tool_calls": [_call(0, "list_directory", path=pkg)],
                },
                {"role": "tool", "tool_call_id": "0", "content": json.dumps(mods)},
                {"role": "assistant", "content": f"{len(mods)} modules: " + ", ".join(mods) + "."},
            ]
        else:  # two calls in one action block
            f1, f2 = rng.choice(fns), rng.choice(fns)
            msgs = [
                {"role": "user", "content": f"Compare `{f1.name}` and `{f2.name}`."},
                {
                    "role": "assistant",
                    "content": f"I will read {shown(f1.path)} and {shown(f2.path)}.",
                    "tool_calls": [
                        _call(0, "read_file", path=shown(f1.path)),
                        _call(1, "read_file", path=shown(f2.path)),
                    ],
                },
                {"role": "tool", "tool_call_id": "0", "content": f1.prompt},
                {"role": "tool", "tool_call_id": "1", "content": f2.prompt},
                {"role": "assistant", "content": f"`{f1.name}`: {_summary(f1)} `{f2.name}`: {_summary(f2)}"},
            ]
        out.append(tokenizer_files.render_chat(msgs, tools=TOOLS))
    return out


def cut_example(fn: Function) -> tuple[str, str]:
    """`fn`'s source cut in two where a prompt may end: at one of its prompt forms (the docstring's
    closing quotes, its newline, the next line's indentation) or at a character of its body, picked
    from its place. Tokenized half by half, it shows the model the tokens a prompt that ends there
    gives (a bare newline, then the indentation's own tokens), which whole files never hold: their
    newline and the next line's indentation are one token."""
    key = f"cut:{fn.path}:{fn.name}:{fn.lineno}"
    forms = list(fn.prompt_forms().values())
    choice = _pick(key, len(forms) + 1)
    cut = len(forms[choice]) if choice < len(forms) else len(fn.prompt) + _pick(key + ":body", len(fn.body))
    return fn.source[:cut], fn.source[cut:]


@dataclass
class Documents:
    code: list[str]  # raw source files (tokenized as BOS + text + EOS)
    functions: list[str]  # the fit training functions alone, dedented (tokenized as code)
    cut: list[tuple[str, str]]  # the same functions cut in two by `cut_example` (each half tokenized alone)
    chat: list[str]  # rendered conversations (they carry their own BOS and end with EOS)
    tools: list[str]  # distinct tool conversations (repeated in the stream)


def build_documents(corpus: Corpus, tool_count: int, seed: int) -> Documents:
    return Documents(
        code=list(corpus.train.values()),
        functions=[f.source for f in corpus.train_functions],
        cut=[cut_example(f) for f in corpus.train_functions],
        chat=[chat_example(f) for f in corpus.train_functions],
        tools=tool_examples(corpus, tool_count, seed),
    )
