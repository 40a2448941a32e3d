"""The handler: its check (:func:`check_handler`), its runs on a state (retries, its
contract, a dead letter instead of its failure), and the checks of what the processor
is given.
"""

from __future__ import annotations

import inspect
from typing import Any

from dedupstore import canonical
from dedupstore.entities import OutgoingMessage
from dedupstore.errors import (
    ConfigurationError,
    EntityTooLarge,
    HandlerError,
    InvalidValue,
    MessageTooLarge,
    StoreUnavailable,
)
from dedupstore.ids import outgoing_id, validate_message_id
from dedupstore.outbox._base import _Base
from dedupstore.outbox.letters import (
    _LETTER_PARTS,
    LETTER_ERROR_CHARS,
    _as_json,
    _letter_error,
    _SetAside,
    _too_large_to_send,
    _type_name,
    bounded_letter,
)
from dedupstore.outbox.messages import Handler, Message, Send, _shown, check_size
from dedupstore.steps import Steps, user


def is_async_callable(handler: object) -> bool:
    """Whether ``handler`` is an ``async def`` function (or an object whose
    ``__call__`` is one)."""
    call = getattr(handler, "__call__", None)  # noqa: B004 (the method itself is inspected)
    return inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(call)


def check_handler(handler: object, *, awaitable: bool = False) -> None:
    """Raise ``ConfigurationError`` if ``handler`` is not callable or, unless
    ``awaitable`` (the async API), is asynchronous (an ``async def`` function, or an
    object whose ``__call__`` is one): the sync API cannot await what it returns."""
    if not callable(handler):
        raise ConfigurationError(f"handler must be callable, got {_shown(handler)}")
    if awaitable:
        return
    if is_async_callable(handler):
        raise ConfigurationError(
            f"the handler {getattr(handler, '__qualname__', type(handler).__name__)!r:.80} is "
            "an async function: the sync OutboxProcessor cannot await it; use "
            "dedupstore.aio.AsyncOutboxProcessor, or make it a plain function (a handler "
            "is pure: no I/O to await)"
        )


#: What the processor calls on its stores: an object that is not the store class but
#: has these (a wrapper) is taken as one.
_ENTITY_CALLS = ("load", "load_many", "save", "save_many")


_DEDUP_CALLS = ("add_many", "processed_among", "has_been_processed")


def _check_part(name: str, value: object, kind: type, calls: tuple[str, ...], example: str) -> None:
    """``value``, given as the processor's ``name``, is a ``kind`` or has its ``calls``,
    else ``ConfigurationError`` naming the argument and what it got."""
    if isinstance(value, kind):
        return
    missing = [call for call in calls if not callable(getattr(value, call, None))]
    if missing:
        raise ConfigurationError(
            f"{name} must be {'an' if kind.__name__[0] in 'AEIOU' else 'a'} {kind.__name__} "
            f"({example}), got {_shown(value)} (it has no {missing[0]}())"
        )


class _HandlerContract(TypeError):
    """A handler returned something else than ``(dict, sends)``."""

    def __str__(self) -> str:
        return (
            "a handler must return (new_state: dict, sends: a sequence of Send), "
            f"with JSON-compatible state and bodies; {self.args[0]}"
        )


def _not_json(exc: Exception) -> ValueError:
    """What :meth:`OutboxProcessor._outputs` raises for a state or body that
    :func:`canonical.normalized` (or ``_normalized_text``) refused with ``exc``."""
    return ValueError(
        f"the new state and every outgoing message body must be JSON-compatible: {exc}"
    )


def _handler_error(message: Message, exc: Exception) -> HandlerError:
    return HandlerError(
        f"the handler failed on message {message.id!r:.80} of entity "
        f"{message.correlation_id!r:.80}: {type(exc).__name__}: {exc} (nothing of it was "
        "saved; fix the handler, or give the processor dead_letters to set such messages "
        "aside)",
        message_id=message.id,
        correlation_id=message.correlation_id,
        error=exc,
    )


_encoded = OutgoingMessage._encoded


