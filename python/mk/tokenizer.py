"""The tokenizer of a checkpoint: `tokenizer.json` (HF tokenizers) plus `tokenizer_config.json` (special
tokens, chat template), with the chat template rendered the way HF `apply_chat_template` renders it."""

from __future__ import annotations

import functools
import json
import re
import threading
from collections import OrderedDict
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders


class TemplateError(ValueError):
    """The chat template refused the conversation (its `raise_exception`) or failed to render."""


class Tokenizer:
    """Encode, decode and render chats for one checkpoint."""

    def __init__(self, tokenizer: HFTokenizer, config: dict[str, Any]) -> None:
        self.hf = tokenizer
        self.config = config
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.eos_token_id = tokenizer.token_to_id(self.eos_token) if self.eos_token else None
        self.chat_template = config.get("chat_template")
        self.special_ids = frozenset(
            int(i) for i, t in (config.get("added_tokens_decoder") or {}).items() if t.get("special", False)
        ) | frozenset(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)
        self.byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)
        self._segments = _SegmentCache.for_tokenizer(tokenizer)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{path}: no tokenizer.json")
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        return cls(HFTokenizer.from_file(str(path / "tokenizer.json")), config)

    @classmethod
    def builtin(cls, vocab_size: int) -> Tokenizer:
        """The test tokenizer and Cohere-format template of mk.tokenizer_files."""
        from mk import tokenizer_files

        return cls(tokenizer_files.build_tokenizer(vocab_size), tokenizer_files.tokenizer_config())

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not add_special_tokens and self._segments is not None:
            return self._segments.encode(text)
        return self.hf.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a byte-level token may hold part of a UTF-8 character)."""
        piece = self.hf.id_to_token(token_id)
        if piece is None:
            return b""
        if self.byte_level and token_id not in self.special_ids:
            table = _unicode_to_byte()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        return self.hf.decode([token_id], skip_special_tokens=False).encode()

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """The prompt text of a conversation (it carries its own BOS: encode it without special tokens)."""
        template = self._pick_template(bool(tools))
        special = {k: _token_text(v) for k, v in self.config.items() if k.endswith("_token") and v is not None}
        return render_template(
            template, **special, **kwargs, messages=messages, tools=tools, add_generation_prompt=add_generation_prompt
        )

    def _pick_template(self, with_tools: bool) -> str:
        t = self.chat_template
        if isinstance(t, list):  # HF named templates: [{"name": ..., "template": ...}]
            named = {x["name"]: x["template"] for x in t}
            t = named.get("tool_use") if with_tools and "tool_use" in named else named.get("default")
        if not isinstance(t, str) or not t:
            raise TemplateError("this checkpoint has no chat template (tokenizer_config.json: chat_template)")
        return t


class _SegmentCache:
    """Encodes text (without post-processing) the way `tokenizers` does, a piece at a time: the added
    tokens it holds, and the text between them, each through a cache. A conversation's prompt is
    rendered again at every turn, and its earlier messages, separated by special tokens, come back
    unchanged: only the new ones are tokenized (a 4,000-token prompt takes ~4 ms to encode on one
    core, a 30,000-token history tens of ms of a next turn's time to first token).

    Exact only where `tokenizers` treats every piece between added tokens alone, which
    `for_tokenizer` checks: normalizers and pre-tokenizers that act on each piece by itself (none
    that adds a prefix space or treats the input's first piece apart), a model without dropout,
    added tokens that strip no neighbouring whitespace and match the raw text, and a probe of
    text next to the added tokens encoded both ways. Otherwise there is no cache."""

    # Cached text, in characters: the least recently used pieces go first past it.
    BUDGET_CHARS = 1 << 24
    # Shorter pieces cost less to encode than to look up and keep.
    MIN_CHARS = 64
    # Steps that act on each piece between added tokens alone, whatever came before it.
    PIECEWISE_NORMALIZERS = frozenset({"NFC", "NFD", "NFKC", "NFKD", "Lowercase"})
    PIECEWISE_PRE_TOKENIZERS = frozenset(
        {"ByteLevel", "Digits", "Split", "Punctuation", "Whitespace", "WhitespaceSplit"}
    )
    # Added tokens whose every neighbourhood the load-time probe tries (all of them meet once).
    PROBE_TOKENS = 64
    # Text around the added tokens in the probe: spaces, line breaks, digits, a combining accent,
    # characters outside the BMP.
    PROBE = ("", " ", "  x", "\n", "\n\n  def f():", "12 345", "e\u0301 caf\u00e9", "\u4e16\u754c\U0001f642", "\t!")

    def __init__(self, tokenizer: HFTokenizer, added: dict[str, int]) -> None:
        self.hf = tokenizer
        self.added = added
        # Leftmost-longest, as `tokenizers` matches added tokens.
        self.split = re.compile("(" + "|".join(re.escape(t) for t in sorted(added, key=len, reverse=True)) + ")")
        self.pieces: OrderedDict[str, list[int]] = OrderedDict()
        self.chars = 0
        self.lock = threading.Lock()  # (the server encodes on several threads)

    @classmethod
    def for_tokenizer(cls, tokenizer: HFTokenizer) -> _SegmentCache | None:
        # (each part's own spec: the whole tokenizer's JSON holds its vocabulary, megabytes of it)
        normalizer, pre = (
            json.loads(p.__getstate__()) if p else None for p in (tokenizer.normalizer, tokenizer.pre_tokenizer)
        )
        decoder = tokenizer.get_added_tokens_decoder()
        tokens = decoder.values()
        exact = (
            _steps_among(normalizer, "normalizers", cls.PIECEWISE_NORMALIZERS)
            and _steps_among(pre, "pretokenizers", cls.PIECEWISE_PRE_TOKENIZERS)
            and not any(step.get("add_prefix_space") for step in _steps(pre, "pretokenizers"))
            and not getattr(tokenizer.model, "dropout", None)
            and not any(t.lstrip or t.rstrip or t.single_word or (t.normalized and normalizer) for t in tokens)
        )
        added = {t.content: i for i, t in decoder.items() if t.content}
        if not exact or not added:
            return None
        cache = cls(tokenizer, added)
        probe = [a + t + b for t in list(added)[: cls.PROBE_TOKENS] for a in cls.PROBE for b in cls.PROBE[:4]]
        probe.append("".join(cls.PROBE).join(added))
        if any(cache.encode(p) != tokenizer.encode(p, add_special_tokens=False).ids for p in probe):
            return None
        cache.pieces.clear()
        cache.chars = 0
        return cache

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for i, piece in enumerate(self.split.split(text)):
            if i % 2:
                ids.append(self.added[piece])
            elif piece:
                ids += self._piece(piece)
        return ids

    def _piece(self, text: str) -> list[int]:
        if len(text) < self.MIN_CHARS:
            return self.hf.encode(text, add_special_tokens=False).ids
        with self.lock:
            ids = self.pieces.get(text)
            if ids is not None:
                self.pieces.move_to_end(text)
                return ids
        ids = self.hf.encode(text, add_special_tokens=False).ids
        with self.lock:
            if text not in self.pieces and len(text) <= self.BUDGET_CHARS:
                self.pieces[text] = ids
                self.chars += len(text)
                while self.chars > self.BUDGET_CHARS:
                    old, _ = self.pieces.popitem(last=False)
                    self.chars -= len(old)
        return ids


def _steps(spec: dict | None, key: str) -> list[dict]:
    """A tokenizer.json normalizer's or pre-tokenizer's steps (a Sequence's, or itself alone)."""
    if spec is None:
        return []
    return [s for step in spec[key] for s in _steps(step, key)] if spec.get("type") == "Sequence" else [spec]


def _steps_among(spec: dict | None, key: str, kinds: frozenset[str]) -> bool:
    return all(step.get("type") in kinds for step in _steps(spec, key))


def _token_text(v: Any) -> str | None:
    """tokenizer_config.json writes special tokens as strings or as {"content": ...} objects."""
    if isinstance(v, dict):
        return v.get("content")
    return v if isinstance(v, str) else None


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of the GPT-2 byte-to-printable-character table that byte-level BPE tokens are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


# ---- HF-compatible jinja2 environment ----------------------------------------------------------


def render_template(template: str, **variables: Any) -> str:
    """Render a chat template the way HF `apply_chat_template` does: sandboxed jinja2 with trim/lstrip
    blocks and loop controls, `tojson` without HTML escaping, `raise_exception` and `strftime_now`.
    Any failure is a TemplateError."""
    try:
        return _compile(template).render(**variables)
    except TemplateError:
        raise
    except Exception as e:  # jinja2 errors and whatever a template's filters raise
        raise TemplateError(f"the chat template failed: {e}") from None


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False):
    # HF's tojson: unlike jinja2's own, no HTML escaping (a template must be able to write "<" verbatim).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=8)
def _compile(template: str):  # noqa: ANN202
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except Exception as e:
        raise TemplateError(f"the chat template does not compile: {e}") from None
