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

from tokenizers import Encoding, decoders, models
from tokenizers import Tokenizer as HFTokenizer


class TemplateError(ValueError):
    """The chat template refused the conversation (its `raise_exception`) or failed to render."""


class TooManyTokens(ValueError):
    """A text has more tokens than the caller's limit (`count`: how many it has)."""

    def __init__(self, count: int, limit: int) -> None:
        super().__init__(f"the text has {count} tokens, more than {limit}")
        self.count, self.limit = count, limit


class Tokenizer:
    """Encode, decode and render chats for one checkpoint."""

    # Pre-tokenizer steps that keep every byte of the text (unless told to remove what they split on).
    BYTE_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Digits", "Split", "Punctuation"})

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
        """The test tokenizer and Cohere-format template of mk.text.tokenizer_files."""
        from mk.text import tokenizer_files

        return cls(tokenizer_files.build_tokenizer(vocab_size), tokenizer_files.tokenizer_config())

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True, limit: int | None = None) -> list[int]:
        """The token ids of `text`; TooManyTokens where they are more than `limit`, found before a list
        of them is made. Encodes through the batch call, which releases the GIL while it works (the
        single-text `encode` keeps it): other threads, the server's event loop among them, run meanwhile."""
        if not add_special_tokens and self._segments is not None:
            return self._segments.encode(text, limit)
        encoding = self.hf.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0]
        if limit is not None and (count := len(encoding)) > limit:
            # (dropped before raising: the traceback keeps this frame, and with it a huge prompt's
            # encoding, for as long as anything holds the error)
            del encoding
            raise TooManyTokens(count, limit)
        return encoding.ids

    @functools.cached_property
    def max_token_bytes(self) -> int | None:
        """The most bytes of text one token can stand for, where that bounds a text's token count from
        below (at least its UTF-8 bytes / this many): a byte-level BPE whose every token stands for as
        many bytes of the text as it has byte symbols, and every added token for its own text. None for
        any other tokenizer: a normalizer may shrink the text, a pre-tokenizer or truncation drop some,
        a fused unknown token or an added token that strips the whitespace beside it stand for any run."""
        hf, model = self.hf, self.hf.model
        pre = json.loads(hf.pre_tokenizer.__getstate__()) if hf.pre_tokenizer else None
        steps = _steps(pre, "pretokenizers")
        added = hf.get_added_tokens_decoder().values()
        sound = (
            hf.normalizer is None
            and hf.truncation is None
            and isinstance(model, models.BPE)
            and not (model.unk_token and model.fuse_unk)
            and any(step["type"] == "ByteLevel" for step in steps)
            and all(s["type"] in self.BYTE_KEEPING_PRE_TOKENIZERS and s.get("behavior") != "Removed" for s in steps)
            and not any(t.lstrip or t.rstrip for t in added)
        )
        if not sound:
            return None
        pieces = (len(piece) for piece in hf.get_vocab(with_added_tokens=False))
        return max(*pieces, *(len(t.content.encode()) for t in added), 1)

    def fewest_tokens(self, text: str) -> int:
        """A lower bound on the number of tokens of `text` from its size alone (0 where the tokenizer
        gives none): a prompt this bound already puts past the context is refused untokenized."""
        longest = self.max_token_bytes
        if longest is None:
            return 0
        size = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
        return -(-size // longest)

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
    unchanged: only the new ones are tokenized (encoding takes time in proportion to the text, so a
    long history would otherwise add to every next turn's time to first token; benches/chat_tokens.py).

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

    def encode(self, text: str, limit: int | None = None) -> list[int]:
        """As Tokenizer.encode: TooManyTokens past `limit` before a list of the ids is made."""
        split = self.split.split(text)  # the text between added tokens, and (odd places) the tokens
        texts = split[::2]
        with self.lock:
            cached = {t: self.pieces[t] for t in texts if t in self.pieces}
            for t in cached:
                self.pieces.move_to_end(t)
        fresh = list(dict.fromkeys(t for t in texts if t and t not in cached))
        encodings = dict(zip(fresh, self._encode_batch(fresh), strict=True))
        count = len(split) // 2 + sum(len(cached[t]) if t in cached else len(encodings.get(t, ())) for t in texts)
        if limit is not None and count > limit:
            del encodings, cached  # (as in Tokenizer.encode)
            raise TooManyTokens(count, limit)
        fresh_ids = {t: e.ids for t, e in encodings.items()}
        ids: list[int] = []
        for i, piece in enumerate(split):
            if i % 2:
                ids.append(self.added[piece])
            elif piece:
                ids += cached[piece] if piece in cached else fresh_ids[piece]
        self._keep(fresh_ids)
        return ids

    def _encode_batch(self, texts: list[str]) -> list[Encoding]:
        # One batch call for all new pieces: it releases the GIL while it works.
        return self.hf.encode_batch_fast(texts, add_special_tokens=False) if texts else []

    def _keep(self, pieces: dict[str, list[int]]) -> None:
        """Cache the pieces long enough to be worth it, the least recently used going first past the budget."""
        with self.lock:
            for text, ids in pieces.items():
                if len(text) < self.MIN_CHARS or len(text) > self.BUDGET_CHARS or text in self.pieces:
                    continue
                self.pieces[text] = ids
                self.chars += len(text)
            while self.chars > self.BUDGET_CHARS:
                old, _ = self.pieces.popitem(last=False)
                self.chars -= len(old)


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
