"""Dead letters read back: :class:`ReadBack`, :class:`DeadLetterQueue`, :func:`letter_body`.

A dead letter is an outgoing message like any other: the processor dispatches it to
its ``dead_letters`` destination (the body: the original ``message``, the
``error``, the ``attempts`` and the ``consumer``), and the consume loop dispatches
one for a delivery that never was a message (the body: the ``delivery`` as it came,
the ``error`` and the ``consumer``). A dispatcher whose destinations can be read
back implements :class:`ReadBack` (the Redis Streams dispatcher, the SQLite table
queue and the RabbitMQ dispatcher); :class:`DeadLetterQueue` lists, gets and
deletes the letters of one destination through it (what ``dedupstore dead-letters``
runs), and :func:`letter_body` turns a letter in any form it is read (the
``OutgoingMessage``, a stream entry, a queue row, an AMQP body, JSON text) into the
letter's body, the form :meth:`~dedupstore.outbox.OutboxProcessor.redrive` takes.

In token mode a letter keeps a token, its *redrive token* (:func:`redrive_token`):
:meth:`DeadLetterQueue.purge` deletes it with the letter, so that discarding a letter
never leaves its token behind.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Protocol, runtime_checkable

from dedupstore.entities import OutgoingMessage
from dedupstore.errors import ConfigurationError, InvalidMessageId

if TYPE_CHECKING:
    from dedupstore.tokens import TokenStore

__all__ = [
    "DeadLetter",
    "DeadLetterQueue",
    "Purged",
    "ReadBack",
    "ReadMessage",
    "RedriveToken",
    "letter_body",
    "letter_kind",
    "redrive_token",
]

#: What a letter is: a processor's letter of a ``message``, the consume loop's letter
#: of a malformed ``delivery``, the letter of a Spark ``row`` whose id or correlation
#: id was null or invalid, or ``unknown`` (not a dedupstore dead letter). Only the
#: letter of a ``message`` can be redriven: the others never were messages.
LetterKind = Literal["message", "bounded", "delivery", "row", "unknown"]

#: The error type of the letter of an invalid Spark row (its stand-in message's id
#: starts with ``invalid-row:``: see ``dedupstore.spark.pipeline``).
_INVALID_ROW = f"{InvalidMessageId.__module__}.{InvalidMessageId.__qualname__}"


@dataclass(frozen=True)
class ReadMessage:
    """One message read back from a destination: ``message`` (body and headers decoded
    from JSON; a body that is not JSON as its text), ``size`` (bytes of the body as
    stored) and ``position`` (where the destination holds it: a stream entry id, a
    row's seq, a place in a queue)."""

    message: OutgoingMessage
    size: int
    position: str


@runtime_checkable
class ReadBack(Protocol):
    """A dispatcher whose destinations can be read back (what it dispatched) and emptied."""

    def read_back(self, destination: str) -> list[ReadMessage]:
        """Every message ``destination`` holds now, oldest first; none are consumed.

        Raises ``ConfigurationError`` (a destination that cannot be read back this
        way), ``StoreUnavailable``.
        """

    def remove(self, destination: str, messages: Sequence[ReadMessage]) -> int:
        """Remove ``messages`` (as :meth:`read_back` returned them) from ``destination``;
        return how many were still there. Raises ``StoreUnavailable``."""


@dataclass(frozen=True)
class DeadLetter:
    """A dead letter as read back.

    ``id``: the letter's message id (the one ``dedupstore dead-letters`` names);
    ``kind``: ``message`` (a processor's letter: ``message_id`` and ``entity`` are
    the original message's), ``bounded`` (a processor's letter too large to keep
    whole: the original's body or headers are only their size and digest, so it
    cannot be redriven), ``row`` (an invalid Spark row), ``delivery`` (a malformed
    delivery the consume loop set aside: no message id or entity) or ``unknown``;
    ``consumer``: who set it aside; ``reason``: the error (``"<type>: <text>"``);
    ``size``: bytes of the body as stored; ``copies``: what the destination holds of
    it (one, or more after a re-dispatch).
    """

    id: str
    destination: str
    kind: LetterKind
    message_id: str | None
    entity: str | None
    consumer: str | None
    reason: str
    size: int
    body: Any
    headers: Mapping[str, str]
    copies: tuple[ReadMessage, ...]

    def to_json(self) -> dict[str, Any]:
        """The letter as ``dedupstore dead-letters show`` prints it (what ``redrive`` takes)."""
        return {
            "id": self.id,
            "destination": self.destination,
            "body": self.body,
            "headers": dict(self.headers),
        }


def _text(value: Any) -> Any:
    return bytes(value).decode("utf-8") if isinstance(value, bytes | bytearray) else value


def letter_body(letter: object) -> dict[str, Any]:
    """The body of a dead letter given in any form it is read back.

    Takes the letter's body (a dict with ``message`` or ``delivery``), an
    ``OutgoingMessage``, a :class:`DeadLetter` or :class:`ReadMessage`, a row of the
    SQLite table queue (``StoredMessage``), a Redis stream entry (its fields, with
    ``bytes`` or ``str`` keys, or the ``(entry id, fields)`` pair ``XRANGE`` gives), a
    message as printed by ``dedupstore dead-letters show`` (a dict with ``body``), an
    AMQP body or any JSON text of these. Raises ``ConfigurationError`` for anything
    else ("not a dead letter").
    """
    value: Any = letter
    for _ in range(6):  # each step unwraps one layer
        if isinstance(value, DeadLetter | OutgoingMessage):
            value = value.body
        elif isinstance(value, ReadMessage):
            value = value.message
        elif isinstance(value, bytes | bytearray | memoryview | str):
            try:
                value = json.loads(bytes(value) if isinstance(value, memoryview) else value)
            except (ValueError, UnicodeDecodeError):
                break
        elif isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], Mapping):
            value = value[1]  # (entry id, fields)
        elif isinstance(value, Mapping):
            fields = {_text(k): v for k, v in value.items()}
            if isinstance(fields.get("message"), Mapping) or isinstance(
                fields.get("delivery"), Mapping
            ):
                return fields
            if "body" not in fields:
                break
            value = _text(fields["body"])
        elif isinstance(getattr(value, "message", None), OutgoingMessage):
            value = value.message  # a StoredMessage
        else:
            break
    shown = repr(letter)
    raise ConfigurationError(
        f"not a dead letter: {shown[:200]}{'...' if len(shown) > 200 else ''} (a dead "
        "letter's body holds the original 'message' or 'delivery', its 'error' and 'consumer')"
    )


