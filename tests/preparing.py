"""Shared by the fuzz tests: hypothesis strategies of odd JSON, and a server state whose engine does only
what request preparation asks of one (routes' `_prepare` run in-process, up to the submission)."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import strategies as st

from mk.default_model import NAME
from mk.server.state import ServerState
from mk.text.tokenizer import Tokenizer

json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
)
json_any = st.recursive(
    json_leaf,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


def mostly(valid, odd=json_leaf):
    """Valid values three times in four, so many bodies get past validation into generation."""
    return st.one_of(valid, valid, valid, odd)


class _PreparingEngine:
    """The engine as request preparation sees it: its context, its vocabulary, grammars compiled
    ahead (here: not at all)."""

    max_context = 512
    config = SimpleNamespace(vocab_size=512)

    def prepare_constraint(self, spec) -> None:
        pass


def preparing_state() -> ServerState:
    """A server's state over the built-in tokenizer (512 tokens) and an engine that only prepares."""
    return ServerState(_PreparingEngine(), Tokenizer.builtin(512), NAME)
