"""POST /tokenize and /detokenize (vLLM's) against a real `python -m mk.server` on the built-in model: the
ids are the ones the generation routes give the engine (their usage counts them), ids come back as their
text, and bad input is a 400 naming its field."""

import httpx
import pytest

from mk.default_model import NAME, load_default

TOK = load_default()[1]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write a loop."}]
NO_THINKING = {"enable_thinking": False}


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def ok(server, path: str, body: dict) -> dict:
    r = post(server, path, body)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_prompt_is_tokenized_as_completions_tokenize_it(server):
    prompt = "def add(a, b):\n    return a + b\n"
    out = ok(server, "/tokenize", {"model": NAME, "prompt": prompt})
    assert out["tokens"] == TOK.encode(prompt)
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == 1024
    assert out["tokens"][0] == TOK.hf.token_to_id(TOK.bos_token)  # the BOS a completion's prompt gets
    used = ok(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1})["usage"]["prompt_tokens"]
    assert out["count"] == used
    bare = ok(server, "/tokenize", {"prompt": prompt, "add_special_tokens": False})
    assert bare["tokens"] == out["tokens"][1:]


def test_messages_are_tokenized_as_the_chat_route_renders_them(server):
    for kwargs in ({}, {"chat_template_kwargs": NO_THINKING}):
        out = ok(server, "/tokenize", {"messages": MESSAGES, **kwargs})
        chat = {"messages": MESSAGES, "max_tokens": 1, **kwargs}
        assert out["count"] == ok(server, "/v1/chat/completions", chat)["usage"]["prompt_tokens"]
        text = TOK.apply_chat_template(MESSAGES, **kwargs.get("chat_template_kwargs", {}))
        assert out["tokens"] == TOK.encode(text, add_special_tokens=False)  # the template wrote the BOS
    whole = ok(server, "/tokenize", {"messages": MESSAGES})
    turns = ok(server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
    assert whole["tokens"][: turns["count"]] == turns["tokens"] and whole["count"] > turns["count"]


def test_token_strings_on_request(server):
    out = ok(server, "/tokenize", {"prompt": "def f(x):", "return_token_strs": True})
    assert out["token_strs"] == [TOK.hf.id_to_token(i) for i in out["tokens"]]
    assert out["token_strs"][:2] == ["<BOS_TOKEN>", "def"]
    assert ok(server, "/tokenize", {"prompt": "x"})["token_strs"] is None


def test_detokenize_gives_back_the_text_of_tokenize(server):
    for prompt in ("def f(x):\n\treturn x  # caf\u00e9 \u4e16\u754c\U0001f642\n", "", " "):
        ids = ok(server, "/tokenize", {"prompt": prompt, "add_special_tokens": False})["tokens"]
        assert ok(server, "/detokenize", {"model": NAME, "tokens": ids}) == {"prompt": prompt}
    ids = ok(server, "/tokenize", {"messages": MESSAGES})["tokens"]
    assert ok(server, "/detokenize", {"tokens": ids})["prompt"] == TOK.apply_chat_template(MESSAGES)


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "x", "messages": MESSAGES}, "messages"),
        ("/tokenize", {"prompt": 3}, "prompt"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/tokenize", {"messages": [{"role": "pilot", "content": "x"}]}, "messages[0].role"),
        ("/tokenize", {"prompt": "x", "tools": []}, "tools"),
        ("/tokenize", {"prompt": "x", "add_generation_prompt": False}, "add_generation_prompt"),
        ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
        ("/tokenize", {"prompt": "x", "promt": "y"}, "promt"),
        ("/detokenize", {}, "tokens"),
        ("/detokenize", {"tokens": "1 2"}, "tokens"),
        ("/detokenize", {"tokens": [1, True]}, "tokens[1]"),
        ("/detokenize", {"tokens": [1, 2.0]}, "tokens[1]"),
        ("/detokenize", {"tokens": [5, TOK.vocab_size]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(server, path, body, param):
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert "Traceback" not in error["message"]


def test_an_id_outside_the_vocabulary_is_named_with_its_place(server):
    r = post(server, "/detokenize", {"tokens": [5, TOK.vocab_size]})
    assert f"tokens[1] = {TOK.vocab_size} is outside the vocabulary" in r.json()["error"]["message"]
