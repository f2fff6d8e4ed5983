"""POST /tokenize and /detokenize (vLLM's): a prompt or a conversation to the token ids the generation
routes would give the engine (the same chat template and encoding), and token ids back to text."""

from __future__ import annotations

from typing import Any

from mk.server.chat import render_chat
from mk.server.errors import bad_request
from mk.server.http import parse_json
from mk.server.schemas import DetokenizeRequest, TokenizeRequest, validate
from mk.server.state import ServerState

# Fields that shape a rendered conversation, so that they mean nothing beside a `prompt`.
_CHAT_ONLY = ("tools", "chat_template_kwargs", "add_generation_prompt")


async def tokenize(state: ServerState, body: bytes, info: dict) -> dict[str, Any]:
    return await state.offload.run(len(body), _tokenize, state, body)


async def detokenize(state: ServerState, body: bytes, info: dict) -> dict[str, Any]:
    return await state.offload.run(len(body), _detokenize, state, body)


def _tokenize(state: ServerState, body: bytes) -> dict[str, Any]:
    """The ids of the prompt, or of the conversation as its template renders it; not held to the
    context (counting a prompt that would not fit is what a client asks this for)."""
    req = validate(TokenizeRequest, parse_json(body))
    state.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("send either 'prompt' or 'messages'", "prompt" if req.prompt is None else "messages")
    tokenizer = state.tokenizer
    if req.prompt is not None:
        for name in _CHAT_ONLY:
            if name in req.model_fields_set:
                raise bad_request(f"{name} applies to 'messages', not to a 'prompt'", name)
        text, special = req.prompt, req.add_special_tokens is not False
    else:
        text, _ = render_chat(
            tokenizer, req.messages, req.tools, None, req.chat_template_kwargs, req.add_generation_prompt
        )
        special = bool(req.add_special_tokens)  # the template wrote its own BOS
    ids = tokenizer.encode(text, add_special_tokens=special)
    strs = [tokenizer.hf.id_to_token(i) for i in ids] if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": state.engine.max_context, "tokens": ids, "token_strs": strs}


def _detokenize(state: ServerState, body: bytes) -> dict[str, Any]:
    """The text of the ids, special tokens included (so that /tokenize's ids come back as their text)."""
    req = validate(DetokenizeRequest, parse_json(body))
    state.check_model(req.model)
    vocab = state.tokenizer.vocab_size
    for i, token in enumerate(req.tokens):
        if not 0 <= token < vocab:
            raise bad_request(f"tokens[{i}] = {token} is outside the vocabulary [0, {vocab})", "tokens")
    return {"prompt": state.tokenizer.decode(req.tokens)}
