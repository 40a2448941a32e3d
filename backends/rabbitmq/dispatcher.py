"""The RabbitMQ dispatcher: :class:`RabbitMQDispatcher` (pika, publisher confirms; the user's guide
is "Dispatching to RabbitMQ" in ``docs/dispatchers.md``).

Every outgoing message is published to ONE exchange (``exchange``; by default ``''``, which routes
to the queue named by the routing key) with its destination as the routing key, persistent
(``delivery_mode`` 2), its id as ``message_id``, its headers as AMQP headers. ``mandatory``: a
message no queue is bound for comes back (``basic.return``) and the dispatch fails with
``ConfigurationError`` instead of the broker dropping it. Publisher confirms: ``dispatch`` returns
only once the broker confirmed every message of the batch (for a durable queue: on disk, or on a
majority of a quorum queue's replicas); a ``basic.nack`` raises ``StoreUnavailable``. Either way the
outbox dispatches the batch again. ``declare_queues`` (default exchange only) declares each
destination as a durable queue of ``queue_type`` before its first message (one that exists with
other arguments: ``ConfigurationError``, ``PRECONDITION_FAILED``).

One round trip per message (each publish waits for its confirmation). Delivery is at least once: a
batch that failed part-way was partly delivered and is sent again whole; receivers deduplicate by
``message_id``.

Deadline: a dispatch raises ``StoreUnavailable`` at most ``(retries + 1) x (connect_timeout +
timeout)`` seconds after it started: each attempt connects if needed and publishes the batch with
its confirmations within ``timeout`` (a timer on pika's I/O loop drops the connection when it is up,
so a silent broker cannot hold the call); after a lost connection the batch is published again on a
new one, up to ``retries`` times.

Reading back (for ``dedupstore dead-letters``; the default exchange only, where a destination is a
queue), within the dispatch's deadline: on a connection of its own, ``read_back`` takes the queue's
messages with ``basic.get`` unacknowledged and closes the channel, which returns them all in place
(now ``redelivered``); ``remove`` acknowledges those whose ``message_id`` it was given first.

Size bounds (checked before any I/O: ``MessageTooLarge``, none of the batch sent):
``max_message_bytes`` 128 MiB, RabbitMQ 3.x's default ``max_message_size`` (4.x has 16 MiB, which
AMQP cannot read: set the option), and ``max_header_bytes`` 127 KiB: the headers travel in one frame
of at most ``frame_max`` (128 KiB by default; a larger one makes the broker close the connection on
every attempt), with 1 KiB left for the other properties.

Fork-safe (a child opens its own connection), thread-safe (one dispatch at a time per object),
pickled by configuration.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import pika
import pika.exceptions as pe
from pika.adapters.blocking_connection import BlockingChannel
from pika.adapters.utils.connection_workflow import AMQPConnectorException

from dedupstore.backend import (
    ConfigurationError,
    DeadlinePassed,
    EncodedMessage,
    ErrorKind,
    Option,
    Options,
    OptionSet,
    OutgoingMessage,
    ProcessLocal,
    ReadMessage,
    StoreUnavailable,
    StoreURL,
    URLDispatcher,
    boolean,
    retry,
    time_left,
)

from ._client import (
    CONNECTION_OPTIONS,
    SHORT_STRING_BYTES,
    Expiry,
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

__all__ = ["RabbitMQDispatcher"]

T = TypeVar("T")


@dataclass(eq=False)
class _Link(Link):
    """The connection, its confirming channel and the queues it declared."""

    declared: set[str] = field(default_factory=set)


def _transient(exc: BaseException) -> bool:
    """A lost, refused or timed-out connection: another attempt on a new one may work."""
    return (
        isinstance(exc, pe.AMQPConnectionError | AMQPConnectorException | OSError | TimeoutError)
        and not isinstance(exc, DeadlinePassed)
        and classify(exc) is StoreUnavailable
    )


class RabbitMQDispatcher(URLDispatcher):
    """Outgoing messages published to a RabbitMQ exchange, confirmed by the broker (see the module).

    :meth:`dispatch` raises ``ConfigurationError`` for a message no queue is bound for (the broker
    returned it), credentials, permissions, a missing exchange or a queue declared with other
    arguments, and ``StoreUnavailable`` (pika's error chained) for a nack, a lost or refused
    connection, or no confirmation before the deadline. After an error some messages of the batch
    may have been delivered: dispatch it again (the outbox does)."""

    schemes: ClassVar[tuple[str, ...]] = ("amqp", "amqps")
    #: RabbitMQ 3.x's default ``max_message_size`` (see the module).
    max_message_bytes = 128 * 1024 * 1024
    #: The headers fit in one frame of the default ``frame_max`` (see the module).
    max_header_bytes = 127 * 1024
    receiver_dedup: ClassVar[str] = (
        "by the AMQP message_id (the outgoing id): delivery is at least once (a batch "
        "that failed part-way is published again)"
    )
    declared_options: ClassVar[OptionSet] = URLDispatcher.declared_options.extend(
        Option(
            "exchange",
            short_string("an exchange name"),
            "",
            "exchange to publish to; '' (the default exchange): the destination is the queue",
        ),
        Option(
            "declare_queues",
            boolean,
            False,
            "declare each destination as a durable queue first (default exchange only)",
        ),
        queue_type_option("the x-queue-type of the queues declare_queues declares"),
        *CONNECTION_OPTIONS,
    )

    def _open(self) -> None:
        self._exchange: str = self.options["exchange"]
        self._lock = threading.Lock()
        self._link: ProcessLocal[_Link] = ProcessLocal(self._open_link, _Link.close)
        with self._lock:
            self._probe()

    @classmethod
    def _validate(cls, url: StoreURL, options: Options) -> None:
        """The URL's shape, TLS options, ``declare_queues`` only on the default exchange."""
        super()._validate(url, options)
        parse_url(url, options)
        if options["declare_queues"] and options["exchange"]:
            raise ConfigurationError(
                "declare_queues needs the default exchange (exchange=''): a queue declared "
                f"for a destination is not bound to exchange {options['exchange']!r}"
            )

    def _deadline_seconds(self) -> float:
        return deadline_seconds(self.options)

    def _open_link(self) -> _Link:
        connection = connect(self.store_url, self.options)
        try:
            channel = connection.channel()
            channel.confirm_delivery()
        except BaseException:
            close_quietly(connection)
            raise
        return _Link(connection, channel)

    def _probe(self) -> None:
        link = self._link.get()
        if self._exchange:
            try:
                link.channel.exchange_declare(self._exchange, passive=True)
            except pe.ChannelClosedByBroker as exc:
                self._link.close()
                if exc.reply_code == 404:
                    raise self.make_error(
                        ConfigurationError,
                        None,
                        f"no exchange {self._exchange!r} on vhost {vhost(self.store_url)!r}; "
                        "declare it (and bind the destinations' queues to it) first",
                    ) from exc
                raise

    def _close(self) -> None:
        with self._lock:
            self._link.close()

    def _dispatch(self, batch: list[EncodedMessage]) -> None:
        for message in batch:  # before any I/O
            if len(message.destination.encode("utf-8")) > SHORT_STRING_BYTES:
                raise ValueError(
                    f"the destination of outgoing message {message.id!r:.80} is longer than "
                    f"the {SHORT_STRING_BYTES} UTF-8 bytes of an AMQP routing key"
                )
        with self._lock:
            retry(
                lambda: self._attempt(batch),
                attempts=self.options["retries"] + 1,
                retry_on=_transient,
            )

    def _attempt(self, batch: list[EncodedMessage]) -> None:
        """Publish the whole batch on this process's connection (opened if needed)."""
        link = self._link.get()
        expiry = Expiry()
        try:
            with expiring(link.connection, self.options["timeout"]) as expiry:
                self._publish(link, batch)
        except BaseException as exc:
            self._link.close()  # whatever happened, the next attempt starts afresh
            if expiry.fired:
                left = time_left()
                if left is not None and left <= 0:
                    raise DeadlinePassed(
                        "the broker did not confirm the batch before the call's deadline"
                    ) from exc
                raise TimeoutError(
                    f"the broker did not confirm the batch within timeout "
                    f"({self.options['timeout']:g} s)"
                ) from exc
            raise

    def _publish(self, link: _Link, batch: list[EncodedMessage]) -> None:
        channel = link.channel
        for message in batch:
            destination = message.destination
            if self.options["declare_queues"] and destination not in link.declared:
                channel.queue_declare(
                    destination, durable=True, arguments=queue_arguments(self.options["queue_type"])
                )
                link.declared.add(destination)
            properties = pika.BasicProperties(
                content_type="application/json",
                delivery_mode=pika.DeliveryMode.Persistent,
                message_id=message.id,
                headers=dict(message.message.headers) or None,
                app_id="dedupstore",
            )
            try:
                channel.basic_publish(
                    self._exchange,
                    destination,
                    message.body.encode("utf-8"),
                    properties,
                    mandatory=True,
                )
            except pe.UnroutableError as exc:
                raise self.make_error(
                    ConfigurationError,
                    "dispatch",
                    f"outgoing message {message.id!r:.80} is unroutable: no queue is bound "
                    f"for routing key {destination!r:.80} on "
                    f"{'the default exchange' if not self._exchange else repr(self._exchange)} "
                    "(the broker returned it); declare the queue"
                    + (" or set declare_queues=true" if not self._exchange else " and bind it")
                    + ". It stays in the outbox",
                ) from exc
            except pe.NackError as exc:
                raise self.make_error(
                    StoreUnavailable,
                    "dispatch",
                    f"the broker refused outgoing message {message.id!r:.80} (basic.nack: "
                    "an internal error, or a queue at its length limit); it stays in the "
                    "outbox",
                ) from exc

    def _classify_error(self, exc: BaseException) -> ErrorKind:
        code = reply_code(exc)
        if code == 404:
            return self.make_error(
                ConfigurationError,
                "dispatch",
                f"{self.describe_error(exc)} (a missing exchange or queue)",
            )
        return classify(exc) or super()._classify_error(exc)

    def read_back(self, destination: str) -> list[ReadMessage]:
        """Every message of the queue ``destination``, oldest first, left in the queue
        (see the module); the ``position`` is the message's place when read. Raises
        ``ConfigurationError`` for a dispatcher on another exchange than the default one
        or a missing queue, ``StoreUnavailable``."""
        return self._holding(destination, lambda channel, held: [read for _, read in held])

    def remove(self, destination: str, messages: Sequence[ReadMessage]) -> int:
        """Acknowledge (remove) the messages of the queue ``destination`` whose ``message_id`` is
        one of ``messages``' ids; the others go back. Raises as :meth:`read_back`."""
        ids = {m.message.id for m in messages}
        if not ids:
            return 0

        def settle(channel: BlockingChannel, held: list[tuple[int, ReadMessage]]) -> int:
            tags = [tag for tag, read in held if read.message.id in ids]
            for tag in tags:
                channel.basic_ack(tag)
            return len(tags)

        return self._holding(destination, settle)

    def _holding(
        self,
        destination: str,
        settle: Callable[[BlockingChannel, list[tuple[int, ReadMessage]]], T],
    ) -> T:
        """``settle(channel, held)`` with every message of the queue ``destination`` taken
        (unacknowledged) on a connection of its own; closing the channel returns the
        messages ``settle`` did not acknowledge."""
        self.check_open()
        if self._exchange:
            raise self.make_error(
                ConfigurationError,
                "read",
                f"messages are read back from the queue a destination names on the default "
                f"exchange; this dispatcher publishes to exchange {self._exchange!r}, whose "
                "bindings decide the queues: read them there",
            )
        with self.translating_errors("read"):
            connection = connect(self.store_url, self.options)
            try:
                with expiring(connection, self._deadline_seconds()):
                    channel = connection.channel()
                    try:
                        declared = channel.queue_declare(destination, passive=True)
                    except pe.ChannelClosedByBroker as exc:
                        if exc.reply_code != 404:
                            raise
                        raise self.make_error(
                            ConfigurationError,
                            "read",
                            f"no queue {destination!r} on vhost {vhost(self.store_url)!r}",
                        ) from exc
                    held: list[tuple[int, ReadMessage]] = []
                    for position in range(int(declared.method.message_count)):
                        method, properties, body = channel.basic_get(destination, auto_ack=False)
                        if method is None:
                            break
                        held.append(
                            (method.delivery_tag, _read(destination, properties, body, position))
                        )
                    result = settle(channel, held)
                    channel.close()  # after the acks: the rest go back
                    return result
            finally:
                close_quietly(connection)


def _read(destination: str, properties: Any, body: bytes, position: int) -> ReadMessage:
    """An AMQP message as a :class:`ReadMessage` (as the dispatcher publishes it)."""
    text = body.decode("utf-8", "replace")
    try:
        decoded: Any = json.loads(text)
    except ValueError:
        decoded = text
    headers = {str(k): str(v) for k, v in (properties.headers or {}).items()}
    message = OutgoingMessage(str(properties.message_id or ""), destination, decoded, headers)
    return ReadMessage(message, len(body), str(position))
