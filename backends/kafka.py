"""A Kafka adapter for the consume loop: :class:`KafkaBroker` (confluent-kafka; the user's guide is
"Kafka" in ``docs/consuming.md``), and :class:`AsyncKafkaBroker` for the async loop
(confluent-kafka's asyncio ``AIOConsumer``; the same logic, written once as steps and awaited).

The broker reads one topic through a consumer group with ``enable.auto.commit`` and
``enable.auto.offset.store`` off (a ``config`` turning them on is refused): offsets are committed
only after processing. Kafka commits a position per partition, so the broker keeps each partition's
handed-out offsets in order: :meth:`KafkaBroker.ack` marks them done and commits (synchronously) the
first offset not done, which never passes an unprocessed message; :meth:`KafkaBroker.nack` seeks the
partition back to it (the later records come again: duplicates for the outbox). A seek or a
revocation starts a new epoch of the partition: tokens of an older one are stale, acking or nacking
them does nothing. Revoked partitions commit what is done and forget the rest, which the new owner
processes again (harmless: ``duplicate``, or ``redispatched`` while an outbox entry is pending).
Kafka counts no deliveries (``Delivery.deliveries`` is ``None``: the loop's ``max_deliveries`` does
not apply) and there is nothing to reclaim (the group reassigns a dead consumer's partitions). An
outage holds records uncommitted; while a whole round is held the loop does not poll, so an outage
longer than ``max.poll.interval.ms`` rebalances the group (a repeat for the next owner).

A delivery carries the record's value as ``body``, its headers as text, plus ``key`` (the record key
as text) when the record has one and no header is named ``key``.

URL: ``kafka://host:port?topic=<topic>&group=<group id>`` (more servers: ``bootstrap_servers``);
keyword only: ``config`` (further librdkafka settings) and ``consumer`` (a ready, unsubscribed
``confluent_kafka.Consumer``-like object: subscribed here, not closed by :meth:`close`). Not tested
against a real Kafka broker (see the guide): the tests use a fake consumer and librdkafka's mock
cluster.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from dedupstore.backend import (
    AsyncBroker,
    Broker,
    Client,
    ConfigurationError,
    Delivery,
    ErrorKind,
    Option,
    Options,
    OptionSet,
    Steps,
    StoreUnavailable,
    StoreURL,
    anything,
    arun,
    io,
    optional,
    quiet_driver_logs,
    run,
    text,
    timeout_option,
)

__all__ = ["AsyncKafkaBroker", "KafkaBroker", "KafkaToken", "KafkaTopic"]

#: Where librdkafka's own lines go (a Python logger: quiet at the default level).
_LIBRDKAFKA_LOG = logging.getLogger("librdkafka")
quiet_driver_logs(_LIBRDKAFKA_LOG.name)

#: Settings the broker owns: offsets are committed after processing, by ack().
_FORCED = {"enable.auto.commit": False, "enable.auto.offset.store": False}


def _kafka() -> Any:
    """The ``confluent_kafka`` module, or a ``ConfigurationError`` saying how to get it."""
    try:
        return importlib.import_module("confluent_kafka")
    except ImportError as exc:
        raise ConfigurationError(
            f"KafkaBroker needs confluent-kafka ({exc}); pip install 'dedupstore[kafka]'"
        ) from exc


def _config(value: object) -> dict[str, Any]:
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise TypeError(f"expected a dict of librdkafka settings, got {type(value).__name__}")
    return dict(value)


@dataclass(frozen=True)
class KafkaToken:
    """A delivery's handle: its record's ``topic``, ``partition``, ``offset``, and the partition's
    ``epoch`` when it was handed out (a seek or a revocation starts a new one: older are stale)."""

    topic: str
    partition: int
    offset: int
    epoch: int


@dataclass
class _Partition:
    """The offsets handed out of one partition, in order, and which are done."""

    epoch: int = 0
    outstanding: dict[int, bool] = field(default_factory=dict)  # offset -> done, in fetch order

    def committable(self) -> int | None:
        """The offset to commit after the done prefix (None: nothing new is done)."""
        advanced = None
        for offset, done in list(self.outstanding.items()):
            if not done:
                break
            del self.outstanding[offset]
            advanced = offset + 1
        return advanced


class KafkaTopic(Client):
    """What both Kafka brokers (:class:`KafkaBroker`, and :class:`AsyncKafkaBroker` on
    confluent-kafka's asyncio consumer) share: the URL, the options and their checks
    (before any I/O), the consumer's settings and the error rule."""

    schemes: ClassVar[tuple[str, ...]] = ("kafka",)
    declared_options: ClassVar[OptionSet] = Client.declared_options.extend(
        Option("topic", optional(text()), None, "the topic to consume (required)"),
        Option("group", optional(text()), None, "the consumer group id (required)"),
        Option(
            "bootstrap_servers",
            optional(text()),
            None,
            "host:port[,host:port...] (instead of the URL's host)",
        ),
        timeout_option(10.0, "seconds a commit, seek or metadata call may take"),
        Option(
            "config", _config, {}, "further librdkafka settings (a dict)", in_url=False, secret=True
        ),
        Option(
            "consumer",
            anything,
            None,
            "a ready confluent_kafka.Consumer-like object (not closed by close())",
            in_url=False,
            pickled=False,
            secret=True,
        ),
    )

    def _configure(self) -> None:
        super()._configure()
        self.topic: str = self.options["topic"]
        self.group: str = self.options["group"]
        self._owns_consumer = self.options["consumer"] is None

    @classmethod
    def _validate(cls, url: StoreURL, options: Options) -> None:
        """A topic, a group, bootstrap servers, and no setting that commits early."""
        super()._validate(url, options)
        for name in ("topic", "group"):
            if not options[name]:
                raise ConfigurationError(f"{cls.__name__} needs {name}=<{name} name>")
        if options["consumer"] is None:
            if not (url.host or options["bootstrap_servers"]):
                raise ConfigurationError(
                    f"{cls.__name__} needs bootstrap servers: kafka://host:port or "
                    "bootstrap_servers=h1:9092,h2:9092"
                )
            for key in _FORCED:
                value = options["config"].get(key)
                if value not in (None, False, "false", "False"):
                    raise ConfigurationError(
                        f"config {key}={value!r} would commit offsets before processing; "
                        f"{cls.__name__} commits them itself, after processing"
                    )

    def settings(self) -> dict[str, Any]:
        """The consumer's librdkafka settings (offsets committed by the broker only)."""
        servers = self.options["bootstrap_servers"] or (
            f"{self.store_url.host}:{self.store_url.port or 9092}"
        )
        return {
            "bootstrap.servers": servers,
            "group.id": self.group,
            "auto.offset.reset": "earliest",
            "logger": _LIBRDKAFKA_LOG,  # quiet unless asked for (see quiet_driver_logs)
            **self.options["config"],
            **_FORCED,
        }

    def _classify_error(self, exc: BaseException) -> ErrorKind:
        if type(exc).__name__ == "KafkaException":
            return StoreUnavailable
        return super()._classify_error(exc)


class _Reader:
    """The broker's logic, written once as steps (:mod:`dedupstore.steps`) over a
    consumer: confluent-kafka's ``Consumer`` (driven by :class:`KafkaBroker`) or its
    asyncio ``AIOConsumer``, whose methods are the same, awaited (driven by
    :class:`AsyncKafkaBroker`)."""

    def __init__(self, topic: KafkaTopic, consumer: Any) -> None:
        self.topic = topic
        self.consumer = consumer
        self.partitions: dict[tuple[str, int], _Partition] = {}

    def _state(self, topic: str, partition: int) -> _Partition:
        return self.partitions.setdefault((topic, partition), _Partition())

    def assigned(self, partitions: list[Any]) -> None:
        for tp in partitions:
            self._state(tp.topic, tp.partition).outstanding.clear()

    def revoked(self, consumer: Any, partitions: list[Any]) -> Steps[None]:
        """Commit what is done of the revoked partitions; forget what is in flight."""
        offsets = []
        for tp in partitions:
            state = self._state(tp.topic, tp.partition)
            committable = state.committable()
            if committable is not None:
                offsets.append(_topic_partition(tp.topic, tp.partition, committable))
            state.outstanding.clear()
            state.epoch += 1
        if offsets:
            with contextlib.suppress(Exception):  # not committed: redelivered, harmless
                yield from io(consumer.commit, offsets=offsets, asynchronous=False)

    def fetch(self, max_count: int, wait: float) -> Steps[list[Delivery]]:
        with self.topic.translating_errors("fetch"):
            records = yield from io(self.consumer.consume, num_messages=max_count, timeout=wait)
            out = []
            for record in records:
                error = record.error()
                if error is not None:
                    if error.code() == _kafka().KafkaError._PARTITION_EOF:  # not an error here
                        continue
                    raise _kafka().KafkaException(error)
                state = self._state(record.topic(), record.partition())
                state.outstanding[record.offset()] = False
                token = KafkaToken(record.topic(), record.partition(), record.offset(), state.epoch)
                out.append(Delivery(token, record.value() or b"", _headers(record), None))
            return out

    def ack(self, deliveries: Sequence[Delivery]) -> Steps[None]:
        touched = self._mark(deliveries, done=True)
        offsets = []
        for key in touched:
            committable = self.partitions[key].committable()
            if committable is not None:
                offsets.append(_topic_partition(key[0], key[1], committable))
        if offsets:
            with self.topic.translating_errors("ack"):
                yield from io(self.consumer.commit, offsets=offsets, asynchronous=False)

    def nack(self, deliveries: Sequence[Delivery]) -> Steps[None]:
        touched = self._mark(deliveries, done=False)
        with self.topic.translating_errors("nack"):
            for key in touched:
                state = self.partitions[key]
                first = next((o for o, done in state.outstanding.items() if not done), None)
                if first is None:
                    continue
                yield from io(self.consumer.seek, _topic_partition(key[0], key[1], first))
                state.outstanding.clear()  # everything from `first` on comes again
                state.epoch += 1

    def _mark(self, deliveries: Sequence[Delivery], *, done: bool) -> list[tuple[str, int]]:
        touched: list[tuple[str, int]] = []
        for delivery in deliveries:
            token = delivery.token
            if not isinstance(token, KafkaToken):
                continue
            key = (token.topic, token.partition)
            state = self.partitions.get(key)
            if state is None or state.epoch != token.epoch:
                continue  # stale: handed out before a seek or a revocation
            if token.offset in state.outstanding:
                if done:
                    state.outstanding[token.offset] = True
                if key not in touched:
                    touched.append(key)
        return touched

    def pending(self) -> Steps[int | None]:
        timeout = self.topic.options["timeout"]
        with self.topic.translating_errors("pending"):
            assigned = list((yield from io(self.consumer.assignment)))
            if not assigned:
                return None
            committed = yield from io(self.consumer.committed, assigned, timeout=timeout)
            lag = 0
            for tp in committed:
                low, high = yield from io(
                    self.consumer.get_watermark_offsets, tp, timeout=timeout, cached=False
                )
                position = tp.offset if tp.offset >= 0 else low
                lag += max(0, high - position)
            return lag


class KafkaBroker(KafkaTopic, Broker):
    """One Kafka topic read through a consumer group; offsets committed after processing (see the
    module). Raises ``ConfigurationError`` for bad options or a setting that would commit before
    processing (before any I/O), or when confluent-kafka is not installed; ``StoreUnavailable``
    (the Kafka error chained) when a fetch, commit or seek fails."""

    kind: ClassVar[str] = "kafka"

    def _open(self) -> None:
        """Make (or take) the consumer and subscribe it to the topic. A consumer of its own first
        asks for the topic's metadata, so an unreachable cluster is ``StoreUnavailable`` here,
        within ``timeout`` (librdkafka would retry in the background for ever)."""
        given = self.options["consumer"]
        self._consumer: Any = self._make_consumer() if given is None else given
        self._reader = _Reader(self, self._consumer)
        if given is None:
            try:
                self._consumer.list_topics(self.topic, timeout=self.options["timeout"])
            except BaseException:
                self._close()
                raise
        self._consumer.subscribe(
            [self.topic],
            on_assign=lambda _consumer, partitions: self._reader.assigned(partitions),
            on_revoke=lambda consumer, partitions: run(self._reader.revoked(consumer, partitions)),
        )

    def _make_consumer(self) -> Any:
        kafka = _kafka()
        try:
            return kafka.Consumer(self.settings())
        except kafka.KafkaException as exc:
            raise ConfigurationError(f"KafkaBroker: bad consumer settings: {exc}") from exc

    def _close(self) -> None:
        if self._owns_consumer:
            with contextlib.suppress(Exception):
                self._consumer.close()

    def fetch(self, max_count: int, wait: float) -> list[Delivery]:
        """Up to ``max_count`` records, waiting up to ``wait`` seconds (``consume``)."""
        self.check_open()
        return run(self._reader.fetch(max_count, wait))

    def ack(self, deliveries: Sequence[Delivery]) -> None:
        """Mark done; commit each partition's first offset not done (synchronously)."""
        self.check_open()
        run(self._reader.ack(deliveries))

    def nack(self, deliveries: Sequence[Delivery]) -> None:
        """Seek each partition concerned back to its first offset not done."""
        self.check_open()
        run(self._reader.nack(deliveries))

    def pending(self) -> int | None:
        """The group's lag on this consumer's partitions (high watermark - committed)."""
        self.check_open()
        return run(self._reader.pending())


class _AsyncTopic(KafkaTopic):
    """:class:`AsyncKafkaBroker`'s options and error rule (no I/O of its own)."""


_AsyncTopic.__name__ = "AsyncKafkaBroker"  # the name its errors give: the user's class


class AsyncKafkaBroker(AsyncBroker):
    """:class:`KafkaBroker` for the async consume loop, on confluent-kafka's asyncio
    consumer (``confluent_kafka.aio.AIOConsumer``): the same options, offsets, tokens,
    errors and guarantees (the same steps, awaited). ``consumer=`` takes a ready,
    unsubscribed ``AIOConsumer``-like object (not closed by :meth:`close`).

    Opened by :func:`dedupstore.aio.open_broker` (``kafka://`` URLs), or ``await
    AsyncKafkaBroker(url, **options).open()``. Raises what :class:`KafkaBroker` raises.
    """

    kind = "kafka"

    def __init__(self, url: str, /, **options: Any) -> None:
        """Check ``url`` and ``options`` (those of :class:`KafkaBroker`); no I/O."""
        self.client = _AsyncTopic(url, **options)
        self.topic, self.group = self.client.topic, self.client.group
        self._consumer: Any = None
        self._reader: _Reader | None = None

    @property
    def url(self) -> str:
        """The broker's URL, its secrets masked."""
        return self.client.url

    async def open(self) -> AsyncKafkaBroker:
        """Make (or take) the consumer and subscribe it (see :meth:`KafkaBroker._open`)."""
        given = self.client.options["consumer"]
        if given is None:
            kafka_aio = importlib.import_module("confluent_kafka.aio")
            try:
                consumer = kafka_aio.AIOConsumer(self.client.settings(), max_workers=2)
            except _kafka().KafkaException as exc:
                raise ConfigurationError(f"AsyncKafkaBroker: bad consumer settings: {exc}") from exc
            self._consumer = consumer
            try:
                with self.client.translating_errors("open"):
                    await consumer.list_topics(self.topic, timeout=self.client.options["timeout"])
            except BaseException:
                await self.close()
                raise
        else:
            self._consumer = given
        reader = self._reader = _Reader(self.client, self._consumer)

        async def on_assign(_consumer: Any, partitions: list[Any]) -> None:
            reader.assigned(partitions)

        async def on_revoke(consumer: Any, partitions: list[Any]) -> None:
            await arun(reader.revoked(consumer, partitions))

        await self._consumer.subscribe([self.topic], on_assign=on_assign, on_revoke=on_revoke)
        return self

    def _open_reader(self) -> _Reader:
        self.client.check_open()
        if self._reader is None:
            raise ConfigurationError("AsyncKafkaBroker is not open: await broker.open() first")
        return self._reader

    async def fetch(self, max_count: int, wait: float) -> list[Delivery]:
        """Up to ``max_count`` records, waiting up to ``wait`` seconds (``consume``)."""
        return await arun(self._open_reader().fetch(max_count, wait))

    async def ack(self, deliveries: Sequence[Delivery]) -> None:
        """Mark done; commit each partition's first offset not done."""
        await arun(self._open_reader().ack(deliveries))

    async def nack(self, deliveries: Sequence[Delivery]) -> None:
        """Seek each partition concerned back to its first offset not done."""
        await arun(self._open_reader().nack(deliveries))

    async def pending(self) -> int | None:
        """The group's lag on this consumer's partitions (high watermark - committed)."""
        return await arun(self._open_reader().pending())

    async def close(self) -> None:
        """Close the consumer (one of its own: a given one is left open)."""
        consumer, self._consumer = self._consumer, None
        if consumer is not None and self.client.options["consumer"] is None:
            with contextlib.suppress(Exception):
                await consumer.close()
        self.client.close()


def _topic_partition(topic: str, partition: int, offset: int) -> Any:
    return _kafka().TopicPartition(topic, partition, offset)


def _headers(record: Any) -> dict[str, str]:
    headers = {}
    for name, value in record.headers() or []:
        if isinstance(value, bytes):
            headers[name] = value.decode("utf-8", "replace")
        elif value is not None:
            headers[name] = str(value)
    key = record.key()
    if key is not None and "key" not in headers:
        headers["key"] = key.decode("utf-8", "replace") if isinstance(key, bytes) else str(key)
    return headers
