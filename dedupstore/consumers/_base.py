"""The consume loop's broker interface: :class:`Delivery`, :class:`Broker`, :class:`MessageRules`.

A broker is one small class: :meth:`Broker.fetch` new deliveries, :meth:`Broker.ack`
what is done, :meth:`Broker.nack` what is not (redelivered later), and, for brokers
that do not redeliver by themselves after a consumer died (Redis Streams),
:meth:`Broker.reclaim` what such a consumer left. :class:`MessageRules` turns a
delivery into the :class:`~dedupstore.outbox.Message` the processor runs.
"""

from __future__ import annotations

import abc
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, ClassVar, Literal

from dedupstore.client import Closing
from dedupstore.errors import ConfigurationError, InvalidMessageId, MalformedDelivery
from dedupstore.ids import validate_message_id
from dedupstore.outbox import Message

__all__ = ["AsyncBroker", "Broker", "Delivery", "MessageRules", "headers_of", "shown_body"]


@dataclass(frozen=True)
class Delivery:
    """One delivery of a broker message.

    ``token``: the broker's handle to acknowledge it (a stream entry id, a delivery
    tag, ``(topic, partition, offset)``); ``body``: the payload; ``headers``: the
    named fields or headers the broker carried; ``deliveries``: how many times it was
    delivered, this time included, when the broker tells (else ``None``).
    """

    token: Any
    body: bytes | str
    headers: Mapping[str, str] = field(default_factory=dict)
    deliveries: int | None = None


class Broker(Closing, abc.ABC):
    """What the consume loop needs from a broker; a new broker is one such class.

    Delivery is at least once: whatever is not acknowledged comes back (to this
    consumer or another). A ``with`` block closes it. Methods raise
    ``StoreUnavailable`` when the broker cannot answer (the loop backs off and tries
    again).
    """

    #: The broker's name in metrics and logs (``dedupstore.consumer.*``'s ``broker``).
    kind: ClassVar[str] = "broker"

    @abc.abstractmethod
    def fetch(self, max_count: int, wait: float) -> list[Delivery]:
        """Up to ``max_count`` new deliveries, waiting up to ``wait`` seconds for one."""

    @abc.abstractmethod
    def ack(self, deliveries: Sequence[Delivery]) -> None:
        """``deliveries`` are done: never deliver them again."""

    @abc.abstractmethod
    def nack(self, deliveries: Sequence[Delivery]) -> None:
        """``deliveries`` are not done: deliver them again (later, maybe elsewhere)."""

    def keep(self, deliveries: Sequence[Delivery]) -> None:
        """``deliveries`` are still this consumer's (an outage stopped them; the loop
        runs them again): keep them from being redelivered elsewhere, without counting
        a delivery. The default does nothing: for brokers that keep an unacknowledged
        delivery with its consumer while the consumer lives (RabbitMQ, Kafka).
        """

    def reclaim(self, max_count: int) -> list[Delivery]:
        """Up to ``max_count`` deliveries a dead consumer left, now this one's.

        The default returns none: for brokers that redeliver by themselves.
        """
        return []

    def pending(self) -> int | None:
        """How many deliveries await (pending, lag), when the broker tells; else ``None``."""
        return None

    def close(self) -> None:
        """Release the broker's connections (nothing by default)."""


class AsyncBroker(abc.ABC):
    """:class:`~dedupstore.consumers.Broker` for asyncio: the same calls and contract,
    each an ``async def``. ``async with`` closes it.

    Delivery is at least once: whatever is not acknowledged comes back. Methods raise
    ``StoreUnavailable`` when the broker cannot answer (the loop backs off and tries
    again); a cancelled call leaves nothing acknowledged that was not done.
    """

    #: The broker's name in metrics and logs.
    kind: str = "broker"

    @abc.abstractmethod
    async def fetch(self, max_count: int, wait: float) -> list[Delivery]:
        """Up to ``max_count`` new deliveries, waiting up to ``wait`` seconds for one."""

    @abc.abstractmethod
    async def ack(self, deliveries: Sequence[Delivery]) -> None:
        """``deliveries`` are done: never deliver them again."""

    @abc.abstractmethod
    async def nack(self, deliveries: Sequence[Delivery]) -> None:
        """``deliveries`` are not done: deliver them again (later, maybe elsewhere)."""

    async def keep(self, deliveries: Sequence[Delivery]) -> None:  # noqa: B027
        """``deliveries`` are still this consumer's: keep their lease (see
        :meth:`Broker.keep <dedupstore.consumers.Broker.keep>`; nothing by default)."""

    async def reclaim(self, max_count: int) -> list[Delivery]:
        """Up to ``max_count`` deliveries a dead consumer left (none by default)."""
        return []

    async def pending(self) -> int | None:
        """How many deliveries await, when the broker tells; else ``None``."""
        return None

    async def close(self) -> None:  # noqa: B027
        """Release the broker's connections (nothing by default)."""

    async def __aenter__(self) -> AsyncBroker:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


