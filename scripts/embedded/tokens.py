"""Tokens: the BPE tokenizer trained on the documents, the documents encoded, and the shuffled token
stream training reads."""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from mk.text import tokenizer_files

from .corpus import first_files
from .documents import Documents


def build_tokenizer(docs: Documents, vocab_size: int, max_code_bytes: int | None = None):
    """BPE on the chat and tool documents and the first code files up to `max_code_bytes` (the
    merges settle long before a large corpus ends; training on all of it costs minutes)."""
    code = list(first_files(dict(enumerate(docs.code)), None, max_code_bytes)[0].values())
    return tokenizer_files.train_tokenizer([*code, *docs.chat, *docs.tools], vocab_size)


def encode_code(tok, texts: Sequence[str]) -> list[list[int]]:
    """BOS + text + EOS, without the text's trailing newlines: EOS follows code, never a bare newline
    (which the completion test's prompts may end with)."""
    bos, eos = tokenizer_files.BOS_ID, tokenizer_files.EOS_ID
    texts = [t.rstrip("\n") for t in texts]
    return [[bos, *e.ids, eos] for e in tok.encode_batch(texts, add_special_tokens=False)]


def encode_cut(tok, halves: Sequence[tuple[str, str]]) -> list[list[int]]:
    """BOS + each half tokenized alone + EOS (`Documents.cut`), without the text's trailing newlines."""
    bos, eos = tokenizer_files.BOS_ID, tokenizer_files.EOS_ID
    heads = tok.encode_batch([h for h, _ in halves], add_special_tokens=False)
    tails = tok.encode_batch([t.rstrip("\n") for _, t in halves], add_special_tokens=False)
    return [[bos, *h.ids, *t.ids, eos] for h, t in zip(heads, tails, strict=True)]


def encode_chat(tok, texts: Sequence[str]) -> list[list[int]]:
    return [e.ids for e in tok.encode_batch(list(texts), add_special_tokens=False)]


def token_stream(pieces: list[list[int]], seed: int) -> torch.Tensor:
    """The documents in a seeded random order, concatenated: int64 [n]."""
    order = list(range(len(pieces)))
    random.Random(seed).shuffle(order)
    if not order:
        return torch.zeros(0, dtype=torch.long)
    # One array per document, then one copy (a flat Python list of every token would take GBs).
    return torch.cat([torch.tensor(pieces[i], dtype=torch.long) for i in order])