def letter_kind(body: Mapping[str, Any]) -> LetterKind:
    """What the letter of ``body`` (a letter's body, see :func:`letter_body`) is."""
    original, error = body.get("message"), body.get("error")
    if isinstance(original, Mapping):
        mid = original.get("id")
        if (
            isinstance(mid, str)
            and mid.startswith("invalid-row:")
            and isinstance(error, Mapping)
            and error.get("type") == _INVALID_ROW
        ):
            return "row"
        if "body_omitted" in original or "headers_omitted" in original:
            return "bounded"  # too large to keep whole: size and digest only, no redrive
        return "message"
    if isinstance(body.get("delivery"), Mapping):
        return "delivery"
    return "unknown"


def _reason(body: Mapping[str, Any]) -> str:
    error = body.get("error")
    if not isinstance(error, Mapping):
        return "-"
    kind = str(error.get("type", "?")).rsplit(".", 1)[-1]
    return f"{kind}: {error.get('text', '')}"


def _letter(copies: list[ReadMessage]) -> DeadLetter:
    first = copies[0].message
    kind: LetterKind = "unknown"
    message_id = entity = consumer = None
    reason = "not a dedupstore dead letter"
    try:
        body = letter_body(first)
    except ConfigurationError:
        pass
    else:
        consumer = str(body.get("consumer", "")) or None
        reason = _reason(body)
        kind = letter_kind(body)
        original = body.get("message")
        if isinstance(original, Mapping):
            message_id = str(original.get("id"))
            entity = str(original.get("correlation_id"))
    return DeadLetter(
        id=first.id,
        destination=first.destination,
        kind=kind,
        message_id=message_id,
        entity=entity,
        consumer=consumer,
        reason=reason,
        size=copies[0].size,
        body=first.body,
        headers=first.headers,
        copies=tuple(copies),
    )


class RedriveToken(NamedTuple):
    """The token a dead letter keeps in token mode: its ``id`` and the receiving
    ``endpoint`` it was minted for (the consumer that set the message aside)."""

    id: str
    endpoint: str


def redrive_token(letter: DeadLetter) -> RedriveToken | None:
    """The redrive token of ``letter``, or None when it keeps none.

    A processor in token mode that sets aside a message carrying a token exchanges
    that token for ``token_id(letter id, consumer, nonce)`` (the nonce of the
    original's ``dedupstore-token`` header, kept in the letter): what the letter's
    redrive consumes. Letters of messages without the header, of malformed
    deliveries and of Spark rows keep none. No I/O: whether the token still exists
    is the token store's to say. A bounded letter, whose original headers were
    replaced by their size and digest, keeps their nonce beside them (``token``).
    Raises ``InvalidMessageId`` for a nonce that is not one or a letter whose
    consumer is missing.
    """
    from dedupstore.tokens import TOKEN_HEADER, token_id, validate_nonce

    if letter.kind not in ("message", "bounded"):
        return None
    try:
        body = letter_body(letter)
    except ConfigurationError:
        return None
    original = body.get("message")
    if not isinstance(original, Mapping):
        return None
    headers = original.get("headers")
    # a bounded letter keeps its headers' size and digest, and the nonce they carried
    nonce = headers.get(TOKEN_HEADER) if isinstance(headers, Mapping) else original.get("token")
    if nonce is None:
        return None
    consumer = letter.consumer
    if not consumer:
        raise InvalidMessageId(
            f"dead letter {letter.id}: it carries a {TOKEN_HEADER} header but names no "
            "consumer, so its redrive token cannot be named"
        )
    return RedriveToken(token_id(letter.id, consumer, validate_nonce(nonce, letter.id)), consumer)


