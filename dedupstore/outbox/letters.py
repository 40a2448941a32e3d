"""Dead letters: the rule every letter follows (:func:`bounded_letter`), the processor's
refusal of a message (``_SetAside``) and :meth:`OutboxProcessor.redrive`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from dedupstore import canonical
from dedupstore.dead_letters import letter_body, letter_kind
from dedupstore.entities import OutgoingMessage
from dedupstore.errors import (
    ConcurrencyConflict,
    ConfigurationError,
    DeadLetterIncomplete,
    DedupStoreError,
    MessageTooLarge,
)
from dedupstore.ids import outgoing_id
from dedupstore.outbox._base import _Base
from dedupstore.outbox.messages import Handler, Message, ProcessResult, Send, _shown, _utf8_over
from dedupstore.steps import Steps, call
from dedupstore.tokens import TOKEN_HEADER

#: The header a redriven message carries: the id of the message first dead-lettered.
_REDRIVE_OF = "dedupstore-redrive-of"


#: A dead letter's error text is cut to this many characters (a handler's error may
#: repeat the whole message).
LETTER_ERROR_CHARS = 1000


#: What a processor's dead letter carries of the original message, replaced in this
#: order by its size and digest when the letter does not fit (:func:`bounded_letter`).
_LETTER_PARTS = (("message", "body"), ("message", "headers"))
#: The field of a bounded letter's ``message`` that keeps the nonce of the original's
#: ``dedupstore-token`` header when its headers are replaced by their size and digest.
TOKEN_FIELD = "token"


def omitted(value: Any) -> dict[str, Any]:
    """What a bounded dead letter carries instead of ``value``: ``{"bytes": n, "sha256":
    hex}`` of its canonical JSON text (UTF-8), from which a copy of the original can be
    recognised."""
    data = canonical.dumps(value).encode("utf-8", "surrogatepass")
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def bounded_letter(
    body: dict[str, Any], parts: Sequence[tuple[str, str]], bound: int | None, whole: bool = True
) -> tuple[dict[str, Any], str]:
    """A dead letter's body within ``bound`` bytes, and its canonical JSON text: the rule
    every dead letter follows (the processor's and the consume loop's).

    ``body`` is JSON-compatible; ``parts`` name the ``(section, key)`` of what it
    carries of the original (its body, then its headers). While the letter's text is
    over ``bound`` (and always without ``whole``), each part in turn is replaced by
    ``<key>_omitted``: :func:`omitted` of it (its size and SHA-256 digest); headers
    that carried a ``dedupstore-token`` leave its nonce in the field ``token`` (what
    names the letter's redrive token). The result may still be over ``bound`` (its
    ids alone are): the caller checks.
    """
    value, text = canonical.normalized(body)
    for section, key in parts:
        if whole and (bound is None or _utf8_over(bound, text) is None):
            break
        holder = value.get(section)
        if not isinstance(holder, dict) or key not in holder:
            continue
        part = holder.pop(key)
        holder[f"{key}_omitted"] = omitted(part)
        if key == "headers" and isinstance(part, dict) and TOKEN_HEADER in part:
            # a nonce (64 characters at most) names the letter's redrive token
            holder[TOKEN_FIELD] = part[TOKEN_HEADER]
        value, text = canonical.normalized(value)
    return value, text


class _SetAside(Exception):
    """The processor's refusal of one message (its entity cannot hold it, or a message it
    sends is over the dispatcher's bound, on every retry): not the handler's failure,
    so it is not run again. With ``dead_letters`` the message is set aside at once with
    ``error`` (the letter's ``{"type", "text"}``), its letter carrying the original
    only if ``whole``; without, ``raised`` is raised."""

    def __init__(self, error: dict[str, str], raised: DedupStoreError, whole: bool = True):
        super().__init__(error["text"])
        self.error = error
        self.raised = raised
        self.whole = whole


def refusing(handler: Handler, refusals: Mapping[tuple[str, str], Exception]) -> Handler:
    """``handler``, but for the messages ``(correlation id, id)`` of ``refusals``: it
    raises their refusal (a ``_SetAside``, or the consume loop's ``MaxDeliveriesExceeded``)."""

    def run(state: dict[str, Any], message: Message) -> Any:
        refusal = refusals.get((message.correlation_id, message.id))
        if refusal is not None:
            raise refusal
        return handler(state, message)

    return run


def _too_large_to_send(message: Message, refused: MessageTooLarge) -> _SetAside:
    """The refusal of a message one of whose outgoing messages the dispatcher refuses."""
    error = MessageTooLarge(
        f"message {message.id!r:.80} of entity {message.correlation_id!r:.80}: {refused}; "
        "nothing of it was saved. Make the outgoing message smaller.",
        outgoing_id=refused.outgoing_id,
        size=refused.size,
        bound=refused.bound,
        message_id=message.id,
        correlation_id=message.correlation_id,
    )
    return _SetAside({"type": _type_name(error), "text": str(error)}, error)


def _type_name(exc: BaseException) -> str:
    kind = type(exc)
    return (
        kind.__qualname__
        if kind.__module__ == "builtins"
        else f"{kind.__module__}.{kind.__qualname__}"
    )


def _as_json(value: Any) -> Any:
    """``value`` as JSON (what is not JSON-compatible as its ``repr`` text)."""
    try:
        return json.loads(json.dumps(value, default=repr, allow_nan=False))
    except (TypeError, ValueError):
        return {"repr": repr(value)}


def _letter_error(letter: OutgoingMessage) -> str:
    """A dead letter's error as results show it: ``"<class name>: <text>"``."""
    error = letter.body["error"]
    return f"{str(error['type']).rsplit('.', 1)[-1]}: {error['text']}"


class _Redriving(_Base):
    """:class:`~dedupstore.outbox.OutboxProcessor`'s redrive of a dead letter."""

    def _redrive(self, letter: object, handler: Handler) -> Steps[ProcessResult]:
        """The steps of :meth:`OutboxProcessor.redrive`."""
        body = letter_body(letter)
        kind = letter_kind(body)
        error = body.get("error")
        reason = error.get("text") if isinstance(error, Mapping) else None
        if kind == "delivery":
            raise ConfigurationError(
                "this dead letter is a delivery the consume loop set aside because it is "
                f"not a message ({reason or 'malformed'}); it never was processed, so there "
                "is nothing to redrive: publish a fixed message, then purge the letter"
            )
        if kind == "row":
            raise ConfigurationError(
                "this dead letter stands for a row whose id or correlation id was null or "
                f"invalid ({reason}); it never was a message, so there is nothing to "
                "redrive: fix the row and process it again, then purge the letter"
            )
        original = body.get("message")
        consumer = body.get("consumer")
        mid = original.get("id") if isinstance(original, Mapping) else None
        cid = original.get("correlation_id") if isinstance(original, Mapping) else None
        if not (
            kind in ("message", "bounded")
            and isinstance(original, Mapping)
            and isinstance(consumer, str)
            and isinstance(mid, str)
            and isinstance(cid, str)
        ):
            raise ConfigurationError(
                f"not a dead letter: {_shown(body)} (its consumer, message id or entity is missing)"
            )
        if consumer != self.consumer:
            raise ConfigurationError(
                f"the dead letter of message {mid!r:.80} of entity {cid!r:.80} belongs to "
                f"consumer {consumer!r:.80}, not {self.consumer!r:.80}: redrive it with that "
                "consumer's store (its endpoint)"
            )
        letter_id = outgoing_id(consumer, cid, mid, -1)
        missing = [key for _, key in _LETTER_PARTS if f"{key}_omitted" in original]
        if missing:
            raise DeadLetterIncomplete(
                f"dead letter {letter_id} of message {mid!r:.80} of entity {cid!r:.80} "
                "cannot be redriven: it was too large to be written whole, so it holds only "
                f"the size and SHA-256 digest of the original's {' and '.join(missing)}; "
                "process the original message again from its source, as a new message",
                letter_id=letter_id,
                message_id=mid,
                correlation_id=cid,
            )
        given = original.get("headers")
        headers = {str(k): str(v) for k, v in given.items()} if isinstance(given, Mapping) else {}
        if TOKEN_HEADER in headers and self.tokens is None:
            raise ConfigurationError(
                f"dead letter {letter_id} of message {mid!r:.80} of entity {cid!r:.80} keeps "
                "a redrive token (the message came in token mode): redrive it with the token "
                "store (tokens=, --tokens), or its token is left forever and the redrive "
                "recorded in the deduplication store instead"
            )
        if TOKEN_HEADER in headers:
            yield from self._exchange_now(cid, mid)
        first = headers.setdefault(_REDRIVE_OF, mid)  # a letter of a redrive: the first id
        seen = Message(first, cid, original.get("body"), headers)

        def as_original(state: dict[str, Any], _: Message) -> tuple[dict[str, Any], Sequence[Send]]:
            return handler(state, seen)  # (what an async handler returns, awaited by the face)

        return (
            yield from self._process_one(Message(letter_id, cid, seen.body, headers), as_original)
        )

    def _exchange_now(self, cid: str, mid: str) -> Steps[None]:
        """Before the redrive of a letter of message ``mid`` in token mode: if the entry of
        ``mid`` is still in the outbox of ``cid`` (deferred clean-up: the sweep has not moved
        it yet; inline: a consumer died between dispatching the letter and its clean-up),
        clean it up now, so that its token is exchanged for the redrive's before the
        redrive looks for it (else the redrive would be told a duplicate). Raises
        ``ConcurrencyConflict`` when the entity changes meanwhile (redrive again)."""
        entity = self._claim_all({cid: (yield from call(self.entities, "load", cid))})[cid]
        entry = entity.tokens.get(mid)
        if mid not in entity.outbox or entry is None or entry.letter is None:
            return
        self._kept.take(cid)
        if (yield from self._move_and_save([entity], [], [(entity, mid)])):
            raise ConcurrencyConflict(
                f"entity {cid!r:.80} changed while the entry of dead-lettered message "
                f"{mid!r:.80} was cleaned up before its redrive; redrive it again"
            )
        self._kept.keep(entity)
