"""Dispatchers opened by URL: :class:`URLDispatcher`, and :class:`CallableDispatcher`.

A dispatcher sends an entity's outgoing messages (:class:`~dedupstore.outbox.Dispatcher`,
re-exported here). Delivery is at least once: every receiver deduplicates by message
``id`` (each class's :attr:`receiver_dedup` says how). :class:`URLDispatcher` is a
:class:`~dedupstore.client.Client` (``dedupstore.open_dispatcher``): errors classified,
secrets masked, pickled by configuration, ``StoreClosed`` after ``close``. A backend
implements ``_dispatch``.

Size bounds: :attr:`~URLDispatcher.max_message_bytes` (body and headers:
:func:`~dedupstore.outbox.message_size`) and :attr:`~URLDispatcher.max_header_bytes`,
``None`` for no bound; each backend's page states its own (SQLite: the file's
``SQLITE_LIMIT_LENGTH``; Redis Streams 512 MiB; RabbitMQ 128 MiB and headers of 127
KiB; a Kafka producer in a :class:`CallableDispatcher`: give it Kafka's
``message.max.bytes``). The ``max_message_bytes`` option lowers the bound. A message
over a bound is refused before any I/O with ``MessageTooLarge`` (nothing of the batch
is sent), and the processor refuses it before it is saved.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

from dedupstore import canonical
from dedupstore.client import Client, Closing
from dedupstore.entities import OutgoingMessage, canonical_json
from dedupstore.errors import ConfigurationError, StoreClosed
from dedupstore.ids import validate_message_id
from dedupstore.options import Option, OptionSet, integer, optional
from dedupstore.outbox import Dispatcher, check_size

__all__ = [
    "CallableDispatcher",
    "DispatchStats",
    "Dispatcher",
    "EncodedMessage",
    "StoredMessage",
    "URLDispatcher",
    "encode_messages",
]


@dataclass(frozen=True)
class EncodedMessage:
    """A validated outgoing message with its canonical JSON ``body`` and ``headers`` text."""

    message: OutgoingMessage
    body: str
    headers: str

    @property
    def id(self) -> str:
        """The message id."""
        return self.message.id

    @property
    def destination(self) -> str:
        """The message destination."""
        return self.message.destination

    def decoded(self) -> OutgoingMessage:
        """A copy as a receiver sees it after the JSON round trip (tuples become lists)."""
        return OutgoingMessage(
            self.id, self.destination, canonical.loads(self.body), canonical.loads(self.headers)
        )


def encode_messages(messages: Sequence[OutgoingMessage]) -> list[EncodedMessage]:
    """Validate and encode a batch (no I/O).

    Raises ``TypeError`` when ``messages`` is not a sequence (a list or tuple) of
    :class:`~dedupstore.entities.OutgoingMessage`; ``InvalidMessageId`` (a
    ``ValueError``) when an id or destination breaks the id rules; ``ValueError``
    when a body is not JSON-compatible or a header is not ``str`` -> ``str``.
    """
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes | bytearray):
        raise TypeError(f"dispatch takes a list of OutgoingMessage, got {type(messages).__name__}")
    batch: list[EncodedMessage] = []
    for position, message in enumerate(messages):
        if not isinstance(message, OutgoingMessage):
            raise TypeError(
                f"dispatch takes OutgoingMessage items, got {type(message).__name__} "
                f"at position {position}"
            )
        if message._body_text is not None:  # the processor made it: checked and encoded there
            batch.append(EncodedMessage(message, message._body_text, message._headers_text))
            continue
        validate_message_id(message.id, "outgoing message id")
        validate_message_id(message.destination, "destination")
        headers = message.headers
        if not isinstance(headers, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in headers.items()
        ):
            raise ValueError(
                f"the headers of outgoing message {message.id!r:.80} must map str to str"
            )
        try:
            body = canonical_json(message.body)  # (a kept text was taken above)
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"the body of outgoing message {message.id!r:.80} is not JSON-compatible: {exc}"
            ) from None
        batch.append(
            EncodedMessage(message, body, canonical_json(dict(headers)) if headers else "{}")
        )
    return batch


def _checked(dispatcher: Dispatcher, messages: Sequence[OutgoingMessage]) -> list[EncodedMessage]:
    """:func:`encode_messages`, then ``MessageTooLarge`` for the first message over
    ``dispatcher``'s bounds."""
    batch = encode_messages(messages)
    for encoded in batch:
        refused = check_size(dispatcher, encoded.message, encoded.body, encoded.headers)
        if refused is not None:
            raise refused
    return batch


class DispatchStats(NamedTuple):
    """Totals of a table queue: distinct messages, deliveries, content mismatches."""

    rows: int
    deliveries: int
    mismatches: int


