"""Short-lived cache of the metric read routes' results, keyed by the job's ingest state.

Every change to a job's metric records goes through ``Storage.ingest``, which rewrites the
job's ``ingest_cursors`` row in the same transaction (``mark_drained`` rewrites it too). So
while that row is unchanged, a summary / layers / steps read would compute the same result:
a hundred dashboards polling a job between two ingest pages cost one computation, not a
hundred. The cached value is the route's response model, so FastAPI serializes it exactly as
before. The version is read BEFORE the data, so a cached result is never older than its key.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import TypeVar

T = TypeVar("T")


class ReadCache:
    def __init__(self, max_entries: int = 256) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[Hashable, tuple[Hashable, object]] = OrderedDict()
        self._lock = threading.Lock()  # routes run in FastAPI's thread pool
        self.hits = 0
        self.misses = 0

    def get(self, key: Hashable, version: Hashable, build: Callable[[], T]) -> T:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry[0] == version:
                self._entries.move_to_end(key)
                self.hits += 1
                return entry[1]  # type: ignore[return-value]
            self.misses += 1
        value = build()  # outside the lock: a slow read must not serialize the others
        with self._lock:
            self._entries[key] = (version, value)
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        return value
