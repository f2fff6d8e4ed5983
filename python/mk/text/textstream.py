"""Generated token ids to text, incrementally: never a broken UTF-8 character, never a partial stop string."""

from __future__ import annotations

import codecs
from collections.abc import Collection

from mk.text.tokenizer import Tokenizer

# Tokens decoded again before the new ones, so merges and leading spaces come out as in a full decode.
_CONTEXT_TOKENS = 6


class Detokenizer:
    """Feed token ids one by one; get the text they add.

    Byte-level tokenizers (GPT-2 style BPE, Cohere's) go through an incremental UTF-8 decoder: only a
    character still missing bytes is held, and invalid bytes come out as U+FFFD at once. Other
    tokenizers re-decode a short window and hold text while it ends in U+FFFD.
    """

    def __init__(self, tokenizer: Tokenizer, keep_special: Collection[str] | None = None) -> None:
        """`keep_special`: the special tokens whose text comes out (the others add none, as vLLM's
        skip_special_tokens); None: all of them."""
        self.tok = tokenizer
        kept = {tokenizer.hf.token_to_id(t) for t in keep_special or ()}
        self.hidden = frozenset() if keep_special is None else tokenizer.special_ids - kept
        self.ids: list[int] = []
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace") if tokenizer.byte_level else None
        self._prefix = 0  # decode window start
        self._read = 0  # ids before this are already emitted

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        if self._utf8 is not None:
            if token_id in self.hidden:
                return ""
            return self._utf8.decode(self.tok.token_bytes(token_id))
        return self._advance(final=False)

    def flush(self) -> str:
        """The held text at the end of the stream (a genuinely broken tail decodes as U+FFFD)."""
        if self._utf8 is not None:
            return self._utf8.decode(b"", final=True)
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read == len(self.ids):
            return ""
        before = self._decode(self.ids[self._prefix : self._read])
        now = self._decode(self.ids[self._prefix :])
        if not final and (now.endswith("\ufffd") or len(now) <= len(before)):
            return ""
        new = now[len(before) :]
        self._read = len(self.ids)
        self._prefix = max(self._prefix, self._read - _CONTEXT_TOKENS)
        return new

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode([i for i in ids if i not in self.hidden])


class StopMatcher:
    """Cuts a text stream at the first stop string, holding back any tail that could begin one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""
        self.matched: str | None = None

    def push(self, text: str) -> str:
        """The text that is safe to emit; after a match, nothing more."""
        if self.matched is not None:
            return ""
        buf = self._held + text
        if not self.stops:
            return buf
        hits = [(i, s) for s in self.stops if (i := buf.find(s)) >= 0]
        if hits:
            i, self.matched = min(hits)
            self._held = ""
            return buf[:i]
        keep = max((_overlap(buf, s) for s in self.stops), default=0)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        out, self._held = self._held, ""
        return "" if self.matched is not None else out


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `stop`."""
    for n in range(min(len(text), len(stop) - 1), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
