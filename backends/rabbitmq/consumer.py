"""The RabbitMQ broker of the consume loop: :class:`RabbitMQBroker` (pika; the user's guide is
"Consuming from RabbitMQ" in ``docs/consuming.md``).

It consumes one queue with manual acknowledgements (``basic_consume``, no ``auto_ack``) under a
prefetch window (``basic_qos(prefetch_count=prefetch)``): :meth:`~RabbitMQBroker.ack` sends
``basic.ack`` once the loop processed a delivery, :meth:`~RabbitMQBroker.nack` ``basic.nack`` with
``requeue=true``. A consumer that dies loses nothing: the broker requeues what its connection had
not acknowledged for the others, so there is nothing to reclaim; an acknowledgement lost with the
connection brings the message back once more (a ``duplicate`` for the outbox).

Delivery counts: a quorum queue's ``x-delivery-count`` (earlier deliveries) plus one, 1 for a first
delivery; a classic queue only flags a redelivery, so ``Delivery.deliveries`` is then ``None`` (the
loop's ``max_deliveries`` does not apply) and ``redelivered`` is kept on the token
(:class:`RabbitMQToken`). Dead letters follow the library's policy: this broker never rejects with
``requeue=false``; leave a quorum queue's ``x-delivery-limit`` unset or above ``max_deliveries``.

A delivery carries the body (bytes) and the AMQP headers as text, plus ``id`` from the
``message_id`` property and ``correlation_id`` from that property when set (a property wins over a
header of the same name); ``x-delivery-count`` is left out (it changes with every redelivery).

URL: ``amqp[s]://[user[:password]@]host[:port][/vhost]?queue=<queue>``; options: ``queue``
(required), ``prefetch`` (at least the loop's ``batch_size``), ``create`` (declare the queue
durable, of ``queue_type``, if missing; without it a missing queue is "no such store") and those of
:mod:`.rabbitmq._client`. After a lost connection the next call connects again (``ack`` and ``nack``
ignore the lost channel's tokens: the broker requeued those deliveries). One consume loop per object
(not thread-safe).
"""

from __future__ import annotations

import collections
import contextlib
import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pika
import pika.exceptions as pe
from pika.adapters.blocking_connection import BlockingChannel

from dedupstore.backend import (
    Broker,
    Client,
    ConfigurationError,
    Delivery,
    ErrorKind,
    Option,
    Options,
    OptionSet,
    ProcessLocal,
    StoreURL,
    boolean,
    integer,
    optional,
)

from ._client import (
    CONNECTION_OPTIONS,
    Link,
    classify,
    close_quietly,
    connect,
    deadline_seconds,
    expiring,
    parse_url,
    queue_arguments,
    queue_type_option,
    reply_code,
    short_string,
    vhost,
)

__all__ = ["RabbitMQBroker", "RabbitMQQueue", "RabbitMQToken", "delivery_of"]

#: The quorum queues' redelivery counter (earlier deliveries), left out of the headers.
DELIVERY_COUNT = "x-delivery-count"


@dataclass(frozen=True)
class RabbitMQToken:
    """A delivery's handle: its channel (``generation``), ``delivery_tag``, ``redelivered``. A tag
    means something only on the channel that delivered it: after a reconnection ``ack``/``nack``
    ignore the old channel's tokens (the broker requeued those deliveries)."""

    generation: int
    delivery_tag: int
    redelivered: bool


@dataclass(eq=False)
class _Link(Link):
    """The connection, its consuming channel, and the deliveries received not yet fetched."""

    generation: int
    received: collections.deque[Delivery] = field(default_factory=collections.deque)
    #: Delivery tags handed out and not settled yet: a second ack or nack of one
    #: (which RabbitMQ answers by closing the channel) is skipped.
    unsettled: set[int] = field(default_factory=set)


def _text(value: object) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return json.dumps(value, default=str, sort_keys=True)


class RabbitMQQueue(Client):
    """What both RabbitMQ brokers (:class:`RabbitMQBroker`, pika; and
    :class:`~dedupstore.backends.rabbitmq.aio.AioPikaBroker`, aio-pika) share: the URL, the
    options and their checks (before any I/O), and one call's deadline."""

    schemes: ClassVar[tuple[str, ...]] = ("amqp", "amqps")
    declared_options: ClassVar[OptionSet] = Client.declared_options.extend(
        Option(
            "queue", optional(short_string("a queue name")), None, "the queue to consume (required)"
        ),
        Option(
            "prefetch",
            integer(1, 65535),
            100,
            "most unacknowledged deliveries the broker sends this consumer",
        ),
        Option("create", boolean, True, "declare the queue (durable) if it does not exist"),
        queue_type_option("the x-queue-type of a queue this broker declares"),
        *CONNECTION_OPTIONS,
    )

    def _configure(self) -> None:
        super()._configure()
        self.queue: str = self.options["queue"]
        self.prefetch: int = self.options["prefetch"]

    @classmethod
    def _validate(cls, url: StoreURL, options: Options) -> None:
        """The URL's shape and TLS options; a ``queue``."""
        super()._validate(url, options)
        parse_url(url, options)
        if not options["queue"]:
            raise ConfigurationError(f"{cls.__name__} needs queue=<queue name>")

    def _deadline_seconds(self) -> float:
        return deadline_seconds(self.options)


