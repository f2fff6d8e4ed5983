"""Cohere cmd4 output -> OpenAI reasoning, content and tool-call deltas (mk.text.toolcalls), on crafted outputs."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mk.text.toolcalls import Cmd4Stream, ToolCallError, ToolPolicy, parse

CALLS = (
    "Look up both.<|END_THINKING|><|START_ACTION|>["
    '{"tool_call_id": "0", "tool_name": "get_weather", '
    '"parameters": {"city": "Paris", "days": [1, 2], "q": "a}\\"b"}}, '
    '{"tool_call_id": "1", "tool_name": "now", "parameters": {}}'
    "]<|END_ACTION|>"
)
ANSWER = "Hmm.<|END_THINKING|><|START_RESPONSE|>Use `x < y` here.<|END_RESPONSE|>"
POLICY = ToolPolicy(["get_weather", "now"])


def split(text: str, cuts: list[int]) -> list[str]:
    cuts = sorted(c % (len(text) + 1) for c in cuts)
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def test_whole_output_gives_reasoning_and_calls():
    s = parse(CALLS)
    assert s.reasoning == "Look up both." and s.content == ""
    assert [c.name for c in s.calls] == ["get_weather", "now"]
    assert json.loads(s.calls[0].arguments) == {"city": "Paris", "days": [1, 2], "q": 'a}"b'}
    assert s.calls[1].arguments == "{}"  # empty parameters still give a JSON object
    assert all(c.id.startswith("call_") for c in s.calls) and s.calls[0].id != s.calls[1].id
    POLICY.check_final(s)


def test_a_call_cut_off_before_its_arguments_keeps_none():
    """Cut off by max_tokens (complete=False), a named call is not made to look finished with `{}`."""
    cut = CALLS[: CALLS.index('"parameters"')]
    s = Cmd4Stream()
    s.feed(cut)
    s.finish(complete=False)
    assert [(c.name, c.arguments) for c in s.calls] == [("get_weather", "")]


def test_a_cut_off_output_is_held_to_its_call_names_only():
    cut = CALLS[: CALLS.index("Paris") + 2]  # the arguments are not JSON yet
    POLICY.check_final(parse(cut, complete=False))
    with pytest.raises(ToolCallError, match="not valid JSON"):
        POLICY.check_final(parse(cut))
    with pytest.raises(ToolCallError, match="not among"):
        ToolPolicy(["now"]).check_final(parse(cut, complete=False))


def test_answer_without_calls():
    s = parse(ANSWER)
    assert (s.reasoning, s.content, s.calls) == ("Hmm.", "Use `x < y` here.", [])
    assert parse("Just code:\n  x = 1", thinking=False).content == "Just code:\n  x = 1"


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 10_000), max_size=40))
def test_streamed_deltas_rebuild_the_calls_in_openai_order(cuts):
    """Any split of the text: each call's first delta carries id, type and name; later ones only arguments."""
    s = Cmd4Stream()
    deltas = [s.feed(piece) for piece in split(CALLS, cuts)] + [s.finish()]
    seen: dict[int, dict] = {}
    reasoning = ""
    for d in deltas:
        reasoning += d.reasoning
        assert not d.content
        for tc in d.tool_calls:
            i = tc["index"]
            if i not in seen:
                assert tc["id"].startswith("call_") and tc["type"] == "function" and tc["function"]["name"]
                seen[i] = {"id": tc["id"], "name": tc["function"]["name"], "args": tc["function"]["arguments"]}
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
                seen[i]["args"] += tc["function"]["arguments"]
    assert reasoning == "Look up both."
    assert [seen[i]["name"] for i in sorted(seen)] == ["get_weather", "now"]
    assert [seen[i]["id"] for i in sorted(seen)] == [c.id for c in s.calls]
    assert json.loads(seen[0]["args"]) == {"city": "Paris", "days": [1, 2], "q": 'a}"b'}
    assert json.loads(seen[1]["args"]) == {}


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 10_000), max_size=30))
def test_streamed_answer_matches_the_whole_parse(cuts):
    s = Cmd4Stream()
    deltas = [s.feed(p) for p in split(ANSWER, cuts)] + [s.finish()]
    assert "".join(d.reasoning for d in deltas) == "Hmm."
    assert "".join(d.content for d in deltas) == "Use `x < y` here."


def test_calls_are_dropped_when_tools_are_off():
    s = parse(CALLS, tools=False)
    assert s.calls == [] and s.reasoning == "Look up both."
    ToolPolicy([], "none").check_final(s)  # nothing to enforce


@pytest.mark.parametrize(
    "text,policy,message",
    [
        (CALLS, ToolPolicy(["now"]), "not among the request's tools"),
        (CALLS, ToolPolicy(["get_weather", "now"], "function", "now"), "tool_choice requires 'now'"),
        (ANSWER, ToolPolicy(["now"], "required"), "called no tool"),
        (ANSWER, ToolPolicy(["now"], "function", "now"), "called no tool"),
        ("x<|END_THINKING|><|START_ACTION|>not json<|END_ACTION|>", POLICY, "not valid JSON"),
        (
            'x<|END_THINKING|><|START_ACTION|>[{"tool_name": "now", "parameters": {}}]<|END_ACTION|>',
            POLICY,
            "no tool_call_id",
        ),
        (
            'x<|END_THINKING|><|START_ACTION|>[{"tool_call_id": "0", "tool_name": "now", "parameters": 5}]',
            POLICY,
            "not a JSON object",
        ),
    ],
)
def test_policy_violations_are_tool_call_errors(text, policy, message):
    with pytest.raises(ToolCallError, match=message):
        policy.check_final(parse(text))


def test_auto_with_a_plain_answer_is_fine():
    POLICY.check_final(parse(ANSWER))
    assert ToolPolicy(["now"]).calls_allowed and not ToolPolicy(["now"], "none").calls_allowed
