"""The Redis Streams broker of the consume loop: :class:`RedisStreamsBroker` (the user's guide, with
its options, is "Consuming from Redis Streams" in ``docs/consuming.md``).

It reads one stream through a consumer group (``XREADGROUP ... >``, blocking at most ``wait`` and
never more than half of ``timeout``), acknowledges with ``XACK`` after processing, and takes over
entries another consumer of the group left pending for longer than ``lease`` (``XAUTOCLAIM``), so a
consumer that died loses nothing. ``Delivery.deliveries`` is the group's delivery counter
(``XPENDING``): 1 for a first delivery, one more for each claim (a nacked entry is claimed back with
``XCLAIM`` at the next fetch, which counts it). A consumer named by the user takes back what its
name held pending at its first fetches; the default name is new per process
(``<host>-<pid>-<random>``), so what a killed process held is reclaimed, never read as its own.

The stream is ``stream=<key>`` as is, or what the dispatcher writes for ``destination=<d>``
(``<key_prefix><d>``, escaped); exactly one of the two. ``Delivery.headers`` holds every field of
the entry but the body (``body_field``), plus the entries of the JSON object in ``headers_field``
(as the dispatcher writes them; a field wins over a JSON header of the same name, and a headers
field that is not a JSON object is kept as a plain field).

Trimming is left to the user: trim only entries every group has acknowledged (a trimmed entry still
pending is never processed); remove stopped consumers' names (``XGROUP DELCONSUMER``) once they hold
nothing pending.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from redis.exceptions import ResponseError

from dedupstore.backend import (
    AsyncBroker,
    Broker,
    Client,
    ConfigurationError,
    Connected,
    Delivery,
    Option,
    Options,
    OptionSet,
    Steps,
    StoreURL,
    arun,
    boolean,
    io,
    optional,
    run,
    seconds,
    text,
)

from ._aio import AsyncRedisConnection
from ._client import (
    CONNECTION_OPTIONS,
    RedisConnection,
    key_prefix_option,
    probe_steps,
    text_of,
)
from .dispatcher import stream_key

_log = logging.getLogger("dedupstore.consumers")

__all__ = ["AsyncRedisStreamsBroker", "RedisStreams", "RedisStreamsBroker"]


def _lease(value: object) -> float:
    """``lease``: a duration in seconds; ``0`` claims every pending entry (tests only)."""
    if value in (0, "0"):
        return 0.0
    converted: float = seconds()(value)
    return converted


def _default_consumer() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class RedisStreams(Client):
    """What both Redis Streams brokers (:class:`RedisStreamsBroker`, and
    :class:`AsyncRedisStreamsBroker` on ``redis.asyncio``) share: the options and their
    checks (before any I/O), and Redis's error rules."""

    declared_options: ClassVar[OptionSet] = Client.declared_options.extend(
        key_prefix_option("dedupout:"),
        Option("destination", optional(text()), None, "the dispatcher destination to read"),
        Option("stream", optional(text()), None, "the stream key to read (instead of destination)"),
        Option("group", optional(text()), None, "the consumer group"),
        Option("consumer", optional(text()), None, "this consumer's name in the group"),
        Option("create", boolean, True, "create the group (and the stream) if absent"),
        Option("start", text(), "0", "where a new group starts: 0, $ or an entry id"),
        Option("lease", _lease, 60.0, "seconds after which a pending entry is reclaimed"),
        Option("body_field", text(), "body", "the entry field holding the payload"),
        Option(
            "headers_field",
            optional(text()),
            "headers",
            "the entry field holding a JSON object of headers",
        ),
        *CONNECTION_OPTIONS,
    )
    _redis = Connected(RedisConnection)
    commands: ClassVar[str] = (
        "+ping +info +xgroup|create +xreadgroup +xack +xautoclaim +xclaim +xpending +xinfo|groups"
    )

    @classmethod
    def _validate(cls, url: StoreURL, options: Options) -> None:
        """Exactly one of ``destination`` and ``stream``; a ``group``."""
        super()._validate(url, options)
        if (options["destination"] is None) == (options["stream"] is None):
            raise ConfigurationError(
                f"{cls.__name__} needs exactly one of destination=<dispatcher destination> "
                "and stream=<stream key>"
            )
        if not options["group"]:
            raise ConfigurationError(f"{cls.__name__} needs group=<consumer group name>")


