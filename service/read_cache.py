"""Short-lived cache of the metric read routes' results, keyed by the job's ingest state.

Every change to a job's metric records goes through ``Storage.ingest`` (or retention, or
``mark_drained``), which rewrites the job's ``ingest_cursors`` row in the same transaction. So
while that row is unchanged, a summary / layers / steps read would compute the same result: a
hundred dashboards reading a job between two ingest transactions cost one computation, not a
hundred. The version is read BEFORE the data, so a cached result is never older than its key.

Bounded staleness (``max_age_s``, the ``read_max_staleness_s`` setting): a REST read may take
a result built less than ``max_age_s`` ago without asking the database for the version at all
(``recent``). Under ingest every job's version changes several times a second, so with exact
versions nearly every dashboard poll rebuilt the newest-layers view (18 ms of SQL at 8 jobs x
32 ranks x 200 layers); a dashboard polling every second cannot see half a second of age.
0 means always exact. The live stream always asks with an exact version.

Refresh ahead: a REST read that finds its result older than half of ``max_age_s`` is still
answered with it at once, and hands the cache a refresh to run on its own thread (one per key
at a time). While dashboards keep reading, a result is replaced before it expires, so no
request waits for a build: with expiry alone every request that came after it waited for the
newest-layers query (under the load test: p50 11.7 ms, against 2.8 ms when builds were ten
times rarer). The bound is unchanged: nothing older than ``max_age_s`` is served.

Single flight: when a key's version changes, the first reader computes it and the readers that
arrive meanwhile wait for that result instead of each running the same query (at a hundred
dashboards a second, every ingest commit used to start a burst of identical queries).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
logger = logging.getLogger(__name__)
REFRESH_AHEAD_FRACTION = 0.5  # of max_age_s: a read of an older result starts its refresh


class _Flight:
    __slots__ = ("done", "error", "value")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: object = None
        self.error: BaseException | None = None


MISS = object()  # what ``recent`` returns when it has nothing young enough


class ReadCache:
    def __init__(self, max_entries: int = 1024, max_age_s: float = 0.0) -> None:
        self.max_entries = max_entries
        self.max_age_s = max_age_s
        # key -> (version, value, monotonic time its build started: the age of its data)
        self._entries: OrderedDict[Hashable, tuple[Hashable, object, float]] = OrderedDict()
        self._flights: dict[tuple[Hashable, Hashable], _Flight] = {}
        self._lock = threading.Lock()  # routes run in FastAPI's thread pool
        self._refreshing: set[Hashable] = set()
        self._refresher: ThreadPoolExecutor | None = None  # started by the first refresh
        self._closed = False
        self.hits = 0  # answered without running build (cached, or another reader's build)
        self.misses = 0  # builds run

    def recent(
        self, key: Hashable, max_age_s: float | None = None, refresh: Callable[[], object] | None = None
    ) -> object:
        """The cached value of ``key`` if its data is younger than ``max_age_s`` (default: the
        cache's), else MISS. With ``refresh``, a value older than ``REFRESH_AHEAD_FRACTION`` of
        that age is still returned, and ``refresh`` runs on the cache's thread (never two for one
        key): it should store the current result with ``get``."""
        max_age_s = self.max_age_s if max_age_s is None else max_age_s
        if max_age_s <= 0:
            return MISS
        with self._lock:
            entry = self._entries.get(key)
            age_s = None if entry is None else time.monotonic() - entry[2]
            if entry is None or age_s is None or age_s >= max_age_s:
                return MISS
            self.hits += 1
            start = (
                refresh is not None
                and age_s >= max_age_s * REFRESH_AHEAD_FRACTION
                and key not in self._refreshing
                and not self._closed
            )
            if start:
                self._refreshing.add(key)
                if self._refresher is None:  # two: a slow newest-layers build holds up no summary
                    self._refresher = ThreadPoolExecutor(max_workers=2, thread_name_prefix="read-refresh")
                refresher = self._refresher
            value = entry[1]
        if start and refresh is not None:
            refresher.submit(self._refresh, key, refresh)
        return value

    def _refresh(self, key: Hashable, refresh: Callable[[], object]) -> None:
        try:
            refresh()
        except Exception as exc:  # the next read past max_age_s builds it (and sees the error)
            logger.warning("refreshing %r failed: %s", key, exc)
        finally:
            with self._lock:
                self._refreshing.discard(key)

    def close(self) -> None:
        """Stop refreshing: waits for a refresh in progress (before the storage closes)."""
        with self._lock:
            self._closed = True
            refresher, self._refresher = self._refresher, None
        if refresher is not None:
            refresher.shutdown(wait=True)

    def get(
        self, key: Hashable, version: Hashable, build: Callable[[], T], versioned_at: float | None = None
    ) -> T:
        """The value of ``key`` at ``version``, built once. ``versioned_at``: the monotonic time
        ``version`` was read; a cached value it confirms counts as that young (``recent``)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry[0] == version:
                self._entries.move_to_end(key)
                self.hits += 1
                if versioned_at is not None and versioned_at > entry[2]:
                    self._entries[key] = (entry[0], entry[1], versioned_at)
                return entry[1]  # type: ignore[return-value]
            flight = self._flights.get((key, version))
            owner = flight is None
            if flight is None:
                flight = self._flights[(key, version)] = _Flight()
                self.misses += 1
            else:
                self.hits += 1
        if not owner:
            flight.done.wait()
            if flight.error is not None:
                raise flight.error
            return flight.value  # type: ignore[return-value]
        started = time.monotonic() if versioned_at is None else versioned_at
        try:
            value = build()  # outside the lock: a slow read must not serialize the others
        except BaseException as exc:
            flight.error = exc
            raise
        else:
            flight.value = value
            with self._lock:
                self._entries[key] = (version, value, started)
                self._entries.move_to_end(key)
                while len(self._entries) > self.max_entries:
                    self._entries.popitem(last=False)
        finally:
            with self._lock:
                self._flights.pop((key, version), None)
            flight.done.set()
        return value