#: How a field of a delivery is read: a header name, or a function of the delivery.
Field = str | Callable[[Delivery], str]
BodyRule = Literal["json", "text", "bytes"] | Callable[[Delivery], Any]


@dataclass(frozen=True)
class MessageRules:
    """How a :class:`Delivery` becomes a :class:`~dedupstore.outbox.Message`.

    ``id`` and ``correlation_id``: the name of the header holding it, or a function
    of the delivery returning it. ``body``: ``"json"`` (the payload decoded as JSON),
    ``"text"`` (decoded as UTF-8), ``"bytes"`` (as is) or a function of the delivery.
    The message's headers are the delivery's, without those the ids were read from.
    The defaults read what :class:`~dedupstore.backends.redis.dispatcher.RedisDispatcher` writes
    (fields ``id``, ``body``, and ``correlation_id`` among the entry's headers).
    """

    id: Field = "id"
    correlation_id: Field = "correlation_id"
    body: BodyRule = "json"

    def __post_init__(self) -> None:
        for name in ("id", "correlation_id"):
            rule = getattr(self, name)
            if not (callable(rule) or (isinstance(rule, str) and rule)):
                raise ConfigurationError(
                    f"MessageRules.{name} must be a header name or a function of the "
                    f"delivery, got {rule!r}"
                )
        if not callable(self.body) and self.body not in ("json", "text", "bytes"):
            raise ConfigurationError(
                "MessageRules.body must be 'json', 'text', 'bytes' or a function of the "
                f"delivery, got {self.body!r}"
            )

    def message(self, delivery: Delivery) -> Message:
        """The message ``delivery`` carries.

        Raises :class:`~dedupstore.errors.MalformedDelivery` naming the delivery's
        token and what is missing or bad: no such header, an invalid id, a body that
        is not JSON or not UTF-8, or a rule function that raised.
        """
        mid = self._text(delivery, self.id, "message id")
        cid = self._text(delivery, self.correlation_id, "correlation id")
        used = {rule for rule in (self.id, self.correlation_id) if isinstance(rule, str)}
        headers = {k: v for k, v in delivery.headers.items() if k not in used}
        return Message(mid, cid, self._body(delivery), headers)

    def _text(self, delivery: Delivery, rule: Field, what: str) -> str:
        if isinstance(rule, str):
            value: object = delivery.headers.get(rule)
            if value is None:
                raise _malformed(delivery, f"it has no {rule!r} header (its {what})")
        else:
            try:
                value = rule(delivery)
            except Exception as exc:
                raise _malformed(delivery, f"reading its {what} raised {_error(exc)}") from exc
        try:
            return validate_message_id(value, what)
        except InvalidMessageId as exc:
            raise _malformed(delivery, str(exc)) from None

    def _body(self, delivery: Delivery) -> Any:
        rule, body = self.body, delivery.body
        if callable(rule):
            try:
                return rule(delivery)
            except Exception as exc:
                raise _malformed(delivery, f"reading its body raised {_error(exc)}") from exc
        if rule == "bytes":
            return body.encode("utf-8") if isinstance(body, str) else body
        try:
            text = body.decode("utf-8") if isinstance(body, bytes) else body
        except UnicodeDecodeError as exc:
            raise _malformed(delivery, f"its body is not UTF-8 text ({exc})") from None
        if rule == "text":
            return text
        try:
            return json.loads(text)
        except ValueError as exc:
            raise _malformed(delivery, f"its body is not JSON ({exc})") from None


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _malformed(delivery: Delivery, what: str) -> MalformedDelivery:
    return MalformedDelivery(
        f"delivery {delivery.token!r:.100} is not a message: {what}",
        token=delivery.token,
        reason=what,
    )


def shown_body(body: bytes | str) -> Any:
    """A delivery's body as JSON-compatible text (what a dead letter carries)."""
    if isinstance(body, str):
        return body
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        return {"hex": body.hex()}


def headers_of(delivery: Delivery) -> dict[str, str]:
    """A delivery's headers as plain ``str -> str``."""
    return {str(k): str(v) for k, v in delivery.headers.items()}