@dataclass(frozen=True)
class StoredMessage:
    """One row of a table queue.

    ``seq`` orders rows by first insertion (page with ``after=seq``); ``deliveries``
    counts the dispatches of the id; ``mismatches`` those whose content differed from
    the stored one (a handler that is not deterministic); ``first_at`` is epoch seconds.
    """

    seq: int
    message: OutgoingMessage
    deliveries: int
    mismatches: int
    first_at: float


class URLDispatcher(Client):
    """Base of the dispatchers opened by URL: validation, errors, pickling, closing.

    Guarantees (every backend): :meth:`dispatch` validates the whole batch before
    any I/O; an empty batch does no I/O; when it returns, every message is durably
    handed over (as durable as the backend is); when it raises ``StoreUnavailable``
    some, all or none may have been sent, and dispatching the batch again is
    correct. Delivery is at least once: receivers deduplicate by id.
    """

    #: How a receiver of this dispatcher deduplicates (shown by tools, documented per backend).
    receiver_dedup: ClassVar[str] = "by the message id: delivery is at least once"
    declared_options: ClassVar[OptionSet] = OptionSet(
        Option(
            "max_message_bytes",
            optional(integer(1)),
            None,
            "the largest message (body and headers, bytes of JSON) to send; at most the "
            "backend's own bound",
        )
    )
    #: The largest message this dispatcher accepts (:func:`~dedupstore.outbox.message_size`),
    #: ``None``: no bound. The backend's own bound, lowered by the ``max_message_bytes``
    #: option (see the module for each backend's).
    max_message_bytes: int | None = None
    #: The largest headers (bytes of their JSON) this dispatcher accepts; ``None``: no bound.
    max_header_bytes: int | None = None

    def _configure(self) -> None:
        super()._configure()
        limit: int | None = self.options["max_message_bytes"]
        own = self.max_message_bytes
        if limit is not None:
            self.max_message_bytes = limit if own is None else min(limit, own)

    def dispatch(self, messages: Sequence[OutgoingMessage]) -> None:
        """Send ``messages`` at least once; return when every one is handed over.

        Raises ``TypeError``/``ValueError``/``InvalidMessageId`` (bad batch) and
        ``MessageTooLarge`` (over :attr:`max_message_bytes` or :attr:`max_header_bytes`)
        before any I/O, ``StoreClosed``, ``StoreUnavailable`` (some may have been sent:
        dispatch again), ``ConfigurationError`` (permissions, a resource of another shape).
        """
        batch = _checked(self, messages)
        self.check_open()
        if not batch:
            return
        with self.translating_errors("dispatch"):
            self._dispatch(batch)

    @abc.abstractmethod
    def _dispatch(self, batch: list[EncodedMessage]) -> None:
        """Hand over every message of ``batch`` (not empty, validated, encoded) or raise."""


class CallableDispatcher(Closing):
    """Wraps ``fn(messages)`` as a dispatcher; picklable when ``fn`` is.

    :meth:`dispatch` validates the batch like :class:`URLDispatcher` and calls ``fn``
    with a list of the messages (not for an empty batch); what ``fn`` raises passes
    through, and ``fn`` must raise if any message may not have been sent.
    ``max_message_bytes`` and ``max_header_bytes`` (``None``: no bound) say what ``fn``'s
    destination accepts (a Kafka producer: its ``message.max.bytes``): a message over
    them is refused before ``fn`` is called (``MessageTooLarge``) and before it is saved.
    """

    receiver_dedup: ClassVar[str] = "up to the callable's receivers: by the message id"

    def __init__(
        self,
        fn: Callable[[list[OutgoingMessage]], object],
        *,
        max_message_bytes: int | None = None,
        max_header_bytes: int | None = None,
    ) -> None:
        """Raises ``ConfigurationError`` when ``fn`` is not callable or a bound is not
        ``None`` or an int >= 1."""
        if not callable(fn):
            raise ConfigurationError(f"a dispatcher callable is needed, got {type(fn).__name__}")
        for name, bound in (
            ("max_message_bytes", max_message_bytes),
            ("max_header_bytes", max_header_bytes),
        ):
            if bound is not None and (
                isinstance(bound, bool) or not isinstance(bound, int) or bound < 1
            ):
                raise ConfigurationError(f"{name} must be None or an int >= 1, got {bound!r}")
        self.fn = fn
        self.max_message_bytes = max_message_bytes
        self.max_header_bytes = max_header_bytes
        self._closed = False

    def dispatch(self, messages: Sequence[OutgoingMessage]) -> None:
        """Validate ``messages`` (no call if invalid or empty; ``MessageTooLarge`` for
        one over a bound), then call ``fn`` with them."""
        batch = _checked(self, messages)
        if self._closed:
            raise StoreClosed(f"{self!r} is closed; open a new one")
        if batch:
            self.fn([encoded.message for encoded in batch])

    def close(self) -> None:
        """Refuse further dispatches (``fn`` itself is not closed)."""
        self._closed = True

    def __repr__(self) -> str:
        return f"CallableDispatcher({self.fn!r})"
