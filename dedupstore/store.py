"""The deduplication store contract: :class:`DeduplicationStore`.

The base class owns what every backend shares (id validation, batching, retention,
write tokens for safe retries, progress on failure); a backend implements a few
primitives whose atomicity is stated in their docstrings.
"""

from __future__ import annotations

import abc
import itertools
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from datetime import timedelta
from typing import Any, ClassVar, Literal, NamedTuple, TypeAlias, TypeVar, cast

from dedupstore.calls import fan_out, write_token
from dedupstore.client import Client
from dedupstore.errors import DedupStoreError, InvalidMessageId
from dedupstore.ids import MAX_ID_BYTES, validate_ids, validate_message_id
from dedupstore.options import Option, OptionSet, callable_, parse_duration, seconds
from dedupstore.steps import Steps, fan, run

__all__ = [
    "CLOCK",
    "MAX_CLOCK_SKEW",
    "MAX_ID_BYTES",
    "Clock",
    "DeduplicationStore",
    "Stepped",
    "WriteRequest",
    "chunked",
    "split_ids",
    "validate_message_id",
]

Clock = Callable[[], float]

T = TypeVar("T")
#: What a primitive returns: its answer (a blocking primitive, called in place by the
#: sync face and in a thread by the async face), or the steps that make its driver calls
#: (a generator function over the client's connection, sync or async: see
#: :meth:`DeduplicationStore._primitive`).
Stepped: TypeAlias = T | Steps[T]

#: Ids whose last write failed, remembered (with the tokens tried) for a retry.
_MAX_PENDING_IDS = 100_000
_MAX_TOKENS_PER_ID = 16


def _endpoint(value: object) -> str:
    return validate_message_id(value, "endpoint")


#: The ``clock`` option of backends that judge expiry by the client's clock.
CLOCK = Option(
    "clock",
    callable_,
    None,
    "a callable returning epoch seconds, used instead of time.time (tests)",
    in_url=False,
)


#: ``max_clock_skew``, for client-clock backends whose ``purge_expired`` runs on many clients.
MAX_CLOCK_SKEW = Option(
    "max_clock_skew",
    seconds(),
    60.0,
    "seconds: purge_expired deletes only records expired for longer, so a client "
    "whose clock runs up to this much ahead never deletes another client's live record",
)


class WriteRequest(NamedTuple):
    """One chunk handed to :meth:`DeduplicationStore._add_new`.

    ``token`` is written with every record this chunk creates; a record holding any
    token in ``mine`` (this one, and those of earlier failed attempts at these ids on
    the same store object) was written by this call. ``now`` and ``expires_at`` are
    the client's clock; ``retention`` is in seconds, for server-clock backends.
    """

    ids: list[str]
    token: str
    mine: frozenset[str]
    now: float
    expires_at: float | None
    retention: float | None


