"""Stored responses of the Responses API (in memory): ``GET`` / ``DELETE`` by id,
``previous_response_id`` and background responses.

At most ``max_entries`` responses are kept, each for ``ttl_s`` seconds after it was last
written; beyond the cap the oldest goes first (a background response still running is cancelled).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from framework.server.protocol import ChatMessage


@dataclass(slots=True)
class StoredResponse:
    """A response as the client sees it, and the conversation it ends (its own output included)."""

    response: dict[str, Any]
    messages: list[ChatMessage]
    task: asyncio.Task | None = None  # a background response still generating
    expires_at: float = 0.0
    input_items: list[dict[str, Any]] | None = None  # the request's input, for GET .../input_items


class ResponseStore:
    def __init__(self, max_entries: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries, self.ttl_s, self.clock = max_entries, ttl_s, clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response_id: str, entry: StoredResponse) -> None:
        """Keep (or refresh) ``entry``; evicts expired entries, then the oldest beyond the cap."""
        entry.expires_at = self.clock() + self.ttl_s
        self._entries[response_id] = entry
        self._entries.move_to_end(response_id)
        self._expire()
        while len(self._entries) > self.max_entries:
            _, oldest = self._entries.popitem(last=False)
            _cancel(oldest)

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            _cancel(entry)
        return entry is not None

    def __len__(self) -> int:
        return len(self._entries)

    def _expire(self) -> None:
        now = self.clock()
        for response_id in [key for key, entry in self._entries.items() if entry.expires_at <= now]:
            _cancel(self._entries.pop(response_id))


def _cancel(entry: StoredResponse) -> None:
    if entry.task is not None and not entry.task.done():
        entry.task.cancel()
