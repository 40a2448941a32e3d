"""``memory://`` and ``memory://<name>``: an in-process store for tests and demos.

One store (and :class:`MemoryDispatcher` queue) per name per process, shared by every object
opened with that URL, like clients of one server: useless across worker processes or Spark
executors (use ``sqlite://`` or ``redis://`` there). Thread-safe; nothing survives the process.
Expiry is judged by the ``clock`` option. Every name exists, so ``must_exist`` checks nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any, ClassVar

from dedupstore.backend import (
    CLOCK,
    ConfigurationError,
    Connection,
    DeduplicationStore,
    EncodedMessage,
    EntityRecord,
    EntityStore,
    Options,
    OptionSet,
    OutgoingMessage,
    StoreURL,
    TokenRecord,
    TokenStore,
    URLDispatcher,
    WriteRequest,
)

__all__ = [
    "MemoryDeduplicationStore",
    "MemoryDispatcher",
    "MemoryEntityStore",
    "MemoryTokenStore",
    "namespace_name",
]


#: One deduplication record: (expiry or None, token).
_Record = tuple[float | None, str]


class _Space:
    """The data of one ``memory://<name>``: deduplication records (endpoint -> id -> record),
    entities (id -> (body, version, bucket, pending)), tokens (id -> (endpoint, created))
    and dispatched messages."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.records: dict[str, dict[str, _Record]] = {}
        self.entities: dict[str, tuple[str, int, int, bool]] = {}
        self.tokens: dict[str, tuple[str, float]] = {}
        self.sent: list[OutgoingMessage] = []


#: name -> its data, shared by every object opened with ``memory://<name>``.
_spaces: dict[str, _Space] = {}
_spaces_lock = threading.Lock()


def _space(url: StoreURL) -> _Space:
    """The data of ``url``'s name in this process, created on first use."""
    with _spaces_lock:
        return _spaces.setdefault(namespace_name(url), _Space())


def namespace_name(url: StoreURL) -> str:
    """The namespace of ``memory://<name>``; ``ConfigurationError`` for anything else."""
    if url.port or url.username or url.fragment:
        raise ConfigurationError(f"expected 'memory://' or 'memory://<name>', got {url.masked!r}")
    return url.netloc + url.path


class MemoryConnection(Connection):
    """``memory://<name>``: nothing to open or close (the data outlives its clients)."""

    schemes: ClassVar[tuple[str, ...]] = ("memory",)
    process_local: ClassVar[bool] = True

    @classmethod
    def validate(cls, url: StoreURL, options: Options) -> None:
        """The URL is ``memory://`` or ``memory://<name>``."""
        namespace_name(url)

    def close(self) -> None:
        """Nothing to release: the data of a name lives as long as the process."""


class MemoryDeduplicationStore(DeduplicationStore):
    """In-process deduplication store; records live as long as the process."""

    connection_class = MemoryConnection

    max_write_batch: ClassVar[int] = 10_000
    max_read_batch: ClassVar[int] = 10_000
    declared_options: ClassVar[OptionSet] = DeduplicationStore.declared_options.extend(CLOCK)

    def _configure(self) -> None:
        super()._configure()
        self._ns = _space(self.store_url)
        with self._ns.lock:
            self._records = self._ns.records.setdefault(self.endpoint, {})

    def _add_new(self, request: WriteRequest) -> set[str]:
        records, ids = self._records, request.ids
        with self._ns.lock:
            present = records.keys() & ids
            if present:  # kept unless expired or written by this call
                now, mine = request.now, request.mine
                kept = {
                    mid
                    for mid in present
                    if (record := records[mid])[1] not in mine
                    and (record[0] is None or record[0] > now)
                }
                ids = [mid for mid in ids if mid not in kept] if kept else ids
            records.update(dict.fromkeys(ids, (request.expires_at, request.token)))
        return set(ids)

    def _find(self, ids: list[str], now: float) -> set[str]:
        records = self._records
        with self._ns.lock:
            found = records.keys() & ids
            expired = {mid for mid in found if (e := records[mid][0]) is not None and e <= now}
        return found - expired if expired else found

    def _purge(self, now: float) -> int:
        records = self._records
        with self._ns.lock:
            expired = [mid for mid, (e, _) in records.items() if e is not None and e <= now]
            for mid in expired:
                del records[mid]
        return len(expired)

    def _count(self, now: float) -> int:
        """Exact: walks the endpoint's records under the namespace's lock."""
        with self._ns.lock:
            return sum(1 for e, _ in self._records.values() if e is None or e > now)

    def _endpoints(self, now: float) -> set[str]:
        """Exact: walks every endpoint's records under the namespace's lock."""
        with self._ns.lock:
            return {
                endpoint
                for endpoint, records in self._ns.records.items()
                if any(e is None or e > now for e, _ in records.values())
            }


