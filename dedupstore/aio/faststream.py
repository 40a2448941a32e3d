"""Exactly-once FastStream subscribers: :func:`exactly_once` and
:class:`FastStreamDispatcher` (the extra ``faststream``).

::

    broker = RedisBroker(REDIS)
    processor = aio.AsyncOutboxProcessor(
        entities, dedup, FastStreamDispatcher(broker, to="stream"), dead_letters="bills.dead"
    )

    @broker.subscriber(stream=StreamSub("orders", group="billing", consumer="b-1"))
    @exactly_once(processor, entity=lambda body, message: body["customer"])
    async def bill(state, message):  # -> (new state, [Send(...)]): the outbox runs around it
        ...

A delivery is acknowledged only once the processor is done with it (FastStream acks
what returns). A store outage or a conflict that outlasted the processor's attempts is
*not* the message's fault: the delivery is nacked after a pause (redelivered, never set
aside). A delivery that is no message (no stable id, no entity, an invalid id) is
rejected with one log line: the broker's dead-lettering takes it. A handler that fails
is the processor's to set aside (its ``dead_letters``).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable, Sequence
from typing import Any

from faststream import Context, StreamMessage
from faststream.exceptions import NackMessage, RejectMessage

from dedupstore.aio.processor import AsyncHandler, AsyncOutboxProcessor
from dedupstore.calls import pause_before
from dedupstore.entities import OutgoingMessage
from dedupstore.errors import ConcurrencyConflict, InvalidMessageId, StoreUnavailable, format_error
from dedupstore.outbox import Message

__all__ = ["FastStreamDispatcher", "exactly_once", "message_id_of"]

_log = logging.getLogger("dedupstore.faststream")

#: Where FastStream's Redis envelope keeps a message id it was given (without one, its
#: parser makes a new id at every delivery).
REDIS_ID_HEADER = "message_id"


def message_id_of(message: StreamMessage[Any]) -> str | None:
    """The id the publisher gave ``message``, the same on every delivery; None when it
    has none (FastStream then shows an id made up at this delivery, which would make
    every redelivery a new message).

    RabbitMQ: the AMQP ``message_id`` property; Redis: the envelope's ``message_id``
    header (what :class:`FastStreamDispatcher` sets); other brokers: the message's
    ``message_id`` as FastStream reads it from the broker."""
    raw = message.raw_message
    amqp = getattr(raw, "message_id", _NONE)
    if amqp is not _NONE:  # aio-pika's IncomingMessage
        return str(amqp) if amqp else None
    if isinstance(raw, dict) and "channel" in raw:  # FastStream's Redis envelope
        given = message.headers.get(REDIS_ID_HEADER)
        return str(given) if given else None
    return message.message_id or None


_NONE = object()
#: FastStream's injection of the delivery (as the subscriber's second argument).
_MESSAGE = Context("message")


def exactly_once(
    processor: AsyncOutboxProcessor,
    *,
    entity: Callable[[Any, StreamMessage[Any]], str] | None = None,
    message_id: Callable[[StreamMessage[Any]], str | None] = message_id_of,
    outage_pause: float = 1.0,
) -> Callable[[AsyncHandler], Callable[..., Any]]:
    """Make ``handler(state, message) -> (new_state, sends)`` (``def`` or ``async def``)
    a FastStream subscriber function that processes each message exactly once with
    ``processor``.

    ``entity(body, message)`` names the message's entity (default: the message's
    ``correlation_id``, which the publisher must then set); ``message_id(message)`` its
    stable id (default :func:`message_id_of`). The handler gets a
    :class:`~dedupstore.outbox.Message` whose body is the decoded body and whose headers
    are the delivery's. The subscriber returns nothing (a publisher decorator of
    FastStream has nothing to send: the handler's sends go through the outbox).

    ``StoreUnavailable`` and ``ConcurrencyConflict`` nack the delivery after a pause
    (``outage_pause`` seconds at most, growing with the deliveries that met one, with
    jitter): an outage never sets a message aside. A delivery without a stable id or
    entity, or with an invalid one, is rejected (logged; the broker's dead-letter
    policy takes it). Other errors propagate to FastStream's ``ack_policy``.
    """
    outages = 0

    def decorate(handler: AsyncHandler) -> Callable[..., Any]:
        async def consume(body: Any, message: StreamMessage[Any] = _MESSAGE) -> None:
            nonlocal outages
            mid = message_id(message)
            if entity is not None:
                cid = entity(body, message)
            else:
                cid = message.correlation_id if _stable_correlation(message) else ""
            if not mid or not cid:
                _log.error(
                    "consumer %s: rejected a delivery without a stable %s (%s); publish "
                    "with a message id and the entity (correlation id), e.g. through "
                    "FastStreamDispatcher",
                    processor.consumer,
                    "message id" if not mid else "entity",
                    _described(message),
                )
                raise RejectMessage
            headers = {str(k): str(v) for k, v in (message.headers or {}).items()}
            try:
                await processor.process(Message(mid, cid, body, headers), handler)
            except InvalidMessageId as exc:
                _log.error(
                    "consumer %s: rejected delivery %s: %s",
                    processor.consumer,
                    _described(message),
                    format_error(exc),
                )
                raise RejectMessage from exc
            except (StoreUnavailable, ConcurrencyConflict) as exc:
                outages += 1
                pause = min(outage_pause, pause_before(outages))
                _log.warning(
                    "consumer %s: message %.80r of entity %.80r held (redelivered): %s",
                    processor.consumer,
                    mid,
                    cid,
                    format_error(exc),
                )
                await asyncio.sleep(pause)
                raise NackMessage from exc
            outages = 0

        consume.__name__ = getattr(handler, "__name__", "consume")
        consume.__qualname__ = getattr(handler, "__qualname__", "consume")
        consume.__doc__ = handler.__doc__
        return consume

    return decorate


def _stable_correlation(message: StreamMessage[Any]) -> bool:
    """Whether the correlation id came with the message (not made up at this delivery)."""
    raw = message.raw_message
    amqp = getattr(raw, "correlation_id", _NONE)
    if amqp is not _NONE:
        return bool(amqp)
    if isinstance(raw, dict) and "channel" in raw:
        return bool(message.headers.get("correlation_id"))
    return bool(message.correlation_id)


def _described(message: StreamMessage[Any]) -> str:
    return f"message_id={message.message_id!r:.80} correlation_id={message.correlation_id!r:.80}"


class FastStreamDispatcher:
    """The processor's dispatcher through a FastStream broker: each outgoing message
    published to its destination, as the ``to`` argument of the broker's ``publish``
    (``"queue"`` or ``"exchange"`` on RabbitMQ; ``"stream"``, ``"list"`` or
    ``"channel"`` on Redis; ``"topic"`` on Kafka), with its id as the message id
    (RabbitMQ's property, Redis's ``message_id`` header): receivers deduplicate by it,
    and a receiver's :func:`exactly_once` reads it back. RabbitMQ messages are persistent and
    mandatory. ``publish`` is awaited message by message, in order; an error
    propagates (the entry stays in the outbox and is dispatched again)."""

    def __init__(self, broker: Any, *, to: str) -> None:
        """``broker``: a FastStream broker (connected when the processor dispatches)."""
        self.broker = broker
        self.to = to
        parameters = inspect.signature(broker.publish).parameters
        self._amqp = "message_id" in parameters and "persist" in parameters

    async def dispatch(self, messages: Sequence[OutgoingMessage]) -> None:
        """Publish ``messages``, in order."""
        for sent in messages:
            headers = dict(sent.headers)
            options: dict[str, Any] = {self.to: sent.destination}
            if self._amqp:
                options.update(message_id=sent.id, persist=True, mandatory=True)
            else:
                headers[REDIS_ID_HEADER] = sent.id
            await self.broker.publish(sent.body, headers=headers, **options)