class _Streams:
    """The broker's logic, written once as steps (:mod:`dedupstore.steps`) over a Redis
    connection: :class:`RedisConnection` (redis-py, driven by :class:`RedisStreamsBroker`)
    or :class:`~._aio.AsyncRedisConnection` (``redis.asyncio``, the same method names,
    awaited: :class:`AsyncRedisStreamsBroker`)."""

    def __init__(self, client: RedisStreams, redis: Any) -> None:
        opts = client.options
        self.client = client
        self.redis = redis
        self.stream: str = opts["stream"] or stream_key(opts["key_prefix"], opts["destination"])
        self.group: str = opts["group"]
        self.consumer: str = opts["consumer"] or _default_consumer()
        self._lease_ms = round(opts["lease"] * 1000)
        self._block_cap = opts["timeout"] / 2
        self._body_field: str = opts["body_field"]
        self._headers_field: str | None = opts["headers_field"]
        self._nacked: list[str] = []
        self._cursor = "0-0"
        self._next_scan = float("-inf")
        # a name given may be an earlier process's: what it held is taken back at once
        self._resume: str | None = "-" if opts["consumer"] else None
        self._waiting = 0  # deliveries last seen waiting for a lease (logged on change)

    def opened(self) -> Steps[None]:
        """The server checked (a primary, not a cluster), the consumer group there."""
        yield from probe_steps(self.redis, self.client, "")
        yield from self.ensure_group()

    def ensure_group(self) -> Steps[None]:
        """The consumer group exists (created with ``create``); see the module."""
        try:
            groups = yield from io(self.redis.read, self.redis.client.xinfo_groups, self.stream)
        except ResponseError as exc:
            if "no such key" not in str(exc).lower():
                raise
            groups = []
        if any(text_of(g["name"]) == self.group for g in groups):
            return
        if not self.client.creates:
            raise self.client.no_such_store(
                f"consumer group {self.group!r} of stream {self.stream!r}",
                "create it (XGROUP CREATE) or open with create=true",
            )
        try:
            yield from self._on_group(
                self.redis.client.xgroup_create, id=self.client.options["start"], mkstream=True
            )
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):  # created meanwhile by another consumer
                raise

    def _on_group(self, command: Callable[..., Any], *args: Any, **kwargs: Any) -> Steps[Any]:
        """``command(stream, group, *args, **kwargs)``, retried as a read."""
        return (yield from io(self.redis.read, command, self.stream, self.group, *args, **kwargs))

    def fetch(self, max_count: int, wait: float) -> Steps[list[Delivery]]:
        with self.client.translating_errors("fetch"):
            if self._resume is not None:
                yield from self._take_back_own(max_count)
            if self._nacked:
                ids: list[Any] = self._nacked[:max_count]
                self._nacked = self._nacked[max_count:]
                claimed = yield from self._on_group(self.redis.client.xclaim, self.consumer, 0, ids)
                deliveries = yield from self._deliveries(claimed)
                if deliveries:
                    return deliveries
            block = min(wait, self._block_cap)
            block_ms = round(block * 1000) or None
            reply = yield from io(
                self.redis.read,
                self.redis.client.xreadgroup,
                self.group,
                self.consumer,
                {self.stream: ">"},
                count=max_count,
                block=block_ms,
            )
        entries = [entry for _, stream_entries in reply or [] for entry in stream_entries]
        return [self._delivery(entry, 1) for entry in entries if entry[1] is not None]

    def _take_back_own(self, max_count: int) -> Steps[None]:
        """Queue (as nacked: claimed, counted) up to ``max_count`` entries pending with
        this consumer's name: an earlier process of that name died holding them."""
        start = self._resume
        assert start is not None
        rows = yield from self._on_group(
            self.redis.client.xpending_range, start, "+", max_count, self.consumer
        )
        ids = [text_of(row["message_id"]) for row in rows]
        self._resume = f"({ids[-1]}" if len(ids) == max_count else None
        if ids:
            _log.info(
                "consumer %s of group %s: taking back %d deliveries this name held before "
                "it restarted",
                self.consumer,
                self.group,
                len(ids),
            )
            self._nacked.extend(ids)

    def ack(self, deliveries: Sequence[Delivery]) -> Steps[None]:
        if deliveries:
            ids = [d.token for d in deliveries]
            with self.client.translating_errors("ack"):
                yield from self._on_group(self.redis.client.xack, *ids)

    def keep(self, deliveries: Sequence[Delivery]) -> Steps[None]:
        if deliveries:
            ids = [d.token for d in deliveries]
            with self.client.translating_errors("keep"):
                yield from self._on_group(
                    self.redis.client.xclaim, self.consumer, 0, ids, justid=True
                )

    def nack(self, deliveries: Sequence[Delivery]) -> None:
        self._nacked.extend(d.token for d in deliveries)

    def reclaim(self, max_count: int) -> Steps[list[Delivery]]:
        if time.monotonic() < self._next_scan:
            return []
        with self.client.translating_errors("reclaim"):
            reply = yield from self._on_group(
                self.redis.client.xautoclaim,
                self.consumer,
                self._lease_ms,
                start_id=self._cursor,
                count=max_count,
            )
            cursor, entries = text_of(reply[0]), reply[1]
            self._cursor = cursor
            if cursor == "0-0" and not entries:
                self._next_scan = time.monotonic() + self._lease_ms / 10000
                yield from self._report_waiting()
            return (yield from self._deliveries(entries))

    def _report_waiting(self) -> Steps[None]:
        """Log (INFO, when it changes) the entries idle for more than a tenth of the
        lease in other consumers' hands: most likely held by a consumer that died, they
        wait for the lease to run out before this consumer takes them over."""
        idle = max(self._lease_ms // 10, 1000)
        rows = yield from self._on_group(
            self.redis.client.xpending_range, "-", "+", 1000, idle=idle
        )
        waiting = [r for r in rows if text_of(r["consumer"]) != self.consumer]
        if len(waiting) != self._waiting:
            self._waiting = len(waiting)
            if waiting:
                holders = sorted({text_of(r["consumer"]) for r in waiting})
                longest = max(int(r["time_since_delivered"]) for r in waiting) / 1000
                _log.info(
                    "consumer %s of group %s: %s deliveries held by %s, idle for up to "
                    "%.1f s, wait for their lease (%.1f s) before they are taken over",
                    self.consumer,
                    self.group,
                    f"{len(waiting)}+" if len(rows) == 1000 else len(waiting),
                    ", ".join(holders[:5]) + (" and others" if len(holders) > 5 else ""),
                    longest,
                    self._lease_ms / 1000,
                )

    def pending(self) -> Steps[int | None]:
        with self.client.translating_errors("pending"):
            groups = yield from io(self.redis.read, self.redis.client.xinfo_groups, self.stream)
        for group in groups:
            if text_of(group["name"]) == self.group:
                lag = group.get("lag")
                return int(group.get("pending") or 0) + int(lag or 0)
        return None

    def _deliveries(self, entries: list[Any]) -> Steps[list[Delivery]]:
        """Claimed entries with their delivery counters (one ``XPENDING`` per entry,
        pipelined); entries deleted from the stream meanwhile are skipped."""
        live = [entry for entry in entries if entry and entry[1] is not None]
        if not live:
            return []

        def build(pipe: Any) -> None:
            for entry_id, _ in live:
                pipe.xpending_range(self.stream, self.group, entry_id, entry_id, 1)

        counts = yield from io(self.redis.pipelined, build)
        out = []
        for (entry_id, fields), info in zip(live, counts, strict=True):
            count = int(info[0]["times_delivered"]) if info else None
            out.append(self._delivery((entry_id, fields), count))
        return out

    def _delivery(self, entry: Any, count: int | None) -> Delivery:
        entry_id, fields = entry
        body: bytes | str = b""
        headers: dict[str, str] = {}
        nested: dict[str, str] = {}
        for key, value in fields.items():
            name = text_of(key)
            if name == self._body_field:
                body = value
            elif name == self._headers_field and (parsed := _json_headers(value)) is not None:
                nested = parsed
            else:
                headers[name] = text_of(value)
        for name, value in nested.items():
            headers.setdefault(name, value)
        return Delivery(text_of(entry_id), body, headers, count)


class RedisStreamsBroker(RedisStreams, Broker):
    """A Redis stream read through a consumer group: XREADGROUP, XACK, XAUTOCLAIM.

    See the module for the options. Raises ``ConfigurationError`` for bad options
    (before any I/O), credentials, ACL permissions, a key of another type, or a
    missing group without ``create``; ``StoreUnavailable`` when Redis cannot answer.
    """

    kind: ClassVar[str] = "redis_streams"

    def _open(self) -> None:
        self._streams = _Streams(self, self._redis)
        self.stream, self.group = self._streams.stream, self._streams.group
        self.consumer = self._streams.consumer
        run(self._streams.opened())

    def fetch(self, max_count: int, wait: float) -> list[Delivery]:
        """Nacked entries first (claimed back, counted), then new ones (``XREADGROUP >``)."""
        self.check_open()
        return run(self._streams.fetch(max_count, wait))

    def ack(self, deliveries: Sequence[Delivery]) -> None:
        """``XACK`` their entry ids (idempotent)."""
        self.check_open()
        run(self._streams.ack(deliveries))

    def keep(self, deliveries: Sequence[Delivery]) -> None:
        """Renew their lease: ``XCLAIM ... JUSTID`` to this consumer resets their idle
        time without counting a delivery, so no other consumer reclaims them."""
        self.check_open()
        run(self._streams.keep(deliveries))

    def nack(self, deliveries: Sequence[Delivery]) -> None:
        """Claimed back (``XCLAIM``, counted) at the next fetch; if this process dies
        first, another consumer reclaims them after ``lease``."""
        self._streams.nack(deliveries)

    def reclaim(self, max_count: int) -> list[Delivery]:
        """``XAUTOCLAIM`` entries idle longer than ``lease``.

        Scans the group's pending list with a cursor; after a full pass that found
        nothing it rests for a tenth of the lease before scanning again.
        """
        self.check_open()
        return run(self._streams.reclaim(max_count))

    def pending(self) -> int | None:
        """Entries pending in the group plus those not delivered yet (its lag)."""
        self.check_open()
        return run(self._streams.pending())


class _AsyncStreams(RedisStreams):
    """:class:`AsyncRedisStreamsBroker`'s options and error rules (no I/O of its own)."""


_AsyncStreams.__name__ = "AsyncRedisStreamsBroker"  # the name its errors give


class AsyncRedisStreamsBroker(AsyncBroker):
    """:class:`RedisStreamsBroker` for the async consume loop, on ``redis.asyncio``: the
    same options, commands, leases, counts, errors and guarantees (the same steps,
    awaited), each call bounded by the same deadline.

    Opened by :func:`dedupstore.aio.open_broker` (``redis://`` and ``rediss://`` URLs),
    or ``await AsyncRedisStreamsBroker(url, **options).open()``.
    """

    kind = "redis_streams"

    def __init__(self, url: str, /, **options: Any) -> None:
        """Check ``url`` and ``options`` (those of :class:`RedisStreamsBroker`; not
        ``client``); no I/O."""
        self.client = _AsyncStreams(url, **options)
        if self.client.options["client"] is not None:
            raise ConfigurationError(
                "AsyncRedisStreamsBroker makes its own redis.asyncio client: client= is "
                "for the sync RedisStreamsBroker"
            )
        self._redis = AsyncRedisConnection(self.client.store_url, self.client.options)
        self._streams = _Streams(self.client, self._redis)
        self.stream, self.group = self._streams.stream, self._streams.group
        self.consumer = self._streams.consumer

    @property
    def url(self) -> str:
        """The broker's URL, its secrets masked."""
        return self.client.url

    async def open(self) -> AsyncRedisStreamsBroker:
        """Check the server and the consumer group (created with ``create``)."""
        try:
            with self.client.translating_errors("open"):
                await arun(self._streams.opened())
        except BaseException:
            await self.close()
            raise
        return self

    async def fetch(self, max_count: int, wait: float) -> list[Delivery]:
        """Nacked entries first (claimed back, counted), then new ones (``XREADGROUP >``)."""
        self.client.check_open()
        return await arun(self._streams.fetch(max_count, wait))

    async def ack(self, deliveries: Sequence[Delivery]) -> None:
        """``XACK`` their entry ids (idempotent)."""
        self.client.check_open()
        await arun(self._streams.ack(deliveries))

    async def keep(self, deliveries: Sequence[Delivery]) -> None:
        """Renew their lease (``XCLAIM ... JUSTID``), counting no delivery."""
        self.client.check_open()
        await arun(self._streams.keep(deliveries))

    async def nack(self, deliveries: Sequence[Delivery]) -> None:
        """Claimed back (``XCLAIM``, counted) at the next fetch."""
        self._streams.nack(deliveries)

    async def reclaim(self, max_count: int) -> list[Delivery]:
        """``XAUTOCLAIM`` entries idle longer than ``lease``."""
        self.client.check_open()
        return await arun(self._streams.reclaim(max_count))

    async def pending(self) -> int | None:
        """Entries pending in the group plus those not delivered yet (its lag)."""
        self.client.check_open()
        return await arun(self._streams.pending())

    async def close(self) -> None:
        """Close the connections."""
        await self._redis.close()
        self.client.close()


def _json_headers(value: bytes | str) -> dict[str, str] | None:
    """The dispatcher's ``headers`` field (a JSON object); ``None`` if it is not one."""
    try:
        decoded = json.loads(value)
    except ValueError:
        return None
    if not isinstance(decoded, dict):
        return None
    return {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in decoded.items()}