@dataclass(frozen=True)
class Purged:
    """What :meth:`DeadLetterQueue.purge` did: ``letters`` purged, ``messages_removed``
    (copies included), ``tokens_deleted`` (redrive tokens deleted: those that no longer
    existed count too, a delete being idempotent) and ``tokens_left`` (the letters whose
    token was left, with ``leave_tokens``)."""

    letters: int
    messages_removed: int
    tokens_deleted: int
    tokens_left: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """As ``dedupstore dead-letters purge`` prints it."""
        return {
            "purged": self.letters,
            "messages_removed": self.messages_removed,
            "tokens_deleted": self.tokens_deleted,
            "tokens_left": list(self.tokens_left),
        }


def _unreadable(scheme: str) -> ConfigurationError:
    return ConfigurationError(
        f"dead letters cannot be read back from a {scheme} dispatcher (readable: redis://, "
        "sqlite:// and amqp:// dispatchers); read them where the destination delivers them"
    )


def _scheme(dispatcher: object) -> str:
    url = getattr(dispatcher, "url", None)
    if isinstance(url, str) and "://" in url:
        return f"{url.split('://', 1)[0]}://"
    return type(dispatcher).__name__


class DeadLetterQueue:
    """The dead letters of one destination of a dispatcher that can read them back.

    Raises ``ConfigurationError`` (no I/O) for a dispatcher that cannot (``memory://``,
    a callable, Kafka, any dispatcher without :class:`ReadBack`), naming its scheme.
    """

    def __init__(self, dispatcher: object, destination: str) -> None:
        if not isinstance(dispatcher, ReadBack):
            raise _unreadable(_scheme(dispatcher))
        if not isinstance(destination, str) or not destination:
            raise ConfigurationError(f"a dead-letter destination is needed, got {destination!r}")
        self.dispatcher: ReadBack = dispatcher
        self.destination = destination

    def list(self) -> list[DeadLetter]:
        """Every letter, oldest first (copies of one id as one letter). Raises
        ``StoreUnavailable``."""
        by_id: dict[str, list[ReadMessage]] = {}
        for read in self.dispatcher.read_back(self.destination):
            by_id.setdefault(read.message.id, []).append(read)
        return [_letter(copies) for copies in by_id.values()]

    def get(self, letter_id: str) -> DeadLetter | None:
        """The letter ``letter_id``, or ``None``. Raises ``StoreUnavailable``."""
        return next((letter for letter in self.list() if letter.id == letter_id), None)

    def delete(self, letters: Collection[DeadLetter]) -> int:
        """Remove ``letters`` (every copy); return how many messages were removed. Their
        redrive tokens are not touched: what a redrive that consumed them does; to
        discard letters, :meth:`purge`."""
        copies = [read for letter in letters for read in letter.copies]
        return self.dispatcher.remove(self.destination, copies) if copies else 0

    def purge(
        self,
        letters: Collection[DeadLetter],
        *,
        tokens: TokenStore | None = None,
        leave_tokens: bool = False,
    ) -> Purged:
        """Discard ``letters`` for good: delete the redrive token of each that keeps one
        (:func:`redrive_token`) from ``tokens``, then remove the letters.

        Every letter is checked before anything is written: without ``tokens``, a letter
        that keeps a token raises ``ConfigurationError`` naming it, since its token
        would be left forever, unless ``leave_tokens`` says to leave such tokens
        (``dedupstore tokens orphans`` finds them later). The tokens go first: a failure
        between the two leaves letters whose redrive would be a duplicate, and purging
        them again completes it. Raises
        ``ConfigurationError``, ``InvalidMessageId``, ``StoreUnavailable``.
        """
        letters = list(letters)
        ids: dict[str, str] = {}
        left: list[str] = []
        for letter in letters:
            token = redrive_token(letter)
            if token is None:
                continue
            if tokens is None:
                if not leave_tokens:
                    raise ConfigurationError(
                        f"dead letter {letter.id} (message {letter.message_id!r:.80}, consumer "
                        f"{token.endpoint!r:.80}) keeps a redrive token: give the token store "
                        "to delete it with the letter (--tokens URL), or leave it on purpose "
                        "(--leave-tokens); nothing was purged"
                    )
                left.append(letter.id)
                continue
            ids[token.id] = letter.id
        if ids:
            assert tokens is not None
            tokens.delete(list(ids))
        removed = self.delete(letters)
        return Purged(len(letters), removed, len(ids), tuple(left))
