"""Responses kept in memory for previous_response_id and GET /v1/responses/{id}: the newest
``responses_store_size`` of them, each with the conversation it ended (its input items, those of
the responses it continued, and its output), so that continuing one needs no other lookup."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the response object as it was returned (its output items included)
    input_items: list[dict[str, Any]]  # the conversation it answered, oldest first

    @property
    def conversation(self) -> list[dict[str, Any]]:
        """What a response that continues this one starts from."""
        return self.input_items + self.response["output"]


class ResponseStore:
    """A bounded map of response id -> StoredResponse; the oldest goes first when it is full. Used
    from the server's event loop only."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, stored: StoredResponse) -> None:
        if self.capacity == 0:
            return
        self._items[stored.response["id"]] = stored
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None
