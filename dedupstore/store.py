"""The deduplication store contract: :class:`DeduplicationStore`.

The base class owns everything every backend shares (id validation, batching,
retention arithmetic, error translation, pickling, ``repr`` masking). A backend
implements a few primitives whose atomicity is stated in their docstrings.
"""

from __future__ import annotations

import abc
import contextlib
import inspect
import itertools
import os
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from datetime import timedelta
from types import TracebackType
from typing import Any, ClassVar, Self

from dedupstore.errors import (
    ConfigurationError,
    DedupStoreError,
    InvalidMessageId,
    StoreUnavailable,
)
from dedupstore.urls import mask_options, mask_url, parse_duration, query_options, split_url

__all__ = ["MAX_ID_BYTES", "DeduplicationStore", "validate_endpoint", "validate_message_id"]

#: The largest message id, in UTF-8 bytes, that every backend accepts.
MAX_ID_BYTES = 1024

Clock = Callable[[], float]


def validate_message_id(message_id: object) -> str:
    """Return ``message_id`` as a plain ``str`` or raise :class:`InvalidMessageId`.

    A valid id is a non-empty ``str`` of at most 1024 UTF-8 bytes, with no NUL
    character and no lone surrogate.
    """
    if type(message_id) is not str:
        if not isinstance(message_id, str):
            raise InvalidMessageId(
                f"a message id must be a str, got {type(message_id).__name__} {message_id!r:.80}"
            )
        message_id = str.__str__(message_id)
    if not message_id:
        raise InvalidMessageId("a message id must not be empty")
    if "\x00" in message_id:
        raise InvalidMessageId(f"message id {message_id!r:.80} contains a NUL character")
    if len(message_id) * 4 > MAX_ID_BYTES or not message_id.isascii():
        try:
            size = len(message_id.encode("utf-8"))
        except UnicodeEncodeError as exc:
            raise InvalidMessageId(
                f"message id {message_id!r:.80} contains a lone surrogate at position "
                f"{exc.start}; ids must be valid Unicode text"
            ) from None
        if size > MAX_ID_BYTES:
            raise InvalidMessageId(
                f"message id {message_id[:40]!r}... is {size} bytes in UTF-8; "
                f"the limit is {MAX_ID_BYTES}"
            )
    return message_id


def _validate_all(message_ids: Iterable[object]) -> list[str]:
    """Validate a batch; a fast path for the common all-plain-ASCII case, same rules."""
    items = list(message_ids)
    try:
        joined = "\x01".join(items)  # type: ignore[arg-type]
    except TypeError:
        joined = None
    if (
        joined is not None
        and joined.isascii()
        and "\x00" not in joined
        and all(type(m) is str and 0 < len(m) <= MAX_ID_BYTES for m in items)
    ):
        return items  # type: ignore[return-value]
    return [validate_message_id(m) for m in items]


def validate_endpoint(endpoint: object) -> str:
    """Return ``endpoint`` or raise :class:`ConfigurationError`; same rules as ids."""
    try:
        return validate_message_id(endpoint)
    except InvalidMessageId as exc:
        raise ConfigurationError(f"invalid endpoint: {exc}".replace("message id", "name")) from None


