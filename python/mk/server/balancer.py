"""Which replica of a data-parallel server (mk.server.replicas) gets a request: cache-aware routing.

Each replica has a table of the prompt prefixes it was sent, as chained hashes of fixed-size blocks of
the prompt's text (block k's hash covers the whole text up to its end, so one hit means the whole
prefix matches). A request goes to the replica holding the longest prefix of its prompt when that covers
at least CACHE_THRESHOLD of it, else to the least loaded replica (requests in flight), the one with the
emptiest table among equals; when the loads drift too far apart the least loaded one gets it anyway.
This is sglang-router's cache-aware policy over blocks of text instead of a radix tree of characters.
A response of /v1/responses is remembered as its replica's, so that a follow-up naming it as its
`previous_response_id` (and GET/DELETE of it) reaches the replica whose store holds it.
"""

from __future__ import annotations

from collections import OrderedDict

from mk.server.responses_store import MAX_RESPONSES

# Characters of prompt text per block: a prefix shorter than one block is not matched.
BLOCK_CHARS = 64
# Blocks a replica's table keeps (the least recently sent forgotten first).
TABLE_BLOCKS = 1 << 18
# The share of a prompt's blocks a replica must hold for the prompt to follow them there.
CACHE_THRESHOLD = 0.3
# Loads are unbalanced, and the least loaded replica gets the request, when the busiest has more than
# BALANCE_ABS requests in flight beyond the idlest's and more than BALANCE_REL times as many.
BALANCE_ABS = 32
BALANCE_REL = 1.5


def prefix_blocks(text: str) -> list[int]:
    """The chained hash of each whole block of `text` (a trailing part block has none)."""
    out, h = [], 0
    for start in range(0, len(text) - BLOCK_CHARS + 1, BLOCK_CHARS):
        h = hash((h, text[start : start + BLOCK_CHARS]))
        out.append(h)
    return out


class Balancer:
    """The choice of a replica among those `live`, the requests each has in flight, and the stored
    responses each holds. Used from one event loop only."""

    def __init__(self, n: int, table_blocks: int = TABLE_BLOCKS) -> None:
        self.live = [False] * n  # whether a replica takes requests (the supervisor's to set)
        self.load = [0] * n  # requests in flight
        self.table_blocks = table_blocks
        self._tables: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(n)]
        self._responses: OrderedDict[str, int] = OrderedDict()  # response id -> replica
        self._max_responses = 2 * n * MAX_RESPONSES  # more than all the replicas' stores hold

    def forget(self, i: int) -> None:
        """Replica `i` exited: its prefix cache and its stored responses are gone."""
        self._tables[i].clear()
        for rid in [rid for rid, owner in self._responses.items() if owner == i]:
            del self._responses[rid]

    def choose(self, text: str | None = None, exclude: frozenset[int] = frozenset(), spread: bool = True) -> int | None:
        """The replica for a request whose prompt is `text` (None: no prompt), never one of `exclude`;
        None when no replica is live. Without a prompt, `spread` picks the least loaded replica, else the
        first live one (so that answers that differ by replica, such as a model's `created`, stay put)."""
        live = [i for i, up in enumerate(self.live) if up and i not in exclude]
        if not live:
            return None
        if not text:
            return min(live, key=self._emptiest) if spread else live[0]
        blocks = prefix_blocks(text)
        choice = min(live, key=self._emptiest)
        if blocks and not self._unbalanced(live):
            held = {i: self._held(i, blocks) for i in live}
            best = max(live, key=lambda i: (held[i], -self.load[i], -i))
            if held[best] >= CACHE_THRESHOLD * len(blocks):
                choice = best
        self._remember(choice, blocks)
        return choice

    def owner(self, response_id: str) -> int | None:
        """The live replica that stored response `response_id`, if it is known."""
        i = self._responses.get(response_id)
        if i is None or not self.live[i]:
            return None
        self._responses.move_to_end(response_id)
        return i

    def stored(self, response_id: str, i: int) -> None:
        """Replica `i` answered (and stored, unless asked not to) response `response_id`."""
        self._responses[response_id] = i
        self._responses.move_to_end(response_id)
        while len(self._responses) > self._max_responses:
            self._responses.popitem(last=False)

    def _emptiest(self, i: int) -> tuple[int, int, int]:
        return self.load[i], len(self._tables[i]), i

    def _unbalanced(self, live: list[int]) -> bool:
        loads = [self.load[i] for i in live]
        return max(loads) - min(loads) > BALANCE_ABS and max(loads) > BALANCE_REL * min(loads)

    def _held(self, i: int, blocks: list[int]) -> int:
        """How many leading blocks of the prompt replica `i` was sent."""
        table = self._tables[i]
        for k, b in enumerate(blocks):
            if b not in table:
                return k
        return len(blocks)

    def _remember(self, i: int, blocks: list[int]) -> None:
        """Replica `i` is sent the prompt of `blocks`. They are touched last block first, so that its
        leading blocks, which every longer prompt starting with them shares, are forgotten last."""
        table = self._tables[i]
        for b in reversed(blocks):
            table[b] = None
            table.move_to_end(b)
        while len(table) > self.table_blocks:
            table.popitem(last=False)
