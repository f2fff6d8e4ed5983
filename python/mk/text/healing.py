"""Token healing: a text prompt that ends where a longer token could start is backed up by its last
token(s), and the first generated tokens are held to text that begins with what was removed.

A byte-level BPE merges text greedily, so a prompt ending in a bare token (a newline, whose usual token
carries the next line's indentation with it) puts the model at a boundary it rarely saw in training;
the built-in model answers such a prompt with a code fence and EOS. Healing gives the model the
prompt without that tail and lets it choose the token that covers it: the removed text becomes a
`prefix` constraint the engine enforces token by token (llguidance's masks, drawn on the GPU by the
megakernel or on the host), so at each step only tokens whose text is consistent with what is left of
the removed text (the token starts with it, or it starts with the token) may be drawn; once it is
covered, the engine drops the constraint (rust/grammar `Constraint::released`), and the request
decodes as one without a grammar. The removed text belongs to the prompt: callers strip it from the
generated text (`HealedText`) before stop strings see it.

Healing applies to a request without a grammar of its own (it would have to be joined to the prefix)
and without `ignore_eos` (what benchmarks send, to time outputs of a fixed length: taken as given),
whose stop token ids cannot stop it inside the removed text, on a byte-level tokenizer (whose token texts
join byte for byte to the decoded text). Token-id prompts are taken as given: callers heal text only.
"""

from __future__ import annotations

import bisect
import threading
import weakref
from dataclasses import dataclass, replace

from mk.engine.sampling import ConstraintSpec, SamplingParams
from mk.text.tokenizer import Tokenizer

# Prompt tokens backed up at most. The longest tail (up to this many text tokens) that some longer
# token starts with is removed: two covers a word split across tokens (" retu" as " ret" + "u",
# which the model saw as one " return") as well as a bare newline or space.
MAX_HEALED_TOKENS = 2
# Where the removed text came from, in a constraint error.
ORIGIN = "token healing"


@dataclass(frozen=True, slots=True)
class Healing:
    """A healed prompt: `prompt` (the ids less the backed-up tokens) continued under `constraint`,
    whose output begins with `removed` (the backed-up tokens' text, which the caller's prompt holds)."""

    prompt: list[int]
    removed: str
    constraint: ConstraintSpec

    def params(self, params: SamplingParams) -> SamplingParams:
        """`params` with the healing grammar (a request that has a grammar of its own is not healed)."""
        return replace(params, constraint=self.constraint)


def back_up(tokenizer: Tokenizer, ids: list[int]) -> tuple[list[int], str] | None:
    """(the ids less their last 1 to MAX_HEALED_TOKENS tokens, those tokens' text) for the longest
    such tail of text tokens that some vocabulary token strictly extends, or None where no tail is
    (or the tokenizer is not byte-level). At least one token is kept; a tail that is not whole UTF-8
    characters is not removed."""
    if not tokenizer.byte_level:
        return None
    index = _TokenIndex.of(tokenizer)
    tail, found = b"", None
    for k in range(1, min(MAX_HEALED_TOKENS, len(ids) - 1) + 1):
        token = ids[-k]
        if token in tokenizer.special_ids:
            break
        tail = tokenizer.token_bytes(token) + tail
        if index.extended(tail):
            try:
                found = (k, tail.decode("utf-8"))
            except UnicodeDecodeError:
                continue
    if found is None:
        return None
    k, text = found
    return list(ids[:-k]), text


def warm_up(tokenizer: Tokenizer) -> None:
    """Indexes the tokenizer's vocabulary for `back_up` now (it takes a while for a large vocabulary),
    so that the first request does not wait for it."""
    if tokenizer.byte_level:
        _TokenIndex.of(tokenizer)


def heal(tokenizer: Tokenizer, ids: list[int], params: SamplingParams) -> Healing | None:
    """The healing of a text prompt's `ids` under `params`, or None where healing does not apply (the
    module's docstring) or cannot change the result (`back_up`)."""
    if params.constraint is not None or params.ignore_eos or tokenizer.eos_token_id is None:
        return None
    cut = back_up(tokenizer, ids)
    if cut is None:
        return None
    prompt, removed = cut
    raw = removed.encode("utf-8")
    # A stop token inside the removed text would end the request on text the prompt already holds.
    for t in params.stop_token_ids:
        if t not in tokenizer.special_ids and (piece := tokenizer.token_bytes(t)) and piece in raw:
            return None
    return Healing(prompt, removed, healing_constraint(removed))


def healing_constraint(removed: str) -> ConstraintSpec:
    """The constraint of a healed request: output that begins with `removed`, free after it."""
    return ConstraintSpec("prefix", removed, origin=ORIGIN)


class HealedText:
    """Generated text, streamed, less the removed text it begins with (the prompt holds it)."""

    def __init__(self, removed: str) -> None:
        self.left = removed

    def push(self, text: str) -> str:
        if not self.left or not text:
            return text
        n = min(len(text), len(self.left))
        if text[:n] != self.left[:n]:  # not under the healing grammar (it failed): keep everything
            self.left = ""
            return text
        self.left = self.left[n:]
        return text[n:]


def strip_healed(text: str, removed: str) -> str:
    """A whole generated text less the removed text it begins with."""
    return HealedText(removed).push(text)


def prompt_bytes_left(tokenizer: Tokenizer, token_ids: list[int], prompt_bytes: int) -> int:
    """Bytes of the removed text still to be covered after `token_ids` (their text's bytes; special
    tokens have none), from `prompt_bytes` before them."""
    for t in token_ids:
        if prompt_bytes <= 0:
            break
        if t not in tokenizer.special_ids:
            prompt_bytes -= len(tokenizer.token_bytes(t))
    return max(0, prompt_bytes)


class _TokenIndex:
    """The bytes of every text token of a tokenizer, sorted: the tokens that start with some bytes
    follow those bytes' place in the order, so whether one strictly extends them is one bisection."""

    _built: weakref.WeakKeyDictionary[Tokenizer, _TokenIndex] = weakref.WeakKeyDictionary()
    _lock = threading.Lock()

    def __init__(self, tokenizer: Tokenizer) -> None:
        special = tokenizer.special_ids
        pieces = (tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size) if i not in special)
        self.sorted = sorted({p for p in pieces if p})

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> _TokenIndex:
        with cls._lock:  # (the server tokenizes on several threads)
            index = cls._built.get(tokenizer)
            if index is None:
                index = cls._built[tokenizer] = cls(tokenizer)
            return index

    def extended(self, prefix: bytes) -> bool:
        """Some token's bytes start with `prefix` and are longer."""
        i = bisect.bisect_right(self.sorted, prefix)
        return i < len(self.sorted) and self.sorted[i].startswith(prefix)
