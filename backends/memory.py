"""``memory://`` and ``memory://<name>``: an in-process store for tests and demos.

One store per name per process, shared by every object opened with that URL, so
two objects behave like two clients of one server. Thread-safe. Nothing survives
the process.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import ClassVar

from dedupstore.errors import ConfigurationError
from dedupstore.store import Clock, DeduplicationStore
from dedupstore.urls import split_url

__all__ = ["MemoryDeduplicationStore"]


class _Namespace:
    """The records of one ``memory://<name>``: (endpoint, id) -> expiry or None."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.records: dict[tuple[str, str], float | None] = {}


_namespaces: dict[str, _Namespace] = {}
_namespaces_lock = threading.Lock()


def _namespace(name: str) -> _Namespace:
    with _namespaces_lock:
        return _namespaces.setdefault(name, _Namespace())


class MemoryDeduplicationStore(DeduplicationStore):
    """In-process deduplication store; records live as long as the process."""

    schemes: ClassVar[tuple[str, ...]] = ("memory",)
    max_write_batch: ClassVar[int] = 10_000
    max_read_batch: ClassVar[int] = 10_000

    def __init__(
        self,
        url: str = "memory://",
        *,
        endpoint: str = "default",
        retention: timedelta | None = None,
        clock: Clock | None = None,
    ) -> None:
        """Open ``memory://<name>`` (the empty name is a namespace too)."""
        parts = split_url(url)
        if parts.query or parts.port:
            raise ConfigurationError(f"expected 'memory://' or 'memory://<name>', got {url!r}")
        super().__init__(url, endpoint=endpoint, retention=retention, clock=clock)
        self._ns = _namespace(parts.netloc + parts.path)

    def _add_new(self, ids: list[str], now: float, expires_at: float | None) -> set[str]:
        endpoint, records = self._endpoint, self._ns.records
        added: set[str] = set()
        with self._ns.lock:
            for mid in ids:
                key = (endpoint, mid)
                if key in records:
                    current = records[key]
                    if current is None or current > now:
                        continue
                records[key] = expires_at
                added.add(mid)
        return added

    def _find(self, ids: list[str], now: float) -> set[str]:
        endpoint, records = self._endpoint, self._ns.records
        found: set[str] = set()
        with self._ns.lock:
            for mid in ids:
                key = (endpoint, mid)
                if key in records:
                    expiry = records[key]
                    if expiry is None or expiry > now:
                        found.add(mid)
        return found

    def _purge(self, now: float) -> int:
        with self._ns.lock:
            expired = [
                key
                for key, expiry in self._ns.records.items()
                if key[0] == self._endpoint and expiry is not None and expiry <= now
            ]
            for key in expired:
                del self._ns.records[key]
        return len(expired)

    def _close(self) -> None:
        """Nothing to release: the namespace outlives its store objects."""
