"""What the processor takes and gives: :class:`Message`, :class:`Send`, the ``Handler``
type, the :class:`Dispatcher` protocol, :class:`ProcessResult`, and the size rules of a
dispatcher's bounds (:func:`message_size`, :func:`check_size`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from dedupstore import canonical
from dedupstore.entities import OutgoingMessage, body_text
from dedupstore.errors import InvalidValue, MessageTooLarge
from dedupstore.ids import validate_message_id

Outcome = Literal["processed", "duplicate", "redispatched", "dead_lettered"]


@dataclass(frozen=True)
class Message:
    """An incoming message: its id, the correlation (entity) id, a body and headers.

    Raises ``InvalidMessageId`` for an id or correlation id that is not a ``str`` (the
    id rules are checked in full before the processor's first I/O) and
    ``InvalidValue`` for headers that are not a mapping of ``str`` to ``str``.
    """

    id: str
    correlation_id: str
    body: Any
    headers: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if type(self.id) is not str and not isinstance(self.id, str):
            validate_message_id(self.id)
        if type(self.correlation_id) is not str and not isinstance(self.correlation_id, str):
            validate_message_id(self.correlation_id, "correlation id")
        _check_headers(self.headers)


@dataclass(frozen=True)
class Send:
    """An outgoing message a handler asks for; the processor gives it its id.

    Raises ``InvalidMessageId`` for a destination that is not a ``str`` (the id rules
    are checked in full when the handler returns it) and ``InvalidValue`` for headers
    that are not a mapping of ``str`` to ``str``.
    """

    destination: str
    body: Any
    headers: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if type(self.destination) is not str and not isinstance(self.destination, str):
            validate_message_id(self.destination, "destination")
        _check_headers(self.headers)


def _check_headers(headers: object) -> None:
    """Headers map ``str`` to ``str``; raise ``InvalidValue`` naming what does not."""
    if type(headers) is dict and not headers:
        return
    if not isinstance(headers, Mapping):
        raise InvalidValue(
            f"headers must be a mapping of str to str, got {type(headers).__name__} {headers!r:.60}"
        )
    for key, value in headers.items():
        if not isinstance(key, str):
            raise InvalidValue(
                f"headers[{key!r:.60}]: header names must be str, got {type(key).__name__}"
            )
        if not isinstance(value, str):
            raise InvalidValue(
                f"headers[{canonical.string(key)[:60]}]: header values must be str, got "
                f"{type(value).__name__} {value!r:.60} (convert it with str() if it is meant "
                "as text)"
            )


#: ``handler(state, message) -> (new_state, sends)``: pure, deterministic.
Handler = Callable[[dict[str, Any], Message], tuple[dict[str, Any], Sequence[Send]]]


#: ``before_cleanup(messages, results)``: see :meth:`OutboxProcessor.process_batch`.
BeforeCleanup = Callable[[Sequence["Message"], Sequence["ProcessResult"]], None]


@runtime_checkable
class Dispatcher(Protocol):
    """Sends outgoing messages, at least once. Receivers deduplicate by message id."""

    def dispatch(self, messages: Sequence[OutgoingMessage]) -> None:
        """Send ``messages``; raise if any may not have been sent."""


class InMemoryDispatcher:
    """A dispatcher for tests: appends to :attr:`sent` (thread-safe)."""

    def __init__(self) -> None:
        self.sent: list[OutgoingMessage] = []
        self._lock = threading.Lock()

    def dispatch(self, messages: Sequence[OutgoingMessage]) -> None:
        """Record ``messages`` in :attr:`sent`."""
        with self._lock:
            self.sent.extend(messages)


@dataclass(frozen=True, slots=True)
class ProcessResult:
    """What processing one message did.

    ``outcome``: ``"processed"`` (this call applied the state change),
    ``"duplicate"`` (applied before; nothing left to do, or only the clean-up), or
    ``"redispatched"`` (applied before, its outgoing messages still pending: this
    call dispatched them again), or ``"dead_lettered"`` (its handler failed and the
    processor has ``dead_letters``: this call set it aside, exactly once, with one
    dead-letter message and no state change; or it was too large to process: see
    :meth:`OutboxProcessor.process`). ``outgoing``: the message's outgoing
    messages when known (the dead letter, for ``dead_lettered``). ``attempts``:
    loads (or kept entities taken), including those after a concurrency conflict
    (one more when the entity kept was stale). ``error``: the handler's
    error (``"<type>: <text>"``) for ``dead_lettered``.
    """

    message_id: str
    outcome: Outcome
    outgoing: tuple[OutgoingMessage, ...] = ()
    attempts: int = 1
    error: str | None = None


# ---------------------------------------------------------------------- sizes


def _utf8_over(bound: int, *texts: str) -> int | None:
    """UTF-8 bytes of ``texts`` together when more than ``bound``, else None (cheap when
    far below: nothing is encoded or joined)."""
    if sum(map(len, texts)) * 4 <= bound:  # (at most 4 bytes per code point)
        return None
    size = sum(
        len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
        for text in texts
    )
    return size if size > bound else None


def _headers_json(message: OutgoingMessage) -> str:
    """The JSON text of ``message``'s headers (``{}`` without headers), encoded once."""
    headers = message._headers_text if message._body_text is not None else None
    if headers is None:
        headers = canonical.dumps(dict(message.headers)) if message.headers else "{}"
    return headers


def message_size(message: OutgoingMessage) -> int:
    """The size a dispatcher's ``max_message_bytes`` bounds: UTF-8 bytes of the body's
    canonical JSON plus those of the headers' JSON (``{}`` without headers)."""
    body, headers = body_text(message), _headers_json(message)
    return len(body.encode("utf-8", "surrogatepass")) + len(headers.encode())


def check_size(
    dispatcher: object,
    message: OutgoingMessage,
    body: str | None = None,
    headers: str | None = None,
) -> MessageTooLarge | None:
    """The ``MessageTooLarge`` ``dispatcher`` would raise for ``message``, or None.

    ``dispatcher``'s bounds are its ``max_message_bytes`` (body and headers: see
    :func:`message_size`) and ``max_header_bytes`` (headers alone) attributes, if it
    has them (``None``: no bound). ``body`` and ``headers``: the message's JSON texts,
    when known. No I/O.
    """
    total: int | None = getattr(dispatcher, "max_message_bytes", None)
    heads: int | None = getattr(dispatcher, "max_header_bytes", None)
    if total is None and heads is None:
        return None
    if body is None:
        body = body_text(message)
    if headers is None:
        headers = _headers_json(message)
    name = type(dispatcher).__name__
    if heads is not None:
        size = _utf8_over(heads, headers)
        if size is not None:
            return MessageTooLarge(
                f"the headers of outgoing message {message.id!r:.80} are {size} bytes of "
                f"JSON; {name} accepts at most {heads} (nothing was sent)",
                outgoing_id=message.id,
                size=size,
                bound=heads,
            )
    if total is not None:
        size = _utf8_over(total, body, headers)
        if size is not None:
            return MessageTooLarge(
                f"outgoing message {message.id!r:.80} is {size} bytes (body and headers as "
                f"JSON); {name} accepts at most {total} (nothing was sent)",
                outgoing_id=message.id,
                size=size,
                bound=total,
            )
    return None


def _bounds(dispatcher: object) -> tuple[int | None, int | None]:
    return (
        getattr(dispatcher, "max_message_bytes", None),
        getattr(dispatcher, "max_header_bytes", None),
    )


def _validate(message: Message) -> None:
    """The message's ids, checked before any I/O."""
    validate_message_id(message.id)
    validate_message_id(message.correlation_id, "correlation id")


def _shown(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"