class DeduplicationStore(Client):
    """A strongly consistent set of processed message ids, keyed by (endpoint, id).

    Guarantees (every backend, checked by :mod:`dedupstore.testing`):

    * linearizable: once :meth:`add` / :meth:`add_many` returns, every client of
      the store sees the record;
    * first writer wins: of concurrent adds of one id exactly one returns ``True``;
    * invalid ids raise :class:`~dedupstore.errors.InvalidMessageId` before any I/O;
    * a store that cannot answer raises :class:`~dedupstore.errors.StoreUnavailable`,
      never "not processed"; a batch that fails part-way says what it ``recorded`` and
      what is ``unknown``, and a retry of the same ids on the same object reports
      those it wrote before the failure as recorded by the retry;
    * with ``retention`` a record stops counting once expired, judged by the
      server's clock where the server has one (:attr:`expiry_clock`).

    Open stores with :func:`dedupstore.open_store`. Instances pickle to their URL
    and options and reconnect when unpickled. They are safe to share between threads.

    Every public call is written once as steps (:mod:`dedupstore.steps`), run in place
    here and awaited by :class:`dedupstore.aio.AsyncDeduplicationStore`. A backend writes
    each primitive either as a blocking method or as a generator function of its driver
    calls (``yield from io(self._redis.read, ...)``), which then also runs natively on the
    async face's connection (:meth:`Connection.async_twin
    <dedupstore.client.Connection.async_twin>`).
    """

    primitives: ClassVar[tuple[str, ...]] = (
        "_add_new",
        "_find",
        "_add_one",
        "_contains_one",
        "_purge",
        "_count",
        "_endpoints",
    )

    #: Largest number of ids handed to one :meth:`_add_new` call.
    max_write_batch: ClassVar[int] = 1000
    #: Largest number of ids handed to one :meth:`_find` call.
    max_read_batch: ClassVar[int] = 1000
    #: How many chunks of one batch call may be in flight at once (1: one by one).
    #: Chunks are independent: each id's first-writer-wins is decided per chunk.
    chunk_concurrency: ClassVar[int] = 1
    #: Whose clock judges expiry: ``"server"`` (PostgreSQL ``now()``, Redis native
    #: expiry) or ``"client"`` (the ``clock`` option, ``time.time`` by default).
    expiry_clock: ClassVar[Literal["client", "server"]] = "client"

    declared_options: ClassVar[OptionSet] = Client.declared_options.extend(
        Option("endpoint", _endpoint, "default", "the consumer's name; records are per endpoint"),
        Option(
            "retention",
            parse_duration,
            None,
            "how long a record counts as processed ('30d', '12h', seconds); none: forever",
        ),
    )

    def _configure(self) -> None:
        super()._configure()
        self._endpoint: str = self.options["endpoint"]
        self._retention: timedelta | None = self.options["retention"]
        self._retention_seconds = (
            None if self._retention is None else self._retention.total_seconds()
        )
        clock = self.options.get("clock")
        self._clock: Clock = clock if clock is not None else time.time
        self._pending: dict[str, list[str]] = {}
        self._pending_lock = threading.Lock()

    # ------------------------------------------------------------------ public API

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

        ``False``: it was already recorded (and not expired). Durable and visible to every
        client when this returns. Raises ``InvalidMessageId`` before any I/O,
        ``StoreUnavailable`` (a retry on this object reports the id as recorded if the
        failed call wrote it), ``StoreClosed`` after :meth:`close`.
        """
        return run(self._add_steps(message_id))

    def _add_steps(self, message_id: str) -> Steps[bool]:
        mid = validate_message_id(message_id)
        self.check_open()
        return bool((yield from self._write_chunk([mid], single=True)))

    def add_many(self, message_ids: Iterable[str]) -> set[str]:
        """Record every id; return the set of ids this call recorded.

        Any iterable, duplicates included; one round trip per chunk of
        :attr:`max_write_batch` ids. Each id is returned by at most one of any number of
        concurrent callers. A ``Collection`` is validated whole before anything is
        written; another iterable is streamed, validated chunk by chunk. A failure
        part-way raises with ``recorded`` (act on them) and ``unknown`` (ids in flight).
        Raises ``InvalidMessageId``, ``StoreUnavailable``, ``StoreClosed``.
        """
        return run(self._add_many_steps(message_ids))

    def _add_many_steps(self, message_ids: Iterable[str]) -> Steps[set[str]]:
        return (
            yield from self._over_chunks(
                self._chunks(message_ids, self.max_write_batch), self._write_chunk, writes=True
            )
        )

    def has_been_processed(self, message_id: str) -> bool:
        """Return ``True`` if ``message_id`` is recorded and not expired (never a stale
        ``False``). Raises ``InvalidMessageId`` before any I/O, ``StoreUnavailable``."""
        return run(self._has_been_processed_steps(message_id))

    def _has_been_processed_steps(self, message_id: str) -> Steps[bool]:
        mid = validate_message_id(message_id)
        self.check_open()
        with self.translating_errors("has_been_processed"):
            return bool((yield from self._primitive("_contains_one", mid, self._clock())))

    def __contains__(self, message_id: object) -> bool:
        """``id in store`` is :meth:`has_been_processed` (invalid ids raise)."""
        return self.has_been_processed(message_id)  # type: ignore[arg-type]

    def processed_among(self, message_ids: Iterable[str]) -> set[str]:
        """Return the ids among ``message_ids`` that are recorded and not expired.

        One round trip per chunk of :attr:`max_read_batch` ids. Validation as in
        :meth:`add_many`. Raises ``InvalidMessageId`` and ``StoreUnavailable``.
        """

        return run(self._processed_among_steps(message_ids))

    def _processed_among_steps(self, message_ids: Iterable[str]) -> Steps[set[str]]:
        def find_chunk(chunk: list[str]) -> Steps[set[str]]:
            with self.translating_errors("processed_among"):
                found: set[str] = yield from self._primitive("_find", chunk, self._clock())
                return found

        return (
            yield from self._over_chunks(
                self._chunks(message_ids, self.max_read_batch), find_chunk, writes=False
            )
        )

    def count(self) -> int | None:
        """The number of live (unexpired) ids recorded for this endpoint, or ``None``.

        Exact: the ids :meth:`has_been_processed` answers ``True`` for (expired records
        not yet purged and other endpoints' records do not count). One snapshot on SQL
        backends; elsewhere a paged scan, so ids recorded or expiring meanwhile may or
        may not count. A maintenance read of every record of the endpoint at least.
        ``None`` when the backend cannot count exactly. Raises ``StoreUnavailable`` and
        ``StoreClosed``.
        """
        return cast(int | None, run(self._maintenance_steps("count", "_count")))

    def _maintenance_steps(self, operation: str, primitive: str) -> Steps[Any]:
        """``primitive`` at the client's clock, as the public call ``operation``."""
        self.check_open()
        with self.translating_errors(operation):
            return (yield from self._primitive(primitive, self._clock()))

    def endpoints(self) -> set[str] | None:
        """Every endpoint (consumer) holding live records in this store, not only this
        store's own; ``None`` when the backend cannot list them.

        Live as :meth:`count` judges it; a maintenance read like :meth:`count`. Raises
        ``StoreUnavailable`` and ``StoreClosed``.
        """
        return cast(set[str] | None, run(self._maintenance_steps("endpoints", "_endpoints")))

    def purge_expired(self) -> int:
        """Delete this endpoint's expired records (only reclaims space); return how many:
        0 without retention or where the server expires records. Raises ``StoreUnavailable``.
        """
        return cast(int, run(self._maintenance_steps("purge_expired", "_purge")))

    # ------------------------------------------------------------------ primitives

    @abc.abstractmethod
    def _add_new(self, request: WriteRequest) -> Stepped[set[str]]:
        """Atomically per id, record each id that is absent or expired; return those.

        Also return (and re-mark with ``request.token``) the ids whose record holds
        a token in ``request.mine``: this call's own earlier write. ``request.ids``
        is non-empty, duplicate-free, validated and at most :attr:`max_write_batch`
        long. Of concurrent callers, each id is returned by at most one. Records
        must be durable and visible to all clients on return.
        """

    @abc.abstractmethod
    def _find(self, ids: list[str], now: float) -> Stepped[set[str]]:
        """Return the ids that have a live record (no expiry, or not expired yet).

        ``ids`` is non-empty, duplicate-free and at most :attr:`max_read_batch`
        long; ``now`` is the client's clock. The read must be strongly consistent.
        """

    def _add_one(self, request: WriteRequest) -> Stepped[bool]:
        """Single-id :meth:`_add_new`; override when the backend has a faster path."""
        return bool((yield from self._primitive("_add_new", request)))

    def _contains_one(self, message_id: str, now: float) -> Stepped[bool]:
        """Single-id :meth:`_find`; override when the backend has a faster path."""
        return bool((yield from self._primitive("_find", [message_id], now)))

    @abc.abstractmethod
    def _purge(self, now: float) -> Stepped[int]:
        """Delete this endpoint's expired records; return the count."""

    def _count(self, now: float) -> Stepped[int | None]:
        """How many of this endpoint's records are live at ``now`` (the client's clock),
        expiry judged as :meth:`_find` does; ``None`` (the default): cannot count."""
        return None

    def _endpoints(self, now: float) -> Stepped[set[str] | None]:
        """The endpoints with a record live at ``now`` (the client's clock), expiry judged
        as :meth:`_find` does; ``None`` (the default): cannot list them."""
        return None

    # ------------------------------------------------------------------ helpers

    def _write_chunk(
        self,
        ids: list[str],
        single: bool = False,
        write: Callable[[WriteRequest], Steps[set[str]]] | None = None,
        operation: str | None = None,
    ) -> Steps[set[str]]:
        """Write one chunk under a fresh token; remember the tokens if it fails.

        ``write`` (default :meth:`_add_new`) lets a caller write the chunk with other
        work in one request (:meth:`dedupstore.entities.EntityStore._save_recording`),
        named ``operation`` in errors and metrics.
        """
        token = write_token()
        earlier: list[str] = []
        if self._pending:  # (tokens of failed writes: almost always none, so no lock)
            with self._pending_lock:
                popped = [self._pending.pop(mid, ()) for mid in ids]
                earlier = list(dict.fromkeys(t for tokens in popped for t in tokens))
        now = self._clock()
        request = WriteRequest(
            ids=ids,
            token=token,
            mine=frozenset([token, *earlier]),
            now=now,
            expires_at=None if self._retention_seconds is None else now + self._retention_seconds,
            retention=self._retention_seconds,
        )
        try:
            with self.translating_errors(operation or ("add" if single else "add_many")):
                if write is not None:
                    return (yield from write(request))
                if single:
                    added = yield from self._primitive("_add_one", request)
                    return set(ids) if added else set()
                return cast(set[str], (yield from self._primitive("_add_new", request)))
        except BaseException as exc:
            self._remember(ids, [*earlier, token])
            if single and isinstance(exc, DedupStoreError):
                raise exc.with_progress((), ids) from exc.__cause__
            raise

    def _remember(self, ids: list[str], tokens: list[str]) -> None:
        """Keep the tokens a failed write may have stored, for a retry of these ids."""
        with self._pending_lock:
            for mid in ids:
                known = self._pending.pop(mid, [])
                known.extend(t for t in dict.fromkeys(tokens) if t not in known)
                if len(known) > _MAX_TOKENS_PER_ID:
                    known = known[:1] + known[-(_MAX_TOKENS_PER_ID - 1) :]
                self._pending[mid] = known
            while len(self._pending) > _MAX_PENDING_IDS:
                del self._pending[next(iter(self._pending))]

    def _over_chunks(
        self,
        chunks: Iterator[list[str]],
        work: Callable[[list[str]], Steps[set[str]]],
        *,
        writes: bool,
    ) -> Steps[set[str]]:
        return (yield from chunked(chunks, work, writes=writes, concurrency=self.chunk_concurrency))

    def _chunks(self, message_ids: Iterable[str], size: int) -> Iterator[list[str]]:
        """Validate and split ``message_ids`` into duplicate-free chunks of ``size``."""
        if isinstance(message_ids, str | bytes):
            raise InvalidMessageId(
                f"expected an iterable of message ids, got a single {type(message_ids).__name__}"
                f" {message_ids!r:.80}; wrap it in a list"
            )
        if isinstance(message_ids, Collection):
            validated = validate_ids(message_ids)
            self.check_open()
            yield from split_ids(validated, size)
            return
        try:
            iterator = iter(message_ids)
        except TypeError:
            raise InvalidMessageId(
                f"expected an iterable of message ids, got {type(message_ids).__name__}"
            ) from None
        self.check_open()
        while True:
            chunk = validate_ids(itertools.islice(iterator, size))
            if not chunk:
                return
            yield list(dict.fromkeys(chunk))


def split_ids(ids: list[str], size: int) -> Iterator[list[str]]:
    """Validated ``ids`` in duplicate-free chunks of at most ``size``."""
    for start in range(0, len(ids), size):
        yield list(dict.fromkeys(ids[start : start + size]))


def chunked(
    chunks: Iterator[list[str]],
    work: Callable[[list[str]], Steps[set[str]]],
    *,
    writes: bool,
    concurrency: int,
) -> Steps[set[str]]:
    """Union of the steps ``work(chunk)``, with up to ``concurrency`` in flight
    (:func:`~dedupstore.steps.fan`: threads on the sync face, tasks on the async one); a
    write's error carries ``recorded`` (the chunks done) / ``unknown`` (those in flight)."""
    result: set[str] = set()
    unknown: set[str] = set()
    lock = threading.Lock()

    def each(chunk: list[str]) -> Steps[None]:
        try:
            done = yield from work(chunk)
        except BaseException:
            with lock:
                unknown.update(chunk)
            raise
        with lock:
            result.update(done)

    try:
        yield from fan(fan_out, (each(chunk) for chunk in chunks), concurrency)
    except DedupStoreError as exc:
        if writes:
            raise exc.with_progress(result, unknown) from exc.__cause__
        raise
    return result
