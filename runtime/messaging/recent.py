"""A bounded memory of recently handled keys, for workers whose batches may be retried: what this process
already emitted is not done again when the same records come back."""

from __future__ import annotations

from collections import OrderedDict


class RecentKeys:
    def __init__(self, capacity: int = 100_000) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, key: str) -> bool:
        return key in self._keys

    def add(self, key: str) -> None:
        """Remember ``key`` (as the newest), forgetting the oldest beyond the capacity."""
        self._keys[key] = None
        self._keys.move_to_end(key)
        if len(self._keys) > self.capacity:
            self._keys.popitem(last=False)