class DeduplicationStore(abc.ABC):
    """A strongly consistent set of processed message ids, keyed by (endpoint, id).

    Guarantees (every backend, checked by :mod:`dedupstore.testing`):

    * linearizable: once :meth:`add` / :meth:`add_many` returns, every client of
      the store sees the record;
    * first writer wins: of concurrent adds of one id exactly one returns ``True``;
    * invalid ids raise :class:`InvalidMessageId` before any I/O;
    * a store that cannot answer raises :class:`StoreUnavailable`, never "not
      processed";
    * with ``retention`` a record stops counting once expired, judged by comparing
      its stored expiry with the clock at read time.

    Open stores with :func:`dedupstore.open_store`. Instances pickle to their URL
    and options and reconnect when unpickled. They are safe to share between threads.
    """

    #: URL schemes this class serves (informational; the registry decides).
    schemes: ClassVar[tuple[str, ...]] = ()
    #: Largest number of ids handed to one :meth:`_add_new` call.
    max_write_batch: ClassVar[int] = 1000
    #: Largest number of ids handed to one :meth:`_find` call.
    max_read_batch: ClassVar[int] = 1000
    #: How many chunks of one batch call may be in flight at once (1: one by one).
    #: Chunks are independent: each id's first-writer-wins is decided per chunk.
    chunk_concurrency: ClassVar[int] = 1
    #: Typed converters for URL query options (besides the common ones).
    url_options: ClassVar[Mapping[str, Callable[[str], Any]]] = {}

    _COMMON_URL_OPTIONS: ClassVar[Mapping[str, Callable[[str], Any]]] = {
        "endpoint": str,
        "retention": parse_duration,
    }

    def __init__(
        self,
        url: str,
        *,
        endpoint: str = "default",
        retention: timedelta | None = None,
        clock: Clock | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> None:
        """Set up the common state; ``options`` are what :meth:`__reduce__` replays."""
        self._url = url
        self._endpoint = validate_endpoint(endpoint)
        try:
            self._retention = parse_duration(retention)
        except ValueError as exc:
            raise ConfigurationError(f"bad retention: {exc}") from exc
        self._retention_seconds = (
            None if self._retention is None else self._retention.total_seconds()
        )
        self._clock: Clock = clock if clock is not None else time.time
        self._options: dict[str, Any] = dict(options or {})
        self._options.setdefault("endpoint", self._endpoint)
        self._options.setdefault("retention", self._retention)
        if clock is not None:
            self._options.setdefault("clock", clock)
        self._closed = False
        self._chunk_pool: ThreadPoolExecutor | None = None
        self._chunk_pool_pid = 0
        self._chunk_pool_lock = threading.Lock()
        #: Driver exceptions that mean "the store could not answer".
        self._unavailable_errors: tuple[type[BaseException], ...] = ()

    # ------------------------------------------------------------------ opening

    @classmethod
    def from_url(cls, url: str, **options: Any) -> Self:
        """Build a store from its URL; query options are merged under ``options``."""
        parts = split_url(url)
        converters = {**cls._COMMON_URL_OPTIONS, **cls.url_options}
        merged = {**query_options(parts, converters), **options}
        try:
            inspect.signature(cls).bind(url, **merged)
        except TypeError as exc:
            raise ConfigurationError(
                f"cannot open {mask_url(url)} with {cls.__name__}: {exc}"
            ) from None
        return cls(url, **merged)

    # ------------------------------------------------------------------ public API

    @property
    def url(self) -> str:
        """The URL the store was opened with (secrets masked)."""
        return mask_url(self._url)

    @property
    def endpoint(self) -> str:
        """The consumer name records are keyed under."""
        return self._endpoint

    @property
    def retention(self) -> timedelta | None:
        """How long a record counts as processed; ``None`` means forever."""
        return self._retention

    def add(self, message_id: str) -> bool:
        """Record ``message_id``; return ``True`` if this call recorded it.

        ``False`` means it was already recorded (and not expired). Durable and
        visible to every client when this returns. Raises ``InvalidMessageId``
        before any I/O, ``StoreUnavailable`` when the store cannot answer.
        """
        mid = validate_message_id(message_id)
        self._check_open()
        now = self._clock()
        with self._translating_errors("add"):
            return self._add_one(mid, now, self._expiry(now))

    def add_many(self, message_ids: Iterable[str]) -> set[str]:
        """Record every id; return the set of ids this call recorded.

        Accepts any iterable, duplicates included; costs one round trip per chunk
        of :attr:`max_write_batch` ids. Each id is returned by at most one of any
        number of concurrent callers. A ``Collection`` (list, set, tuple, ...) is
        validated whole before anything is written; any other iterable is streamed
        and validated chunk by chunk (a bad id stops the call before its chunk is
        written). Raises ``InvalidMessageId`` and ``StoreUnavailable``.
        """

        def add_chunk(chunk: list[str]) -> set[str]:
            now = self._clock()
            with self._translating_errors("add_many"):
                return self._add_new(chunk, now, self._expiry(now))

        return self._over_chunks(self._chunks(message_ids, self.max_write_batch), add_chunk)

    def has_been_processed(self, message_id: str) -> bool:
        """Return ``True`` if ``message_id`` is recorded and not expired.

        Never returns a stale ``False`` for an id whose ``add`` has returned.
        Raises ``InvalidMessageId`` before any I/O, ``StoreUnavailable``.
        """
        mid = validate_message_id(message_id)
        self._check_open()
        with self._translating_errors("has_been_processed"):
            return self._contains_one(mid, self._clock())

    def __contains__(self, message_id: object) -> bool:
        """``id in store`` is :meth:`has_been_processed` (invalid ids raise)."""
        return self.has_been_processed(message_id)  # type: ignore[arg-type]

    def processed_among(self, message_ids: Iterable[str]) -> set[str]:
        """Return the ids among ``message_ids`` that are recorded and not expired.

        One round trip per chunk of :attr:`max_read_batch` ids. Validation as in
        :meth:`add_many`. Raises ``InvalidMessageId`` and ``StoreUnavailable``.
        """

        def find_chunk(chunk: list[str]) -> set[str]:
            with self._translating_errors("processed_among"):
                return self._find(chunk, self._clock())

        return self._over_chunks(self._chunks(message_ids, self.max_read_batch), find_chunk)

    def purge_expired(self) -> int:
        """Delete this endpoint's expired records; return how many were deleted.

        Only reclaims space: expired records already count as absent. Returns 0
        when the store has no retention. Raises ``StoreUnavailable``.
        """
        self._check_open()
        with self._translating_errors("purge_expired"):
            return self._purge(self._clock())

    def health_warnings(self) -> list[str]:
        """Return human-readable warnings about durability or consistency settings."""
        self._check_open()
        with self._translating_errors("health check"):
            return self._health_warnings()

    def close(self) -> None:
        """Release connections; idempotent. The store cannot be used afterwards."""
        if not self._closed:
            self._closed = True
            executor, self._chunk_pool = self._chunk_pool, None
            if executor is not None:
                executor.shutdown(wait=True)
            self._close()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        shown = {k: v for k, v in mask_options(self._options).items() if k != "clock"}
        if shown.get("endpoint") == "default":
            shown.pop("endpoint")
        if shown.get("retention") is None:
            shown.pop("retention", None)
        args = "".join(f", {key}={value!r}" for key, value in shown.items())
        return f"{type(self).__name__}({self.url!r}{args})"

    def __reduce__(self) -> tuple[Any, ...]:
        options = {k: v for k, v in self._options.items() if k != "client"}
        return (_reopen, (type(self), self._url, options))

    # ------------------------------------------------------------------ primitives

    @abc.abstractmethod
    def _add_new(self, ids: list[str], now: float, expires_at: float | None) -> set[str]:
        """Atomically per id, record each id that is absent or expired; return those.

        ``ids`` is non-empty, duplicate-free, validated and at most
        :attr:`max_write_batch` long. A record whose expiry is ``<= now`` counts as
        absent and is overwritten. Of concurrent callers, each id is returned by at
        most one. Records must be durable and visible to all clients on return.
        """

    @abc.abstractmethod
    def _find(self, ids: list[str], now: float) -> set[str]:
        """Return the ids that have a record whose expiry is ``None`` or ``> now``.

        ``ids`` is non-empty, duplicate-free and at most :attr:`max_read_batch`
        long. The read must be strongly consistent.
        """

    def _add_one(self, message_id: str, now: float, expires_at: float | None) -> bool:
        """Single-id :meth:`_add_new`; override when the backend has a faster path."""
        return bool(self._add_new([message_id], now, expires_at))

    def _contains_one(self, message_id: str, now: float) -> bool:
        """Single-id :meth:`_find`; override when the backend has a faster path."""
        return bool(self._find([message_id], now))

    @abc.abstractmethod
    def _purge(self, now: float) -> int:
        """Delete this endpoint's records whose expiry is ``<= now``; return the count."""

    def _health_warnings(self) -> list[str]:
        """Backend-specific warnings for ``dedupstore check``; none by default."""
        return []

    @abc.abstractmethod
    def _close(self) -> None:
        """Release the backend's connections."""

    # ------------------------------------------------------------------ helpers

    def _expiry(self, now: float) -> float | None:
        return None if self._retention_seconds is None else now + self._retention_seconds

    def _check_open(self) -> None:
        if self._closed:
            raise DedupStoreError(f"{self!r} is closed")

    @contextlib.contextmanager
    def _translating_errors(self, operation: str) -> Iterator[None]:
        """Turn the backend's driver errors into ``StoreUnavailable`` (chained)."""
        try:
            yield
        except DedupStoreError:
            raise
        except self._unavailable_errors as exc:
            raise StoreUnavailable(
                f"{type(self).__name__} at {self.url}: {operation} failed: "
                f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}"
            ) from exc

    def _over_chunks(
        self, chunks: Iterator[list[str]], work: Callable[[list[str]], set[str]]
    ) -> set[str]:
        """Union of ``work(chunk)``, with up to :attr:`chunk_concurrency` in flight.

        Memory stays bounded (at most that many chunks are held). On an error the
        chunks in flight are finished or cancelled before it is raised.
        """
        result: set[str] = set()
        first = next(chunks, None)
        if first is None:
            return result
        second = next(chunks, None)
        if second is None or self.chunk_concurrency <= 1:
            for chunk in itertools.chain([first], [] if second is None else [second], chunks):
                result |= work(chunk)
            return result
        pool = self._chunk_executor()
        pending: set[Future[set[str]]] = set()
        try:
            for chunk in itertools.chain([first, second], chunks):
                if len(pending) >= self.chunk_concurrency:
                    done, pending = wait(pending, return_when=FIRST_COMPLETED)
                    for future in done:
                        result |= future.result()
                pending.add(pool.submit(work, chunk))
            for future in pending:
                result |= future.result()
        except BaseException:
            for future in pending:
                future.cancel()
            wait(pending)
            raise
        return result

    def _chunk_executor(self) -> ThreadPoolExecutor:
        """This process's worker threads for concurrent chunks (new after ``fork``)."""
        with self._chunk_pool_lock:
            if self._chunk_pool is None or self._chunk_pool_pid != os.getpid():
                self._chunk_pool = ThreadPoolExecutor(
                    max_workers=self.chunk_concurrency,
                    thread_name_prefix=f"dedupstore-{type(self).__name__}",
                )
                self._chunk_pool_pid = os.getpid()
            return self._chunk_pool

    def _chunks(self, message_ids: Iterable[str], size: int) -> Iterator[list[str]]:
        """Validate and split ``message_ids`` into duplicate-free chunks of ``size``."""
        if isinstance(message_ids, str | bytes):
            raise InvalidMessageId(
                f"expected an iterable of message ids, got a single {type(message_ids).__name__}"
                f" {message_ids!r:.80}; wrap it in a list"
            )
        if isinstance(message_ids, Collection):
            validated = _validate_all(message_ids)
            self._check_open()
            for start in range(0, len(validated), size):
                yield list(dict.fromkeys(validated[start : start + size]))
            return
        self._check_open()
        iterator = iter(message_ids)
        while True:
            chunk = _validate_all(itertools.islice(iterator, size))
            if not chunk:
                return
            yield list(dict.fromkeys(chunk))


def _reopen(cls: type[DeduplicationStore], url: str, options: dict[str, Any]) -> Any:
    return cls(url, **options)
