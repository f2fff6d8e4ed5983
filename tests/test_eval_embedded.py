"""The built-in model's quality harness (scripts/eval_embedded.py): its checks and its prompts."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


sys.path.insert(0, str(REPO / "scripts"))  # the scripts import each other by name
import eval_embedded as ev  # noqa: E402
from embedded.corpus import Function  # noqa: E402
from embedded.unlikelihood import loop_free  # noqa: E402

pytestmark = pytest.mark.slow  # (evaluates the built-in model over held-out packages)


def test_a_line_repeated_more_than_three_times_is_a_loop():
    """The harness counts loops with the recipe's rule (embedded.unlikelihood.loop_free, which its unlikelihood
    phase trains against)."""
    assert loop_free("a = 1\nb = 2\n\n\n\n\n")
    assert loop_free("import os\n" * 3 + "x = 1\n")
    assert not loop_free("import os\n" * 4)


def test_a_chat_answer_counts_when_its_code_defines_a_function():
    assert ev.chat_code("Here it is:\n```python\ndef f(s):\n    return s[::-1]\n```\nDone.")
    assert ev.chat_code("def f(s):\n    return s[::-1]\n")
    assert not ev.chat_code("```python\nprint(1)\n```")
    assert not ev.chat_code("def f(s) return s")


def test_held_out_prompts_are_functions_of_the_named_package():
    fns = ev.held_out_functions(["jinja2"], 6)
    assert len(fns) == 6 and all(f.path.startswith("jinja2/") for f in fns)
    for f in fns:  # a function with a docstring: its head is the prompt, the rest its body
        fn = ast.parse(f.source).body[0]
        assert ast.get_docstring(fn) is not None and f.source == f.prompt + f.body and f.body.strip()
    assert [f.name for f in ev.held_out_functions(["jinja2"], 6)] == [f.name for f in fns]  # deterministic
    assert len(ev.CHAT_TASKS) == 20


def test_the_prompt_forms_users_type_and_what_counts_as_a_completion_of_them():
    fn = Function("m.py", "add", 1, 'def add(a, b):\n    """Add."""\n', "    return a + b\n")
    forms = fn.prompt_forms()
    assert forms == {
        "quotes": 'def add(a, b):\n    """Add."""',
        "newline": 'def add(a, b):\n    """Add."""\n',
        "indent": 'def add(a, b):\n    """Add."""\n    ',
    }
    assert ev.form_ok(forms["newline"], "    return a + b\n", True)
    assert ev.form_ok(forms["indent"], "return a + b\n\nx = 1\n", False)
    assert not ev.form_ok(forms["newline"], "```\n", True), "a code fence is a failure"
    assert not ev.form_ok(forms["newline"], "\n\n", True), "an empty body is a failure"
    assert not ev.form_ok(forms["indent"], "return (a +\n", True)