class MemoryEntityStore(EntityStore):
    """In-process entity store (version: a counter per entity); shared per URL name."""

    connection_class = MemoryConnection

    max_load_batch: ClassVar[int] = 1000
    max_save_batch: ClassVar[int] = 1000

    def _configure(self) -> None:
        super()._configure()
        self._ns = _space(self.store_url)

    def _load(self, ids: list[str]) -> dict[str, tuple[str, Any]]:
        with self._ns.lock:
            found = {eid: self._ns.entities.get(eid) for eid in ids}
        return {eid: (rec[0], rec[1]) for eid, rec in found.items() if rec is not None}

    def _save(self, records: list[EntityRecord]) -> dict[str, Any]:
        saved: dict[str, Any] = {}
        with self._ns.lock:
            for record in records:
                current = self._ns.entities.get(record.id)
                if (current[1] if current else None) != record.version:
                    continue
                version = (current[1] if current else 0) + 1
                self._ns.entities[record.id] = (record.body, version, record.bucket, record.pending)
                saved[record.id] = version
        return saved

    def _scan(self, segment: int, segments: int) -> Iterator[tuple[str, str, Any]]:
        with self._ns.lock:
            ids = sorted(
                eid
                for eid, (_, _, bucket, pending) in self._ns.entities.items()
                if pending and bucket % segments == segment
            )
        for start in range(0, len(ids), 1000):  # page by page, like the servers
            with self._ns.lock:
                page = [(eid, self._ns.entities.get(eid)) for eid in ids[start : start + 1000]]
            for eid, record in page:
                if record is not None and record[3]:
                    yield eid, record[0], record[1]


class MemoryTokenStore(TokenStore):
    """In-process token store; tokens live as long as the process. Shared per URL name."""

    connection_class = MemoryConnection

    max_batch: ClassVar[int] = 10_000

    def _configure(self) -> None:
        super()._configure()
        self._ns = _space(self.store_url)

    def _create(self, records: list[TokenRecord]) -> None:
        tokens = self._ns.tokens
        with self._ns.lock:
            for record in records:
                tokens.setdefault(record.id, (record.endpoint, record.created))

    def _present(self, ids: list[str]) -> set[str]:
        with self._ns.lock:
            return self._ns.tokens.keys() & ids

    def _delete(self, ids: list[str]) -> None:
        tokens = self._ns.tokens
        with self._ns.lock:
            for token_id in ids:
                tokens.pop(token_id, None)

    def _scan(self) -> Iterator[TokenRecord]:
        """The ids of a snapshot, then a page of :attr:`page_size` at a time under the lock
        (like the servers: a token deleted meanwhile is left out)."""
        with self._ns.lock:
            ids = sorted(self._ns.tokens)
        size = self.page_size
        for start in range(0, len(ids), size):
            with self._ns.lock:
                page = [(tid, self._ns.tokens.get(tid)) for tid in ids[start : start + size]]
            for tid, token in page:
                if token is not None:
                    yield TokenRecord(tid, token[0], token[1])


class MemoryDispatcher(URLDispatcher):
    """A process-wide named queue: every dispatcher opened with ``memory://<name>`` shares it.

    :attr:`sent` holds every delivery in dispatch order (a re-dispatch appears again),
    :meth:`distinct` the first of each id, as a receiver would decode them (JSON round trip).
    Thread-safe; never raises ``StoreUnavailable``; no size bound unless the option sets one.
    """

    connection_class = MemoryConnection
    receiver_dedup: ClassVar[str] = (
        "by the message id: sent holds every delivery, distinct() the first of each id"
    )

    def _configure(self) -> None:
        super()._configure()
        self._queue = _space(self.store_url)

    @property
    def sent(self) -> list[OutgoingMessage]:
        """Every delivery so far, in dispatch order (a snapshot). Raises ``StoreClosed``."""
        self.check_open()
        with self._queue.lock:
            return list(self._queue.sent)

    def distinct(self) -> list[OutgoingMessage]:
        """The first delivery of each id, in dispatch order: what a deduplicating receiver keeps."""
        first: dict[str, OutgoingMessage] = {}
        for message in self.sent:
            first.setdefault(message.id, message)
        return list(first.values())

    def clear(self) -> None:
        """Empty the queue (for every dispatcher of this name). Raises ``StoreClosed``."""
        self.check_open()
        with self._queue.lock:
            self._queue.sent.clear()

    def _dispatch(self, batch: list[EncodedMessage]) -> None:
        copies = [encoded.decoded() for encoded in batch]
        with self._queue.lock:
            self._queue.sent.extend(copies)
