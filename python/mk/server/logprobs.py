"""Token log-probabilities in the two OpenAI shapes (chat's `content` list, completions' parallel lists)."""

from __future__ import annotations

from typing import Any

from mk.text.tokenizer import Tokenizer

Token = tuple[int, float | None, tuple[tuple[int, float], ...] | None]


def _entry(tokenizer: Tokenizer, token_id: int, logprob: float) -> dict[str, Any]:
    raw = tokenizer.token_bytes(token_id)
    return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}


def chat_logprobs(tokenizer: Tokenizer, tokens: list[Token]) -> dict[str, Any]:
    content = []
    for token_id, logprob, top in tokens:
        entry = _entry(tokenizer, token_id, logprob if logprob is not None else 0.0)
        entry["top_logprobs"] = [_entry(tokenizer, t, lp) for t, lp in top or ()]
        content.append(entry)
    return {"content": content}


def completion_logprobs(
    tokenizer: Tokenizer, tokens: list[Token], offset: int, prompt_bytes: int = 0
) -> dict[str, Any]:
    """`offset`: where the first token's text starts in the choice's text. The entries are the tokens
    the text is made of: a special token (EOS among them) adds no text and gets no entry, as in chat's
    logprobs, so that the tokens join to the text and `text_offset` indexes into it. `prompt_bytes`:
    how much of these tokens' text, from their start, is token healing's removed text (mk.text.healing),
    which the prompt holds and the choice's text leaves out: those tokens keep their entries with that
    text cut off their `tokens` (possibly to ""); their `top_logprobs` name the model's alternatives by
    their whole text, and the sampled token (also) by its cut text, as `tokens` does."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, logprob, top in tokens:
        if token_id in tokenizer.special_ids:
            continue
        raw = tokenizer.token_bytes(token_id)
        text = raw[prompt_bytes:].decode("utf-8", errors="replace")
        prompt_bytes = max(0, prompt_bytes - len(raw))
        out["tokens"].append(text)
        out["token_logprobs"].append(logprob)
        alternatives = {tokenizer.token_bytes(t).decode("utf-8", errors="replace"): lp for t, lp in top or ()}
        alternatives.setdefault(text, logprob)  # the sampled token's too: up to logprobs + 1 (OpenAI's, vLLM's)
        out["top_logprobs"].append(alternatives)
        out["text_offset"].append(offset)
        offset += len(text)
    return out
