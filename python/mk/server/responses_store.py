"""The responses that /v1/responses stored (`store`, true by default), in memory, so that a follow-up
request can name one as its `previous_response_id` and GET /v1/responses/{id} can answer it.

The store is bounded: it keeps the most recently created or used responses, at most MAX_RESPONSES of them
and at most MAX_BYTES of their requests and answers together, and forgets the least recently used first.
A stored response holds its whole conversation (the items of the responses it follows included, shared
with them rather than copied), so a chain of turns survives its earlier responses being forgotten. Nothing
outlives the server process.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

# Responses kept at most.
MAX_RESPONSES = 1000
# Bytes of stored requests and answers kept at most (each response counted as its request body plus its
# response object as JSON).
MAX_BYTES = 256 * 2**20


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: dict[str, Any]  # the response object, as it was answered
    conversation: tuple  # its input items, the earlier turns' included (responses_schemas.InputItem)
    output: tuple  # its output items as input items, for the turn that follows it
    size: int  # bytes it counts against MAX_BYTES


class ResponseStore:
    """An LRU map of response id -> StoredResponse, safe to use from the threads that prepare requests."""

    def __init__(self, max_responses: int = MAX_RESPONSES, max_bytes: int = MAX_BYTES) -> None:
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._responses)

    def put(self, stored: StoredResponse) -> None:
        """Keep `stored`, forgetting the least recently used responses beyond the bounds (`stored`
        itself, alone, if it is larger than MAX_BYTES)."""
        with self._lock:
            self._pop(stored.response["id"])
            self._responses[stored.response["id"]] = stored
            self._bytes += stored.size
            while len(self._responses) > self.max_responses or self._bytes > self.max_bytes:
                self._pop(next(iter(self._responses)))

    def get(self, response_id: str) -> StoredResponse | None:
        """The response, now the most recently used; None if it was never stored or is forgotten."""
        with self._lock:
            stored = self._responses.get(response_id)
            if stored is not None:
                self._responses.move_to_end(response_id)
            return stored

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._pop(response_id) is not None

    def _pop(self, response_id: str) -> StoredResponse | None:
        stored = self._responses.pop(response_id, None)
        if stored is not None:
            self._bytes -= stored.size
        return stored