class RabbitMQBroker(RabbitMQQueue, Broker):
    """A RabbitMQ queue consumed with manual acknowledgements and a prefetch window (see the
    module). Raises ``ConfigurationError`` for bad options (before any I/O), credentials,
    permissions, a missing queue without ``create``, or a queue declared with other arguments;
    ``StoreUnavailable`` when the broker cannot answer (the next call connects again)."""

    kind: ClassVar[str] = "rabbitmq"

    def _open(self) -> None:
        self._generation = 0
        self._link: ProcessLocal[_Link] = ProcessLocal(self._open_link, _Link.close)
        self._current()

    def _open_link(self) -> _Link:
        connection = connect(self.store_url, self.options)
        try:
            with expiring(connection, self.options["timeout"]):
                channel = connection.channel()
                self._declare(channel)
                channel.basic_qos(prefetch_count=self.prefetch)
                self._generation += 1
                link = _Link(connection, channel, self._generation)
                channel.basic_consume(
                    self.queue,
                    lambda _ch, method, properties, body: link.received.append(
                        self._delivery(link.generation, method, properties, body)
                    ),
                    auto_ack=False,
                )
        except BaseException:
            close_quietly(connection)
            raise
        return link

    def _declare(self, channel: BlockingChannel) -> None:
        passive = not self.creates
        try:
            channel.queue_declare(
                self.queue,
                passive=passive,
                durable=True,
                arguments=None if passive else queue_arguments(self.options["queue_type"]),
            )
        except pe.ChannelClosedByBroker as exc:
            if passive and exc.reply_code == 404:
                raise self.no_such_store(
                    f"queue {self.queue!r} on vhost {vhost(self.store_url)!r}",
                    "declare it, or open with create=true",
                ) from exc
            raise

    def _current(self) -> _Link:
        """This process's live link; a broken one is dropped and replaced."""
        link = self._link.get()
        if link.connection.is_open and link.channel.is_open:
            return link
        self._link.close()
        return self._link.get()

    @contextlib.contextmanager
    def _dropping(self, operation: str) -> Iterator[None]:
        """``operation``'s errors translated; after one the link is dropped (the broker
        requeues its unacknowledged deliveries)."""
        try:
            with self.translating_errors(operation):
                yield
        except BaseException:
            self._link.close()
            raise

    def _close(self) -> None:
        self._link.close()

    def _classify_error(self, exc: BaseException) -> ErrorKind:
        if reply_code(exc) == 404:
            return self.make_error(
                ConfigurationError, None, f"{self.describe_error(exc)} (a missing queue)"
            )
        return classify(exc) or super()._classify_error(exc)

    def fetch(self, max_count: int, wait: float) -> list[Delivery]:
        """Up to ``max_count`` deliveries, waiting up to ``wait`` seconds for the first."""
        self.check_open()
        with self._dropping("fetch"):
            link = self._current()
            with expiring(link.connection, wait + self.options["timeout"]):
                link.connection.process_data_events(time_limit=0)
                until = time.monotonic() + wait
                while not link.received and (left := until - time.monotonic()) > 0:
                    link.connection.process_data_events(time_limit=left)
            count = min(max_count, len(link.received))
            out = [link.received.popleft() for _ in range(count)]
            link.unsettled.update(d.token.delivery_tag for d in out)
            return out

    def ack(self, deliveries: Sequence[Delivery]) -> None:
        """``basic.ack`` each delivery of this channel not settled yet (idempotent;
        deliveries of a lost channel were requeued by the broker already)."""
        self._settle(deliveries, "ack")

    def nack(self, deliveries: Sequence[Delivery]) -> None:
        """``basic.nack`` with ``requeue=true``: redelivered, here or to another consumer."""
        self._settle(deliveries, "nack")

    def _settle(self, deliveries: Sequence[Delivery], operation: str) -> None:
        self.check_open()
        link = self._link.peek()
        if link is None:
            return
        tags = [
            d.token.delivery_tag
            for d in deliveries
            if isinstance(d.token, RabbitMQToken)
            and d.token.generation == link.generation
            and d.token.delivery_tag in link.unsettled
        ]
        if not tags:
            return
        link.unsettled.difference_update(tags)
        with self._dropping(operation), expiring(link.connection, self.options["timeout"]):
            for tag in tags:
                if operation == "ack":
                    link.channel.basic_ack(tag)
                else:
                    link.channel.basic_nack(tag, requeue=True)

    def pending(self) -> int | None:
        """Messages ready in the queue (not counting those delivered, unacknowledged)."""
        self.check_open()
        with self._dropping("pending"):
            link = self._current()
            with expiring(link.connection, self.options["timeout"]):
                frame = link.channel.queue_declare(self.queue, passive=True)
            return int(frame.method.message_count)

    @staticmethod
    def _delivery(
        generation: int, method: Any, properties: pika.BasicProperties, body: bytes
    ) -> Delivery:
        return delivery_of(
            RabbitMQToken(generation, int(method.delivery_tag), bool(method.redelivered)),
            body,
            properties.headers,
            properties.message_id,
            properties.correlation_id,
        )


def delivery_of(
    token: RabbitMQToken,
    body: bytes,
    headers: dict[str, Any] | None,
    message_id: str | None,
    correlation_id: str | None,
) -> Delivery:
    """A delivery as both RabbitMQ brokers make it (see the module): the headers as text
    with ``id`` and ``correlation_id`` from the properties, the count from a quorum queue's
    ``x-delivery-count`` (``None`` for a redelivery a classic queue only flags)."""
    raw = dict(headers or {})
    count = raw.pop(DELIVERY_COUNT, None)
    shown = {str(k): _text(v) for k, v in raw.items()}
    if message_id is not None:
        shown["id"] = message_id
    if correlation_id is not None:
        shown["correlation_id"] = correlation_id
    if isinstance(count, int) and not isinstance(count, bool):
        deliveries: int | None = count + 1
    else:
        deliveries = None if token.redelivered else 1
    return Delivery(token, body, shown, deliveries)
