"""The RabbitMQ broker of the async consume loop: :class:`AioPikaBroker` (aio-pika).

The same queue, options, deliveries and guarantees as
:class:`~dedupstore.backends.rabbitmq.consumer.RabbitMQBroker` (see that module): manual
acknowledgements under a prefetch window, ``basic.nack`` with ``requeue=true``, delivery
counts from a quorum queue's ``x-delivery-count``, tokens of a lost channel ignored (the
broker requeued those deliveries), and the next call connecting again after a lost
connection. Its calls are awaited on the event loop (aio-pika, no thread): each one
bounded by ``connect_timeout`` to connect and ``timeout`` for the rest (a fetch: its
``wait`` plus ``timeout``), so one call never outlives ``(retries + 1) x
(connect_timeout + timeout)``.

Opened by :func:`dedupstore.aio.open_broker` (``amqp://`` and ``amqps://`` URLs), or
``await AioPikaBroker(url, **options).open()``.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

import aio_pika
import aiormq.exceptions as ae
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractIncomingMessage

from dedupstore.backend import (
    AsyncBroker,
    ConfigurationError,
    Delivery,
    ErrorKind,
    StoreUnavailable,
    quiet_driver_logs,
)

from ._client import queue_arguments, vhost
from .consumer import RabbitMQQueue, RabbitMQToken, delivery_of

__all__ = ["AioPikaBroker"]

# aiormq logs an ERROR line for a refused connection; the caller gets one StoreUnavailable
quiet_driver_logs("aiormq", "aio_pika")

#: AMQP reply codes that mean "fix the configuration" (see ``_client``).
_CONFIGURATION_CODES = frozenset({403, 404, 405, 406, 530})


class _Queue(RabbitMQQueue):
    """The options and error rules of :class:`AioPikaBroker` (no I/O of its own)."""

    def _classify_error(self, exc: BaseException) -> ErrorKind:
        if isinstance(exc, ae.ProbableAuthenticationError | ae.AuthenticationError):
            return ConfigurationError
        code = _reply_code(exc)
        if code == 404:
            return self.make_error(
                ConfigurationError, None, f"{self.describe_error(exc)} (a missing queue)"
            )
        if code is not None:
            return ConfigurationError if code in _CONFIGURATION_CODES else StoreUnavailable
        if isinstance(exc, ae.AMQPError | OSError | TimeoutError | ConnectionError):
            return StoreUnavailable
        return super()._classify_error(exc)


_Queue.__name__ = "AioPikaBroker"  # the name its errors give: the user's class


def _reply_code(exc: BaseException) -> int | None:
    """The AMQP reply code of a channel or connection the broker closed (aiormq)."""
    if isinstance(exc, ae.ChannelClosed | ae.ConnectionClosed):
        code = exc.args[0] if exc.args else None
        return code if isinstance(code, int) else None
    return None


@dataclass(eq=False)
class _Link:
    """One connection, its channel, what arrived and is not fetched yet, and the
    messages handed out and not settled (by delivery tag)."""

    connection: AbstractConnection
    channel: AbstractChannel
    generation: int
    received: collections.deque[Delivery] = field(default_factory=collections.deque)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    unsettled: dict[int, AbstractIncomingMessage] = field(default_factory=dict)

    @property
    def live(self) -> bool:
        return not self.connection.is_closed and not self.channel.is_closed


class AioPikaBroker(AsyncBroker):
    """A RabbitMQ queue consumed on the event loop with aio-pika (see the module).

    Raises ``ConfigurationError`` for bad options (at construction, before any I/O),
    credentials, permissions, a missing queue without ``create``, or a queue declared
    with other arguments; ``StoreUnavailable`` when the broker cannot answer (the next
    call connects again). One consume loop per object, on one event loop.
    """

    kind = "rabbitmq"

    def __init__(self, url: str, /, **options: Any) -> None:
        """Check ``url`` and ``options`` (those of ``RabbitMQBroker``); no I/O."""
        self.client = _Queue(url, **options)
        self.queue = self.client.queue
        self.prefetch = self.client.prefetch
        self._generation = 0
        self._link: _Link | None = None

    @property
    def url(self) -> str:
        """The broker's URL, its secrets masked."""
        return self.client.url

    async def open(self) -> AioPikaBroker:
        """Connect, declare (or check) the queue and start consuming; return ``self``."""
        await self._current("open")
        return self

    async def _current(self, operation: str) -> _Link:
        """The live link, connected again when it was lost."""
        self.client.check_open()
        link = self._link
        if link is not None and link.live:
            return link
        self._link = None
        if link is not None:
            await _close_quietly(link.connection)
        with self.client.translating_errors(operation):
            return await self._connect()

    async def _connect(self) -> _Link:
        options, url = self.client.options, self.client.store_url
        user = options["username"] if options["username"] is not None else url.username
        password = options["password"] if options["password"] is not None else url.password
        kwargs: dict[str, Any] = {
            "host": url.host,
            "port": url.port or (5671 if url.scheme == "amqps" else 5672),
            "virtualhost": vhost(url),
            "login": user or "guest",
            "password": password or "guest",
            "timeout": options["connect_timeout"],
            "client_properties": {"connection_name": "dedupstore"},
        }
        if options["heartbeat"] is not None:
            kwargs["heartbeat"] = options["heartbeat"]
        if url.scheme == "amqps":
            kwargs["ssl"] = True
            kwargs["ssl_context"] = ssl.create_default_context(cafile=options["ssl_ca_certs"])
        async with asyncio.timeout(options["connect_timeout"]):
            connection = await aio_pika.connect(**kwargs)
        try:
            async with asyncio.timeout(options["timeout"]):
                channel = await connection.channel()
                queue = await self._declare(channel)
                await channel.set_qos(prefetch_count=self.prefetch)
                self._generation += 1
                link = _Link(connection, channel, self._generation)
                for closing in (connection, channel):  # a fetch waiting wakes up at once
                    closing.close_callbacks.add(lambda *_: link.arrived.set())

                async def received(message: AbstractIncomingMessage) -> None:
                    token = RabbitMQToken(
                        link.generation, int(message.delivery_tag or 0), bool(message.redelivered)
                    )
                    link.unsettled[token.delivery_tag] = message
                    link.received.append(
                        delivery_of(
                            token,
                            message.body,
                            dict(message.headers),
                            message.message_id,
                            message.correlation_id,
                        )
                    )
                    link.arrived.set()

                await queue.consume(received, no_ack=False)
        except BaseException:
            await _close_quietly(connection)
            raise
        self._link = link
        return link

    async def _declare(self, channel: AbstractChannel) -> Any:
        passive = not self.client.creates
        try:
            return await channel.declare_queue(
                self.queue,
                passive=passive,
                durable=True,
                arguments=None if passive else queue_arguments(self.client.options["queue_type"]),
            )
        except ae.ChannelNotFoundEntity as exc:
            raise self.client.no_such_store(
                f"queue {self.queue!r} on vhost {vhost(self.client.store_url)!r}",
                "declare it, or open with create=true",
            ) from exc

    async def _dropped(self, link: _Link) -> None:
        """After an error: the link is dropped (the broker requeues its deliveries)."""
        if self._link is link:
            self._link = None
        await _close_quietly(link.connection)

    async def fetch(self, max_count: int, wait: float) -> list[Delivery]:
        """Up to ``max_count`` deliveries, waiting up to ``wait`` seconds for the first."""
        link = await self._current("fetch")
        try:
            with self.client.translating_errors("fetch"):
                if not link.received and wait > 0 and link.live:
                    link.arrived.clear()  # set by a delivery, or by the link closing
                    with suppress(TimeoutError):
                        await asyncio.wait_for(link.arrived.wait(), wait)
                if not link.received and not link.live:
                    raise ConnectionError("the connection to RabbitMQ was lost")
        except BaseException:
            await self._dropped(link)
            raise
        count = min(max_count, len(link.received))
        return [link.received.popleft() for _ in range(count)]

    async def ack(self, deliveries: Sequence[Delivery]) -> None:
        """``basic.ack`` each delivery of this channel not settled yet (idempotent;
        deliveries of a lost channel were requeued by the broker already)."""
        await self._settle(deliveries, "ack")

    async def nack(self, deliveries: Sequence[Delivery]) -> None:
        """``basic.nack`` with ``requeue=true``: redelivered, here or to another consumer."""
        await self._settle(deliveries, "nack")

    async def _settle(self, deliveries: Sequence[Delivery], operation: str) -> None:
        self.client.check_open()
        link = self._link
        if link is None:
            return
        messages = [
            link.unsettled.pop(d.token.delivery_tag)
            for d in deliveries
            if isinstance(d.token, RabbitMQToken)
            and d.token.generation == link.generation
            and d.token.delivery_tag in link.unsettled
        ]
        if not messages:
            return
        try:
            with self.client.translating_errors(operation):
                async with asyncio.timeout(self.client.options["timeout"]):
                    for message in messages:
                        if operation == "ack":
                            await message.ack()
                        else:
                            await message.nack(requeue=True)
        except BaseException:
            await self._dropped(link)
            raise

    async def pending(self) -> int | None:
        """Messages ready in the queue (not counting those delivered, unacknowledged)."""
        link = await self._current("pending")
        try:
            with self.client.translating_errors("pending"):
                async with asyncio.timeout(self.client.options["timeout"]):
                    queue = await link.channel.declare_queue(self.queue, passive=True)
        except BaseException:
            await self._dropped(link)
            raise
        result = queue.declaration_result
        return int(result.message_count or 0)

    async def close(self) -> None:
        """Close the connection (unacknowledged deliveries go back to the queue)."""
        link, self._link = self._link, None
        if link is not None:
            await _close_quietly(link.connection)
        self.client.close()


async def _close_quietly(connection: AbstractConnection) -> None:
    try:
        async with asyncio.timeout(2.0):
            await connection.close()
    except Exception:  # noqa: BLE001 - it may be dead already
        pass