class _Handling(_Base):
    """:class:`~dedupstore.outbox.OutboxProcessor`'s calls of the handler (steps 2b-2c)."""

    #: whether the face drives the steps on an event loop (async handlers accepted)
    _awaits = False

    def _check_handler(self, handler: Handler) -> None:
        """Refuse (``ConfigurationError``) what cannot be a handler, before any I/O; the
        last handler that passed is remembered, so a loop checks its handler once."""
        check_handler(handler, awaitable=self._awaits)
        self._checked_handler = handler

    def _run(
        self, state: dict[str, Any], message: Message, handler: Handler, source: str | None = None
    ) -> Steps[tuple[dict[str, Any], str | None, list[OutgoingMessage], str | None]]:
        """Run the handler on ``state``: new state and its canonical text, outgoing
        messages, error. It gets a copy of ``state``, or, with ``source`` (a JSON text
        of it), ``state`` itself, decoded again from ``source`` should the handler fail.

        A handler that raises (but ``StoreUnavailable``: never the message's fault) or
        breaks its contract is run up to ``handler_attempts`` times; then, with
        ``dead_letters``, the state stays as it was (no text) and the one outgoing
        message is the dead letter; without, ``HandlerError``. The processor's own
        refusal (``_SetAside``) is not run again: dead-lettered at once, or, without
        ``dead_letters``, its ``MessageTooLarge`` / ``EntityTooLarge`` raised.
        """
        attempt = 1
        while True:
            try:
                given = canonical.copy(state) if source is None else state
                return (*(yield from self._outputs(given, message, handler)), None)
            except StoreUnavailable:
                raise
            except _SetAside as refusal:
                if source is not None:
                    state = canonical.loads(source)  # as it was before the handler ran
                if self.dead_letters is None:
                    raise refusal.raised from None
                letter = self._dead_letter(message, refusal.error, attempt, refusal.whole)
                return state, None, [letter], _letter_error(letter)
            except Exception as exc:
                if source is not None:
                    state = canonical.loads(source)  # as it was before the handler ran
                if attempt < self.handler_attempts:
                    attempt += 1
                    continue
                if self.dead_letters is None:
                    raise _handler_error(message, exc) from exc
                error = {"type": _type_name(exc), "text": str(exc)}
                letter = self._dead_letter(message, error, attempt)
                return state, None, [letter], _letter_error(letter)

    def _outputs(
        self, state: dict[str, Any], message: Message, handler: Handler
    ) -> Steps[tuple[dict[str, Any], str, list[OutgoingMessage]]]:
        """The handler's new state (normalized: what a reload will show) and its text,
        and the outgoing messages (with their ids, bodies encoded once and decoded only
        when read: see :meth:`OutgoingMessage.__getattr__`)."""
        returned = yield from user(handler, state, message)
        if not (isinstance(returned, tuple) and len(returned) == 2):
            raise _HandlerContract(f"it returned {_shown(returned)}")
        state, sends = returned
        if not isinstance(state, dict):
            raise _HandlerContract(f"its new state is {_shown(state)}, not a dict")
        if type(sends) is not list:
            sends = list(sends)
        for send in sends:
            if not isinstance(send, Send):
                raise _HandlerContract(f"it asked to send {_shown(send)}, not a Send")
        # (canonical.normalized: the state as a reload will show it, and its text)
        normalized, normalized_text = canonical.normalized, canonical._normalized_text
        try:
            state, state_text = normalized(state, "state")
        except InvalidValue:
            raise
        except (TypeError, ValueError) as exc:
            raise _not_json(exc) from None
        if not sends:
            return state, state_text, []
        consumer, cid, mid = self.consumer, message.correlation_id, message.id
        destinations = self._destinations
        outgoing = []
        for position, send in enumerate(sends):
            try:
                body, text = normalized_text(send.body, "body")  # body: _UNDECODED, most often
            except InvalidValue as exc:
                raise InvalidValue(f"sends[{position}].{exc}") from None
            except (TypeError, ValueError) as exc:
                raise _not_json(exc) from None
            headers = send.headers
            destination = send.destination
            known = destinations.get(destination) if type(destination) is str else None
            if known is None:
                destination = validate_message_id(str(destination), "destination")
                known = canonical.string(destination)
                if len(destinations) < 1000:
                    destinations[destination] = known
            oid = outgoing_id(consumer, cid, mid, position)  # UUID text: no JSON escapes
            outgoing.append(
                _encoded(
                    oid,
                    destination,
                    body,
                    text,
                    dict(headers) if headers else {},  # str -> str: checked by Send
                    known,
                    f'"{oid}"',
                )
            )
        if self._bounds != (None, None):
            for sent in outgoing:
                refused = check_size(self.dispatcher, sent)
                if refused is not None:
                    raise _too_large_to_send(message, refused)
        return state, state_text, outgoing

    def _dead_letter(
        self, message: Message, error: dict[str, str], attempts: int, whole: bool = True
    ) -> OutgoingMessage:
        """The one dead letter of ``message`` (:func:`outgoing_id` position -1), bounded
        (:func:`bounded_letter`) to :meth:`letter_bytes` (always, without ``whole``); the
        error text cut to :data:`LETTER_ERROR_CHARS` characters. ``MessageTooLarge``
        when even the bounded letter is over the dispatcher's bound."""
        consumer, cid, mid = self.consumer, message.correlation_id, message.id
        assert self.dead_letters is not None
        text = error["text"]
        if len(text) > LETTER_ERROR_CHARS:
            text = f"{text[:LETTER_ERROR_CHARS]}... ({len(text)} characters)"
        body, body_text = bounded_letter(
            {
                "message": {
                    "id": mid,
                    "correlation_id": cid,
                    "body": _as_json(message.body),
                    "headers": {str(k): str(v) for k, v in dict(message.headers).items()},
                },
                "error": {"type": error["type"], "text": text},
                "attempts": attempts,
                "consumer": consumer,
            },
            _LETTER_PARTS,
            self.letter_bytes(),
            whole,
        )
        letter_id = outgoing_id(consumer, cid, mid, -1)
        letter = _encoded(letter_id, self.dead_letters, body, body_text, {})
        refused = check_size(self.dispatcher, letter)
        if refused is not None:
            raise MessageTooLarge(
                f"message {mid!r:.80} of entity {cid!r:.80} cannot be set aside: its dead "
                f"letter, bounded, is still refused ({refused}); nothing of it was saved",
                outgoing_id=letter.id,
                size=refused.size,
                bound=refused.bound,
                message_id=mid,
                correlation_id=cid,
            )
        return letter

    def letter_bytes(self) -> int:
        """The largest dead letter (bytes of its body's canonical JSON) written whole: half
        the entity store's ``max_entity_bytes`` (a dead letter is recorded in its entity's
        outbox, beside the state), and no more than the dispatcher's
        ``max_message_bytes`` allows. A larger letter carries the message's body, then
        its headers, as their size and digest (:func:`bounded_letter`); so does one
        whose entity cannot hold it whole beside its state."""
        half = self.entities.max_entity_bytes // 2
        total = self._bounds[0]
        return half if total is None else min(half, total - 2)  # (2: the empty headers)

    def _refusals(
        self, message: Message, entry: list[OutgoingMessage] | None, too_large: EntityTooLarge
    ) -> list[_SetAside]:
        """How to set ``message`` aside when ``entry`` (its outbox entry) does not fit in
        its entity even alone, in order: its dead letter whole, then bounded (only
        bounded when ``entry`` is its whole letter already; none when it is its bounded
        letter). Raises ``too_large`` without ``dead_letters``."""
        if self.dead_letters is None:
            raise too_large
        letter_id = outgoing_id(self.consumer, message.correlation_id, message.id, -1)
        if entry and len(entry) == 1 and entry[0].id == letter_id:
            body = entry[0].body
            if all(f"{key}_omitted" in body["message"] for _, key in _LETTER_PARTS):
                return []
            return [_SetAside(dict(body["error"]), too_large, whole=False)]
        error = {"type": _type_name(too_large), "text": str(too_large)}
        return [_SetAside(error, too_large), _SetAside(error, too_large, whole=False)]
