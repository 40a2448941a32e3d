"""The improving-outbox algorithm: :class:`OutboxProcessor` and :func:`sweep`.

For an incoming message ``m`` (id ``mid``) of entity ``cid``:

1. load the entity (or take the one this processor saved last: its version is that
   save's token, so it stands for a load made then);
2. if ``mid`` is not in its outbox: if the deduplication store has ``mid``, it is a
   duplicate (this check comes AFTER the load, so a concurrent copy that cleans the
   outbox in between makes this copy's save fail on the token instead of applying
   the change twice; for a kept entity of stores on one server it is made by the
   save itself, which then writes nothing); else run the handler on the state, put
   the outgoing messages (ids derived from ``mid`` and their position) in
   ``outbox[mid]`` and save;
3. else take ``outbox[mid]``;
4. dispatch the outgoing messages if they are not ``None``;
5. clean up: ``inline`` adds ``mid`` to the deduplication store, then removes it from
   the outbox and saves; ``deferred`` sets ``outbox[mid] = None`` and saves, and
   :func:`sweep` later moves the ids. An id is always in the outbox or the store.

A ``ConcurrencyConflict`` restarts the message from step 1 (bounded). Every step can
be retried after a crash; the broker redelivers.

The caller guarantees: a handler is a pure function of ``(state, message)`` (no I/O,
no clock, no randomness: a re-run must produce the same outputs); message ids are
stable across redeliveries; receivers deduplicate outgoing messages by id.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol, runtime_checkable

from dedupstore import canonical, metrics
from dedupstore.calls import gc_relaxed
from dedupstore.dead_letters import letter_body, letter_kind
from dedupstore.entities import (
    ENTITY_FRAME_BYTES,
    Entity,
    EntityStore,
    EntryMark,
    OutgoingMessage,
    body_text,
    entry_size,
    head_size,
    json_size,
)
from dedupstore.errors import (
    ConcurrencyConflict,
    ConfigurationError,
    DeadLetterIncomplete,
    DedupStoreError,
    EntityTooLarge,
    HandlerError,
    InvalidValue,
    MessageTooLarge,
    StoreUnavailable,
    format_error,
)
from dedupstore.ids import (
    MAX_ID_BYTES,
    message_key,
    outgoing_id,
    plain_ids,
    validate_message_id,
    validate_name,
)
from dedupstore.store import DeduplicationStore

__all__ = [
    "LETTER_ERROR_CHARS",
    "Dispatcher",
    "Handler",
    "InMemoryDispatcher",
    "Message",
    "OutboxProcessor",
    "ProcessResult",
    "Send",
    "SweepResult",
    "applied_among",
    "bounded_letter",
    "check_handler",
    "check_size",
    "message_key",
    "message_size",
    "omitted",
    "outgoing_id",
    "recorded_consumer",
    "sweep",
]

_log = logging.getLogger(__name__)

#: The header a redriven message carries: the id of the message first dead-lettered.
_REDRIVE_OF = "dedupstore-redrive-of"

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


#: A dead letter's error text is cut to this many characters (a handler's error may
#: repeat the whole message).
LETTER_ERROR_CHARS = 1000


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
    ``<key>_omitted``: :func:`omitted` of it (its size and SHA-256 digest). The result
    may still be over ``bound`` (its ids alone are): the caller checks.
    """
    value, text = canonical.normalized(body)
    for section, key in parts:
        if whole and (bound is None or _utf8_over(bound, text) is None):
            break
        holder = value.get(section)
        if not isinstance(holder, dict) or key not in holder:
            continue
        holder[f"{key}_omitted"] = omitted(holder.pop(key))
        value, text = canonical.normalized(value)
    return value, text


def _bounds(dispatcher: object) -> tuple[int | None, int | None]:
    return (
        getattr(dispatcher, "max_message_bytes", None),
        getattr(dispatcher, "max_header_bytes", None),
    )


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


def _refusing(handler: Handler, refusals: Mapping[tuple[str, str], _SetAside]) -> Handler:
    """``handler``, but for the messages ``(correlation id, id)`` of ``refusals``: it
    raises their refusal."""

    def refusing(state: dict[str, Any], message: Message) -> Any:
        refusal = refusals.get((message.correlation_id, message.id))
        if refusal is not None:
            raise refusal
        return handler(state, message)

    return refusing


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


_encoded = OutgoingMessage._encoded


def _not_json(exc: Exception) -> ValueError:
    """What :meth:`OutboxProcessor._outputs` raises for a state or body that
    :func:`canonical.normalized` (or ``_normalized_text``) refused with ``exc``."""
    return ValueError(
        f"the new state and every outgoing message body must be JSON-compatible: {exc}"
    )


class OutboxProcessor:
    """Processes messages exactly once: entity state, outbox, dispatch, then the id.

    A message is identified by (consumer, entity, message id): the consumer is the
    deduplication store's endpoint, the entity the message's correlation id. The same
    message id under two entities is two messages; the deduplication store records
    :func:`~dedupstore.ids.message_key` ``(correlation id, message id)``.

    ``cleanup="inline"`` moves each id to the deduplication store as part of
    processing (two more round trips); ``"deferred"`` only marks the outbox entry
    dispatched and leaves the move to :func:`sweep`, except that an entity holding
    more than ``deferred_limit`` dispatched ids (or more than an eighth of the entity
    store's ``max_entity_bytes`` of them) has them moved inline, so a hot entity's
    record never grows with the number of messages it received. ``max_attempts``
    bounds the retries after ``ConcurrencyConflict``. Thread-safe if the stores are.

    The processor keeps up to ``entity_cache`` entities it saved (0: none), as of
    that save, and takes one instead of loading it for the entity's next message;
    the save's token refuses it if anyone saved the entity since (one conflict, then
    a load), so keeping never changes an answer, only the requests a message costs.

    By default the processor changes no setting of the process. ``gc_threshold``
    (an int, e.g. :data:`~dedupstore.calls.GC_BATCH_THRESHOLD`) opts in to raising
    CPython's cyclic garbage collector's young-generation threshold to it while
    :meth:`process_batch` runs (:func:`~dedupstore.calls.gc_relaxed`), for the whole
    process, every thread included, put back when the last batch running at once
    ends: a batch's objects would otherwise set off full collections, each walking
    every object of the process, which in a process holding much data cost more
    than the batch itself.

    Every outbox entry it writes is marked with the time it was written (what
    :func:`~dedupstore.stats.outbox_backlog` reports as the oldest pending entry) and
    with ``run``, a name for one run of a job over its input: with a ``run``, a
    message this run applied (or dead-lettered) in an earlier call whose clean-up did
    not finish (a crash, a retried task) comes out ``processed`` (or
    ``dead_lettered``) again, not ``redispatched``: outcomes say what the run did,
    whichever call of it got through.
    """

    def __init__(
        self,
        entities: EntityStore,
        dedup: DeduplicationStore,
        dispatcher: Dispatcher,
        *,
        cleanup: Literal["inline", "deferred"] = "inline",
        max_attempts: int = 10,
        deferred_limit: int = 1000,
        dead_letters: str | None = None,
        handler_attempts: int = 1,
        run: str | None = None,
        entity_cache: int = 10_000,
        gc_threshold: int | None = None,
    ) -> None:
        """Raises ``ConfigurationError`` (no I/O) for an ``entities`` that is not an
        ``EntityStore``, a ``dedup`` that is not a ``DeduplicationStore``, a
        ``dispatcher`` without a callable ``dispatch``, an unknown ``cleanup``, a bad
        ``dead_letters`` destination or ``run`` name, ``max_attempts``,
        ``deferred_limit`` or ``handler_attempts`` below 1, ``entity_cache``
        below 0, or a ``gc_threshold`` that is neither None nor an int >= 1."""
        if cleanup not in ("inline", "deferred"):
            raise ConfigurationError(f"cleanup must be 'inline' or 'deferred', got {cleanup!r}")
        for name, value in (
            ("max_attempts", max_attempts),
            ("deferred_limit", deferred_limit),
            ("handler_attempts", handler_attempts),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigurationError(f"{name} must be an int >= 1, got {value!r}")
        if isinstance(entity_cache, bool) or not isinstance(entity_cache, int) or entity_cache < 0:
            raise ConfigurationError(f"entity_cache must be an int >= 0, got {entity_cache!r}")
        if gc_threshold is not None and (
            isinstance(gc_threshold, bool) or not isinstance(gc_threshold, int) or gc_threshold < 1
        ):
            raise ConfigurationError(
                f"gc_threshold must be None or an int >= 1, got {gc_threshold!r}"
            )
        if dead_letters is not None:
            validate_name(dead_letters, "dead-letter destination")
        if run is not None:
            validate_name(run, "run")
        _check_part("entities", entities, EntityStore, _ENTITY_CALLS, "open_entity_store(url)")
        _check_part("dedup", dedup, DeduplicationStore, _DEDUP_CALLS, "open_store(url)")
        if not callable(getattr(dispatcher, "dispatch", None)):
            raise ConfigurationError(
                "dispatcher must have a callable dispatch(messages) (a Dispatcher, such as "
                f"open_dispatcher(url)), got {_shown(dispatcher)}"
            )
        self.run = run
        self.dead_letters = dead_letters
        self.handler_attempts = handler_attempts
        self.entities = entities
        self.dedup = dedup
        self.dispatcher = dispatcher
        self.cleanup = cleanup
        self.max_attempts = max_attempts
        self.deferred_limit = deferred_limit
        self.gc_threshold = gc_threshold
        self._checked_handler: Handler | None = None  # the handler that passed the check
        #: the dispatcher's bounds (max_message_bytes, max_header_bytes): see check_size
        self._bounds = _bounds(dispatcher)
        #: valid destinations the handler named, as JSON strings (checked once each)
        self._destinations: dict[str, str] = {}
        #: the entities process() saved last, at the version of that save
        self._kept = _EntityCache(entity_cache)
        # The two stores share a server: process() loads the entity and checks the id
        # in one round trip, and the inline clean-up is one atomic write. (getattr: an
        # entity store that wraps another need not implement the joined calls.)
        joined = getattr(entities, "_joined", None)
        self._joined: bool = joined is not None and bool(joined(dedup))

    @property
    def consumer(self) -> str:
        """The consumer's name: the deduplication store's endpoint."""
        return self.dedup.endpoint

    def _check_handler(self, handler: Handler) -> None:
        """Refuse (``ConfigurationError``) what cannot be a handler, before any I/O; the
        last handler that passed is remembered, so a loop checks its handler once."""
        check_handler(handler)
        self._checked_handler = handler

    def _claim(self, entity: Entity) -> Entity:
        """``entity`` (loaded), recorded as this consumer's: every entity the processor
        saves was claimed when it was loaded. ``ConfigurationError`` for an entity
        another consumer recorded (before any write)."""
        consumer = self.dedup.endpoint
        if entity.consumer != consumer:
            if entity.consumer is not None:
                raise _foreign(entity, consumer)
            entity.consumer = consumer
        return entity

    def _claim_all(self, entities: dict[str, Entity]) -> dict[str, Entity]:
        """:meth:`_claim` of every entity of ``entities`` (loaded); returns them."""
        for entity in entities.values():
            self._claim(entity)
        return entities

    # ------------------------------------------------------------------ one message

    def process(self, message: Message, handler: Handler) -> ProcessResult:
        """Run the algorithm for one message; return what it did.

        Raises ``InvalidMessageId`` (before any I/O), ``ConcurrencyConflict`` after
        ``max_attempts`` conflicts, ``StoreUnavailable``, and whatever the handler or
        the dispatcher raises (then the message must be redelivered). A message that
        cannot be processed on any retry, because its own new state and outbox entry
        do not fit in one entity record (``EntityTooLarge``) or an outgoing message is
        over the dispatcher's ``max_message_bytes``/``max_header_bytes``
        (``MessageTooLarge``, checked before anything is saved or sent), is set aside
        with ``dead_letters`` (``dead_lettered``, its letter bounded: see
        :meth:`letter_bytes`); without, that error is raised with ``message_id`` and
        ``correlation_id`` naming it, nothing of it saved. They are raised with
        ``dead_letters`` too when even the bounded letter cannot be written.
        """
        _validate(message)
        if handler is not self._checked_handler:
            self._check_handler(handler)
        result = self._process(message, handler, set())
        self._report([message], [result])
        return result

    def redrive(self, letter: object, handler: Handler) -> ProcessResult:
        """Process a dead-lettered message again, after a fix; once per dead letter.

        ``letter`` is the dead letter in any form it is read back (see
        :func:`~dedupstore.dead_letters.letter_body`): the ``OutgoingMessage`` as
        dispatched or its body, a Redis stream entry, a row of the SQLite table queue,
        an AMQP body, the JSON ``dedupstore dead-letters show`` prints. The original
        message runs as a message of the same entity whose id (what the processor
        records) is the dead letter's id (deterministic) and whose headers add
        ``dedupstore-redrive-of`` (the original id); the handler sees the original
        message: its id, body and headers (with that header). The original id stays
        recorded, so a replay of it is still a duplicate, and redriving one letter
        twice applies it once. Should the handler fail again, the message is
        dead-lettered again (a letter of this one, whose redrive the handler also
        sees under the original id). Raises ``ConfigurationError`` before any I/O for
        a letter that is not a dead letter, the letter of a malformed delivery (never
        a message: nothing to redrive) or a letter of another consumer (naming
        both), ``DeadLetterIncomplete`` for a bounded letter (the original's body or
        headers replaced by their size and digest), and what :meth:`process` raises.
        """
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
        first = headers.setdefault(_REDRIVE_OF, mid)  # a letter of a redrive: the first id
        seen = Message(first, cid, original.get("body"), headers)

        def as_original(state: dict[str, Any], _: Message) -> tuple[dict[str, Any], Sequence[Send]]:
            return handler(state, seen)

        return self.process(Message(letter_id, cid, seen.body, headers), as_original)

    def begin_attempt(self, message: Message) -> int:
        """Record in ``message``'s entity that its handler is about to run once more;
        return how many such runs began, this one included (0: the message needs no
        run: it was applied, dead-lettered or recorded already).

        What a consume loop calls before it runs, alone, a message that a consumer
        died holding (a broker delivery count above 1): the count survives the
        process, so a message that kills every consumer running it can be set aside
        after ``max_deliveries`` runs (see :class:`~dedupstore.consumers.Consumer`),
        while an outage or a crash with the message merely in flight counts nothing.
        The entity's ``attempts`` entry goes when the message is applied. Raises
        ``InvalidMessageId`` (before any I/O), ``StoreUnavailable``, and
        ``ConcurrencyConflict`` after ``max_attempts`` conflicts.
        """
        _validate(message)
        mid, cid = message.id, message.correlation_id
        key = message_key(cid, mid)
        for _attempt in range(self.max_attempts):
            self._kept.take(cid)  # a fresh load: the count must be the stored one
            entity = self._claim(self.entities.load(cid))
            if mid in entity.outbox or self.dedup.has_been_processed(key):
                return 0
            runs = entity.attempts.get(mid, 0) + 1
            entity.attempts[mid] = runs
            try:
                self.entities.save(entity)
            except ConcurrencyConflict:
                continue
            except EntityTooLarge:  # a full record cannot count: the run is not recorded
                return runs
            self._kept.keep(entity)
            return runs
        raise ConcurrencyConflict(
            f"message {mid!r:.80} of entity {cid!r:.80}: the entity kept changing while "
            f"its attempt was recorded, for {self.max_attempts} attempts; redeliver it"
        )

    def _process(
        self, message: Message, handler: Handler, dispatched: set[str], clean: bool = True
    ) -> ProcessResult:
        """:meth:`process`, not sending again the outgoing ids in ``dispatched``
        (which gets those it sends); without ``clean``, steps 1-4 only."""
        mid, cid = message.id, message.correlation_id
        key = message_key(cid, mid)
        applied = False
        outcome: Outcome | None = None
        error: str | None = None
        outgoing: list[OutgoingMessage] | None
        run_handler = handler  # or one that refuses the message (its entity cannot hold it)
        attempt, budget = 0, self.max_attempts
        while attempt < budget:
            attempt += 1
            try:
                # A kept entity stands for a load: the save's token refuses it if anyone
                # saved the entity since (then the next attempt loads it).
                entity: Entity | None = self._kept.take(cid)
                taken = entity is not None
                recorded: bool | None = None
                if entity is None:
                    if self._joined:
                        entity, recorded = self.entities._load_checked(cid, self.dedup, key)
                    else:
                        entity = self.entities.load(cid)
                    self._claim(entity)
                found = mid in entity.outbox
                if not found:
                    # (a kept entity of joined stores: the save itself checks the id)
                    checked = self._joined and recorded is None
                    if not checked and recorded is None:
                        recorded = self.dedup.has_been_processed(key)
                    if not recorded:
                        outgoing, failed = self._apply(entity, message, run_handler)
                        try:
                            saved = self._save_applied(entity, message, key if checked else None)
                        except _SetAside as refusal:
                            # set it aside instead, from a fresh load (not a conflict:
                            # at most twice, the letter whole then bounded)
                            run_handler = _refusing(handler, {(cid, mid): refusal})
                            budget += 1
                            continue
                        if saved is False:
                            continue  # dispatched ids made room: start again from the load
                        recorded = saved is None  # the save found it recorded: no write
                    if recorded and taken:
                        # A recorded message saves nothing, so nothing checks the kept
                        # entity, and the stored outbox may still hold the message's
                        # entry (a consumer recorded the id, then died before the save
                        # removing it): load it, and clean the entry up if it is there.
                        entity = self._claim(self.entities.load(cid))
                        found = mid in entity.outbox
                    if recorded and not found:  # the entity is as loaded: kept
                        self._kept.keep(entity)
                        done: Outcome = outcome if applied and outcome else "duplicate"
                        return ProcessResult(mid, done, (), attempt, error)
                if not found:  # applied above
                    applied, error = True, failed
                    outcome = "processed" if error is None else "dead_lettered"
                else:
                    outgoing = entity.outbox[mid]
                    if outcome is None:
                        outcome, error = self._found(entity, mid)
                if outgoing is not None and not {m.id for m in outgoing} <= dispatched:
                    _send(self.dispatcher, outgoing, self.consumer)
                    dispatched.update(m.id for m in outgoing)
                if clean:
                    self._clean_up(entity, mid)
                    self._kept.keep(entity)
                return ProcessResult(mid, outcome, tuple(outgoing or ()), attempt, error)
            except ConcurrencyConflict:
                if attempt < self.max_attempts:
                    _retrying(self.consumer, [cid])
                continue
        raise ConcurrencyConflict(
            f"message {mid!r:.80} of entity {cid!r:.80}: the entity kept "
            f"changing under it for {self.max_attempts} attempts; redeliver it"
        )

    def _found(self, entity: Entity, mid: str) -> tuple[Outcome, str | None]:
        """The outcome (and error) of a message found in the entity's outbox.

        ``duplicate`` once dispatched, ``redispatched`` while pending; but a pending
        entry this processor's ``run`` wrote says what the run did then.
        """
        entry = entity.outbox[mid]
        if entry is None:
            return "duplicate", None
        mark = entity.marks.get(mid)
        if self.run is None or mark is None or mark.run != self.run:
            return "redispatched", None
        letter = outgoing_id(self.consumer, entity.id, mid, -1)
        if len(entry) == 1 and entry[0].id == letter:
            return "dead_lettered", _letter_error(entry[0])
        return "processed", None

    def _save_applied(self, entity: Entity, message: Message, checked: str | None) -> bool | None:
        """Save the entity holding ``message``'s new entry (step 2c); with ``checked``
        (the message's key), unless the deduplication store holds it: None then.

        When it does not fit and the entity holds other entries, they are cleared
        (:meth:`_clear`, on a fresh load, under its token) and False says: start
        again. When it does not fit without them, ``EntityTooLarge`` names the message
        (without ``dead_letters``), or ``_SetAside`` says how to set it aside
        (:meth:`_refusals`).
        """
        try:
            if checked is None:
                self.entities.save(entity)
            elif self.entities._save_checked(entity, self.dedup, checked):
                return None
            return True
        except EntityTooLarge as exc:
            if checked is not None and self.dedup.has_been_processed(checked):
                return None
            fresh = self._claim(self.entities.load(entity.id))
            if not fresh.outbox:
                too_large = _too_large(message, exc)
                if self.dead_letters is None:
                    raise too_large from None
                refusals = self._refusals(message, entity.outbox.get(message.id), too_large)
                if not refusals:
                    raise _unplaceable(message, too_large) from None
                raise refusals[0] from None
            if not self._clear([fresh], set()):
                raise ConcurrencyConflict(f"entity {entity.id!r:.80} changed") from None
            return False

    def _run(
        self, state: dict[str, Any], message: Message, handler: Handler, source: str | None = None
    ) -> tuple[dict[str, Any], str | None, list[OutgoingMessage], str | None]:
        """Run the handler on ``state``: new state and its canonical text, outgoing
        messages, error.

        The handler gets a copy of ``state``, or, with ``source`` (a JSON text that
        decodes to it), ``state`` itself: should the handler fail, the state returned
        is then decoded again from ``source`` (whatever the handler changed in it).

        A handler that raises (a store's ``StoreUnavailable`` excepted: that is never
        the message's fault) or returns something else than ``(dict, sends)`` with
        JSON-compatible contents is run up to ``handler_attempts`` times; then, with
        ``dead_letters``, the state stays as it was (no text) and the one outgoing
        message is the dead letter (the error is the fourth item); without,
        ``HandlerError``. The processor's own refusal of the message (``_SetAside``:
        an outgoing message over the dispatcher's bound, or an entity that cannot hold
        the message) is not run again: dead-lettered at once, or, without
        ``dead_letters``, its ``MessageTooLarge`` / ``EntityTooLarge`` raised.
        """
        attempt = 1
        while True:
            try:
                given = canonical.copy(state) if source is None else state
                return (*self._outputs(given, message, handler), None)
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
    ) -> tuple[dict[str, Any], str, list[OutgoingMessage]]:
        """The handler's new state (normalized: what a reload will show) and its text,
        and the outgoing messages (with their ids, bodies encoded once and decoded only
        when read: see :meth:`OutgoingMessage.__getattr__`)."""
        returned = handler(state, message)
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
        """The one dead-letter message of ``message`` (id: :func:`outgoing_id` position -1),
        bounded (:func:`bounded_letter`) to :meth:`letter_bytes`: a letter over it (and,
        without ``whole``, every letter) carries the message's body, then its headers,
        as their size and SHA-256 digest. The error text is cut to
        :data:`LETTER_ERROR_CHARS` characters.

        Raises ``MessageTooLarge`` (naming the message) when even the bounded letter is
        over the dispatcher's bound: the message cannot be set aside.
        """
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

    def _apply(
        self, entity: Entity, message: Message, handler: Handler, mark: EntryMark | None = None
    ) -> tuple[list[OutgoingMessage], str | None]:
        """Steps 2b-2c in memory: run the handler, record its outputs in the outbox,
        marked with ``mark`` (one per batch; a new one by default).

        Returns the outgoing messages and, for a dead-lettered message, the error.
        """
        state, text, outgoing, error = self._run(entity.state, message, handler, entity._source())
        if text is not None:
            entity._set_state(state, text)
        else:  # dead-lettered: the state as it was (decoded again if the handler had it)
            entity.state = state
        entity.outbox[message.id] = outgoing
        entity.marks[message.id] = self._mark() if mark is None else mark
        if entity.attempts:  # applied (or dead-lettered): its count of runs is done
            entity.attempts.pop(message.id, None)
        return outgoing, error

    def _mark(self) -> EntryMark:
        """The mark of an entry written now."""
        return EntryMark(int(time.time() * 1000), self.run)

    def _clean_up(self, entity: Entity, mid: str) -> None:
        """Step 5 for one message on a loaded entity (saves it)."""
        if self.cleanup == "inline":
            key = message_key(entity.id, mid)
            _remove(entity, mid)
            if self._joined:  # one atomic request, the id recorded first
                self.entities._save_recording(entity, self.dedup, key)
            else:
                self.dedup.add(key)
                self.entities.save(entity)
        elif entity.outbox[mid] is not None:
            _dispatched(entity, mid)
            if self._over_limit(entity):
                self._move_dispatched([entity])
            self.entities.save(entity)

    def _over_limit(self, entity: Entity) -> bool:
        """Whether a deferred entity holds too many dispatched ids to keep them."""
        done = entity.dispatched
        if len(done) > self.deferred_limit:
            return True
        budget = self.entities.max_entity_bytes // 8
        return (
            len(done) * (MAX_ID_BYTES + 8) > budget
            and sum(len(m.encode()) + 8 for m in done) > budget
        )

    def _move_dispatched(self, entities: Sequence[Entity], keys: Sequence[str] = ()) -> None:
        """Record the dispatched ids of ``entities`` in the deduplication store (with
        ``keys``, in the same ``add_many``), then remove them from the outboxes in
        memory (the caller saves): the inline clean-up of entries the deferred one left."""
        keys = [*keys, *(message_key(e.id, mid) for e in entities for mid in e.dispatched)]
        if keys:
            self.dedup.add_many(keys)
        for entity in entities:
            for mid in entity.dispatched:
                _remove(entity, mid)

    # ------------------------------------------------------------------ batches

    def process_batch(
        self,
        messages: Sequence[Message],
        handler: Handler,
        *,
        before_cleanup: BeforeCleanup | None = None,
    ) -> list[ProcessResult]:
        """Run the algorithm for many messages at once; one result per message, in order.

        Round trips per batch, not per message: ``load_many``, one
        ``processed_among``, ``save_many``, one ``dispatch``, then the clean-up
        (``add_many`` + ``save_many`` inline, ``save_many`` deferred); a batch that finds
        messages of entities it kept recorded loads those entities too (and may ask
        ``processed_among`` once more about them). Each entity's
        messages are handled in their order in ``messages``. Entities whose save
        conflicts are retried alone with :meth:`process`. When one entity's share of
        the batch does not fit in its record, the batch runs in consecutive rounds
        that each fit (``EntityTooLarge`` only for a message that does not fit alone).
        The same message (same entity and id) twice in a batch is applied once: the
        first copy says ``processed``, the others ``duplicate``. Same guarantees and
        errors as :meth:`process` for every message: with ``dead_letters`` a message
        too large to process is ``dead_lettered`` and the others go on; without, the
        batch raises ``EntityTooLarge``/``MessageTooLarge`` for the first such message
        (``message_id``, ``correlation_id``) with nothing of it saved: process the
        others without it.

        ``before_cleanup(messages, results)`` is called once the outcomes of
        ``messages`` (all of them, or one round's) are final and their outgoing
        messages dispatched, before any of their entries is cleaned up (step 5):
        with a ``run``, whatever it records of them (and makes durable) before it
        returns stays true when the call is cut short and run again. Should it
        raise, nothing is cleaned up and the error propagates (a later call cleans up).
        """
        if handler is not self._checked_handler:
            self._check_handler(handler)
        if not messages:
            return []
        if not plain_ids([m.id for m in messages] + [m.correlation_id for m in messages]):
            for message in messages:
                _validate(message)
        with gc_relaxed(self.gc_threshold):
            results = self._batch(list(messages), handler, 0, before_cleanup)
        self._report(messages, results)
        return results

    def _report(self, messages: Sequence[Message], results: Sequence[ProcessResult]) -> None:
        """Final results: counted in ``dedupstore.messages``; dead letters logged."""
        metrics.count_outcomes(self.consumer, results)
        for message, result in zip(messages, results, strict=True):
            if result.outcome == "dead_lettered":
                _log.warning(
                    "consumer %s: message %r of entity %r was dead-lettered to %s: %s",
                    self.consumer,
                    message.id,
                    message.correlation_id,
                    self.dead_letters,
                    result.error,
                )

    def _recorded(
        self, messages: list[Message], entities: dict[str, Entity], taken: Collection[str] = ()
    ) -> tuple[list[str], set[str]]:
        """Each message's key, and the keys the store holds among those not in an outbox.

        ``taken``: the ids of the kept entities among ``entities``. A recorded message
        saves nothing, so nothing checks a kept entity it belongs to, and the stored
        outbox may still hold its entry (a consumer recorded the id, then died before
        the save removing it): those entities are loaded in place in ``entities``,
        and the check is made again on them (an entry found is then cleaned up). An
        answer holds only for an entity loaded before it was asked (the id reaches
        the store before its entry leaves the outbox): where the reload shows a new
        version (someone saved it since it was kept, maybe between the question and
        the load), every id of it not recorded then and not in its new outbox is
        asked again, after the load.
        """
        keys = [message_key(m.correlation_id, m.id) for m in messages]
        fresh = [
            keys[i] for i, m in enumerate(messages) if m.id not in entities[m.correlation_id].outbox
        ]
        already = self.dedup.processed_among(fresh) if fresh else set()
        if not (already and taken):
            return keys, already
        pairs = list(zip(messages, keys, strict=True))
        stale = {m.correlation_id for m, k in pairs if k in already} & set(taken)
        if stale:
            kept = {cid: entities[cid].version for cid in stale}
            entities.update(self._claim_all(self.entities.load_many(sorted(stale))))
            # A version that moved may have moved after the question: an id asked then
            # may have been applied and cleaned up since. One that did not is the kept
            # record itself (the same outbox): the answers were about this very version.
            moved = {cid for cid in stale if entities[cid].version != kept[cid]}
            again = [
                k
                for m, k in pairs
                if m.correlation_id in moved
                and k not in already
                and m.id not in entities[m.correlation_id].outbox
            ]
            if again:
                already |= self.dedup.processed_among(again)
        return keys, already

    def _batch(
        self,
        messages: list[Message],
        handler: Handler,
        depth: int,
        before_cleanup: BeforeCleanup | None = None,
    ) -> list[ProcessResult]:
        # the kept entities stand for loads (a stale one conflicts: retried alone below)
        entities = self._kept.take_many([m.correlation_id for m in messages])
        taken = set(entities)
        missing = [m.correlation_id for m in messages if m.correlation_id not in entities]
        if missing:
            entities.update(self._claim_all(self.entities.load_many(missing)))
        keys, already = self._recorded(messages, entities, taken)
        mark = self._mark()
        results: list[ProcessResult] = []
        # A message (entity and id) is known by its key (message_key: one per pair).
        applied: dict[str, int] = {}  # key -> the copy that applied it
        # the outbox entries of the batch, each once, in order: what _entries gives
        entries: dict[str, tuple[Entity, str]] = {}
        seen: set[str] = set()
        changed: dict[str, Entity] = {}
        for index, message in enumerate(messages):
            mid, key = message.id, keys[index]
            entity = entities[message.correlation_id]
            outbox = entity.outbox
            if key in seen:
                entry = outbox.get(mid)
                results.append(ProcessResult(mid, "duplicate", tuple(entry or ())))
                continue
            seen.add(key)
            if mid in outbox:
                entry = outbox[mid]
                outcome, error = self._found(entity, mid)
                results.append(ProcessResult(mid, outcome, tuple(entry or ()), 1, error))
                entries[key] = (entity, mid)
            elif key in already:
                results.append(ProcessResult(mid, "duplicate"))
            else:
                outgoing, error = self._apply(entity, message, handler, mark)
                applied[key] = index
                changed[entity.id] = entity
                done: Outcome = "processed" if error is None else "dead_lettered"
                results.append(ProcessResult(mid, done, tuple(outgoing), 1, error))
                entries[key] = (entity, mid)
        try:
            first_conflicts = self.entities.save_many(list(changed.values()))
        except EntityTooLarge:
            if depth >= 3:  # the rounds were measured to fit: only a racing writer gets here
                raise
            return self._in_rounds(messages, handler, depth, before_cleanup)
        if before_cleanup is not None:
            return self._in_two_phases(
                messages, handler, entities, first_conflicts, results, before_cleanup
            )
        if first_conflicts:
            entries = {k: e for k, e in entries.items() if e[0].id not in first_conflicts}
        late_conflicts, sent = self._dispatch_and_clean_up(entries)
        conflicts = first_conflicts | late_conflicts
        for entity in entities.values():  # as saved (or loaded): each stands for a load
            if entity.id not in conflicts:
                self._kept.keep(entity)
        if not conflicts:
            return results
        _retrying(self.consumer, conflicts)
        for index, message in enumerate(messages):
            cid = message.correlation_id
            if cid in conflicts:
                alone = self._process(message, handler, set(sent))
                if applied.get(keys[index]) == index and cid not in first_conflicts:
                    first = results[index]  # its change was saved above: what it did then
                    alone = replace(alone, outcome=first.outcome, error=first.error)
                results[index] = alone
        return results

    def _in_two_phases(
        self,
        messages: list[Message],
        handler: Handler,
        entities: dict[str, Entity],
        conflicts: set[str],
        results: list[ProcessResult],
        before_cleanup: BeforeCleanup,
    ) -> list[ProcessResult]:
        """The rest of :meth:`_batch` with ``before_cleanup``: dispatch (steps 1-4 again
        for the entities whose save conflicted), ``before_cleanup``, then the clean-up."""
        sent = self._dispatch(self._entries(messages, entities, conflicts), set())
        _retrying(self.consumer, conflicts)
        for index, message in enumerate(messages):
            if message.correlation_id in conflicts:
                results[index] = self._process(message, handler, sent, clean=False)
        final = list(results)
        before_cleanup(messages, final)
        # the entities saved above are as saved (their versions updated); those that
        # conflicted were handled alone on fresh copies: reload only them
        if conflicts:
            entities = {**entities, **self._claim_all(self.entities.load_many(sorted(conflicts)))}
        remaining = messages
        for attempt in range(1, self.max_attempts + 1):
            conflicts, _ = self._dispatch_and_clean_up(
                self._entries(remaining, entities, set()), sent
            )
            remaining = [m for m in remaining if m.correlation_id in conflicts]
            if not remaining:
                return final
            if attempt < self.max_attempts:
                _retrying(self.consumer, conflicts)
            entities = self._claim_all(
                self.entities.load_many([m.correlation_id for m in remaining])
            )
        raise ConcurrencyConflict(
            f"the clean-up of {len(remaining)} messages (entity "
            f"{remaining[0].correlation_id!r:.80}, ...) kept conflicting for "
            f"{self.max_attempts} attempts; redeliver them"
        )

    def _entries(
        self, messages: Sequence[Message], entities: dict[str, Entity], skip: Collection[str]
    ) -> dict[str, tuple[Entity, str]]:
        """The outbox entries of ``messages`` on the entities not in ``skip``, each once:
        ``message key -> (the entity holding it, the message id)``."""
        entries: dict[str, tuple[Entity, str]] = {}
        for message in messages:
            cid, mid = message.correlation_id, message.id
            entity = entities[cid]
            if mid in entity.outbox and cid not in skip:
                key = message_key(cid, mid)
                if key not in entries:
                    entries[key] = (entity, mid)
        return entries

    def _dispatch(self, entries: dict[str, tuple[Entity, str]], sent: set[str]) -> set[str]:
        """Step 4: one ``dispatch`` of the pending outgoing messages of ``entries`` but
        those in ``sent``; returns ``sent`` with them."""
        unique: dict[str, OutgoingMessage] = {}
        for entity, mid in entries.values():
            entry = entity.outbox[mid]
            if entry:
                for m in entry:
                    if m.id not in unique and m.id not in sent:
                        unique[m.id] = m
        if unique:
            _send(self.dispatcher, list(unique.values()), self.consumer)
        return sent | unique.keys()

    def _dispatch_and_clean_up(
        self, entries: dict[str, tuple[Entity, str]], sent: set[str] | None = None
    ) -> tuple[set[str], set[str]]:
        """Steps 4-5 for the outbox ``entries`` (:meth:`_entries`), not sending ``sent``
        again.

        Returns the ids of the entities whose clean-up conflicted, and the outgoing ids
        dispatched (a retry of a conflicted entity does not send them again).
        """
        sent = self._dispatch(entries, set(sent or ()))
        to_save: dict[str, Entity] = {}
        moved: list[str] = []
        inline = self.cleanup == "inline"
        for key, (entity, mid) in entries.items():
            if inline:
                moved.append(key)
                _remove(entity, mid)
            elif entity.outbox[mid] is not None:
                _dispatched(entity, mid)
            else:
                continue
            to_save[entity.id] = entity
        heavy = [] if inline else [e for e in to_save.values() if self._over_limit(e)]
        # The ids reach the deduplication store before the save that removes them.
        self._move_dispatched(heavy, moved)
        conflicts = self.entities.save_many(list(to_save.values())) if to_save else set()
        return conflicts, sent

    def _in_rounds(
        self,
        messages: list[Message],
        handler: Handler,
        depth: int,
        before_cleanup: BeforeCleanup | None = None,
    ) -> list[ProcessResult]:
        """The batch in consecutive rounds in which each entity's new entries fit."""
        rounds: dict[int, list[int]] = {}
        numbers, refusals = self._rounds(messages, handler)
        if refusals:  # the messages their entity cannot hold: set aside in their round
            handler = _refusing(handler, refusals)
        for index, number in enumerate(numbers):
            rounds.setdefault(number, []).append(index)
        results: list[ProcessResult | None] = [None] * len(messages)
        for number in sorted(rounds):
            indexes = rounds[number]
            done = self._batch([messages[i] for i in indexes], handler, depth + 1, before_cleanup)
            for index, result in zip(indexes, done, strict=True):
                results[index] = result
        return [r for r in results if r is not None]

    def _clear(self, entities: Iterable[Entity], keep: set[tuple[str, str]]) -> set[str]:
        """Empty the outboxes of ``entities`` but for the entries of ``keep`` (and save).

        Entries still pending for other messages are dispatched again (at least once,
        same ids), then every entry but ``keep``'s moves to the deduplication store
        before the save that removes it. Returns the ids of the entities saved.
        """
        relay: list[OutgoingMessage] = []
        cleared: list[Entity] = []
        for entity in entities:
            for mid in [m for m in entity.pending if (entity.id, m) not in keep]:
                relay.extend(entity.outbox[mid] or [])
                _dispatched(entity, mid)
            if entity.dispatched:
                cleared.append(entity)
        if relay:
            _send(self.dispatcher, relay, self.consumer)
        if not cleared:
            return set()
        self._move_dispatched(cleared)
        conflicts = self.entities.save_many(cleared)
        return {e.id for e in cleared} - conflicts

    def _rounds(
        self, messages: list[Message], handler: Handler
    ) -> tuple[list[int], dict[tuple[str, str], _SetAside]]:
        """The round of each message: per entity, the longest runs that fit in its record;
        and the messages to set aside, by ``(correlation id, id)``.

        First the entities are cleared of what is not theirs to keep: dispatched ids
        move to the deduplication store, and entries still pending for messages not
        in this batch are dispatched again (at least once, same ids) and move too.
        Then sizes are measured exactly (canonical JSON) as the handlers run: a run
        ends before a message whose entry would not fit, and the entries of a run
        leave the record (inline) or shrink to ``None`` (deferred) before the next.
        A message that does not fit at the start of a run, beside the entity's state
        alone, raises ``EntityTooLarge`` naming it; with ``dead_letters`` it is set
        aside instead, its dead letter in its place (:meth:`_refusals`).
        """
        limit = self.entities.max_entity_bytes
        entities = self._claim_all(self.entities.load_many([m.correlation_id for m in messages]))
        self._clear(entities.values(), {(m.correlation_id, m.id) for m in messages})
        keys, already = self._recorded(messages, entities)
        sizes = {cid: _Sizes.of(entity) for cid, entity in entities.items()}
        for entity in entities.values():
            for mid in entity.outbox:  # this batch's own: redispatched, cleaned in the first run
                sizes[entity.id].carry(mid)
        seen: set[tuple[str, str]] = set()
        numbers: list[int] = []
        refusals: dict[tuple[str, str], _SetAside] = {}
        for index, message in enumerate(messages):
            ident = (message.correlation_id, message.id)
            entity, size = entities[message.correlation_id], sizes[message.correlation_id]
            if message.id in entity.outbox:
                numbers.append(0)
                continue
            if ident in seen or keys[index] in already:
                numbers.append(size.round)
                continue
            seen.add(ident)
            state, _, outgoing, _ = self._run(size.state, message, handler)
            entry = entry_size(message.id, outgoing, self._mark())
            total = size.total_with(state, entry)
            if total > limit and size.this_round:
                size.next_round(self.cleanup)
                total = size.total_with(state, entry)
            if total > limit:
                too_large = _too_large(
                    message,
                    EntityTooLarge(
                        f"entity {entity.id!r:.80} would encode to {total} bytes with it; "
                        f"{type(self.entities).__name__} holds at most {limit} bytes per entity"
                    ),
                )
                for refusal in self._refusals(message, outgoing, too_large):
                    refusing = _refusing(handler, {ident: refusal})
                    state, _, outgoing, _ = self._run(size.state, message, refusing)
                    entry = entry_size(message.id, outgoing, self._mark())
                    total = size.total_with(state, entry)
                    if total <= limit:
                        refusals[ident] = refusal
                        break
                else:
                    raise _unplaceable(message, too_large)
            size.add(message.id, state, entry)
            numbers.append(size.round)
        return numbers, refusals


class _EntityCache:
    """The entities the processor saved (or loaded) last, as of that save: each
    stands for a load of the entity (least recently kept dropped first, at most
    ``size`` entities and ``_CACHE_BYTES`` of their state texts and outbox ids).

    An entity taken is the taker's alone (it is changed in place); one is kept only
    once its processing is over. Its version is the save's, so a save of it after
    anyone else saved the entity conflicts: a stale entity costs a conflict and a
    load, never a wrong answer. Thread-safe.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        # (an OrderedDict: a dict's oldest entry is found by skipping the ones removed)
        self._entities: OrderedDict[str, tuple[Entity, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def take(self, entity_id: str) -> Entity | None:
        """The kept entity of ``entity_id`` (no longer kept), or None."""
        if not self._entities:
            return None
        with self._lock:
            kept = self._entities.pop(entity_id, None)
            if kept is None:
                return None
            self._bytes -= kept[1]
            return kept[0]

    def keep(self, entity: Entity) -> None:
        """Keep ``entity``, saved or loaded and not changed since, unless it is large,
        holds pending entries or its state's text is not known."""
        source = entity._source()
        if not self.size or source is None or entity.version is None:
            return
        size = len(source)
        for mid, entry in entity.outbox.items():
            if entry is not None:
                return
            size += len(mid) + 8
        if size > _CACHE_ENTITY_BYTES:
            return
        with self._lock:
            old = self._entities.pop(entity.id, None)
            self._entities[entity.id] = (entity, size)
            self._bytes += size - (0 if old is None else old[1])
            while len(self._entities) > self.size or self._bytes > _CACHE_BYTES:
                self._bytes -= self._entities.popitem(last=False)[1][1]

    def take_many(self, entity_ids: Iterable[str]) -> dict[str, Entity]:
        """The kept entities among ``entity_ids`` (no longer kept), by id."""
        if not self._entities:
            return {}
        taken: dict[str, Entity] = {}
        with self._lock:
            kept = self._entities
            for entity_id in entity_ids:
                found = kept.pop(entity_id, None)
                if found is not None:
                    self._bytes -= found[1]
                    taken[entity_id] = found[0]
        return taken


#: Bytes of the entities one processor keeps (see :class:`_EntityCache`), at most.
_CACHE_BYTES = 16 * 1024 * 1024
#: Bytes of one entity a processor keeps, at most (a larger one is loaded each time).
_CACHE_ENTITY_BYTES = 256 * 1024


@dataclass
class _Sizes:
    """The encoded size of one entity as :meth:`OutboxProcessor._rounds` adds entries."""

    state: dict[str, Any]
    entries: dict[str, int]  # message id -> bytes of its entry
    entries_bytes: int
    head: int = 0  # bytes of the optional top-level keys (the consumer)
    round: int = 0
    this_round: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, entity: Entity) -> _Sizes:
        sizes = {mid: entry_size(mid, e, entity.marks.get(mid)) for mid, e in entity.outbox.items()}
        return cls(entity.state, sizes, sum(sizes.values()), head_size(entity))

    def total_with(self, state: dict[str, Any], entry: int) -> int:
        """Bytes of the entity with ``state`` and one more entry of ``entry`` bytes."""
        commas = len(self.entries)  # n + 1 entries, n commas
        frame = ENTITY_FRAME_BYTES + self.head
        return frame + json_size(state) + self.entries_bytes + entry + commas

    def add(self, mid: str, state: dict[str, Any], entry: int) -> None:
        self.state = state
        self.entries[mid] = entry
        self.entries_bytes += entry
        self.this_round.append(mid)

    def carry(self, mid: str) -> None:
        """A pending entry of this batch: cleaned up with the current run."""
        self.this_round.append(mid)

    def next_round(self, cleanup: str) -> None:
        """After a run: inline removes its entries, deferred leaves ``None`` ones."""
        for mid in self.this_round:
            old = self.entries.pop(mid)
            self.entries_bytes -= old
            if cleanup != "inline":
                self.entries[mid] = entry_size(mid, None)
                self.entries_bytes += self.entries[mid]
        self.this_round = []
        self.round += 1


class _HandlerContract(TypeError):
    """A handler returned something else than ``(dict, sends)``."""

    def __str__(self) -> str:
        return (
            "a handler must return (new_state: dict, sends: a sequence of Send), "
            f"with JSON-compatible state and bodies; {self.args[0]}"
        )


def _shown(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


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


def _letter_error(letter: OutgoingMessage) -> str:
    """A dead letter's error as results show it: ``"<class name>: <text>"``."""
    error = letter.body["error"]
    return f"{str(error['type']).rsplit('.', 1)[-1]}: {error['text']}"


def _dispatched(entity: Entity, mid: str) -> None:
    """Mark the entry of ``mid`` dispatched (it keeps no mark)."""
    entity.outbox[mid] = None
    entity.marks.pop(mid, None)


def _remove(entity: Entity, mid: str) -> None:
    """Remove the entry of ``mid`` (and its mark) from the outbox.

    An outbox or marks left empty is replaced by a new ``{}``: a dict that once held
    containers stays tracked by the cyclic garbage collector, which then walks it in
    every collection while the entity is kept; a new empty one is not tracked.
    """
    outbox, marks = entity.outbox, entity.marks
    outbox.pop(mid, None)
    if not outbox:
        entity.outbox = {}
    if marks:
        marks.pop(mid, None)
        if not marks:
            entity.marks = {}


def _send(dispatcher: Dispatcher, messages: Sequence[OutgoingMessage], consumer: str) -> None:
    """``dispatcher.dispatch(messages)``; a failure is counted and logged, then raised."""
    try:
        dispatcher.dispatch(messages)
    except Exception as exc:
        metrics.count_dispatch_failure(consumer, exc)
        _log.warning(
            "consumer %s: dispatching %d outgoing message(s) failed (they stay in the outbox "
            "and are dispatched again on redelivery or by a sweep with redispatch): %s: %s",
            consumer,
            len(messages),
            type(exc).__name__,
            format_error(exc),
        )
        raise


def _retrying(consumer: str, entity_ids: Collection[str]) -> None:
    """Count and log the processor's concurrency conflicts about to be retried."""
    if entity_ids:
        metrics.count_conflicts(consumer, "processor", len(entity_ids))
        _log.debug(
            "consumer %s: concurrency conflict on %d entity(ies) (%s); retrying",
            consumer,
            len(entity_ids),
            ", ".join(sorted(repr(e)[:80] for e in entity_ids)[:5]),
        )


def check_handler(handler: object) -> None:
    """Raise ``ConfigurationError`` if ``handler`` is not callable or is asynchronous
    (an ``async def`` function, or an object whose ``__call__`` is one): async handlers
    are not supported yet (the processor would save the coroutine it returns)."""
    if not callable(handler):
        raise ConfigurationError(f"handler must be callable, got {_shown(handler)}")
    call = getattr(handler, "__call__", None)  # noqa: B004 (the method itself is inspected)
    if inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(call):
        raise ConfigurationError(
            f"the handler {getattr(handler, '__qualname__', type(handler).__name__)!r:.80} is "
            "an async function: async handlers are not supported yet; make it a plain "
            "function (a handler is pure: no I/O to await)"
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


def _validate(message: Message) -> None:
    """The message's ids, checked before any I/O."""
    validate_message_id(message.id)
    validate_message_id(message.correlation_id, "correlation id")


def _foreign(entity: Entity, consumer: str) -> ConfigurationError:
    """An entity recorded for another consumer than ``consumer``, refused."""
    return ConfigurationError(
        f"entity {entity.id!r:.80} belongs to consumer {entity.consumer!r:.80}, not "
        f"{consumer!r:.80} (the deduplication store's endpoint); nothing was written. Each "
        "consumer has its own endpoint and entity store: open the deduplication store with "
        f"endpoint={entity.consumer!r:.80}, or give this consumer its own entity store"
    )


def _too_large(message: Message, exc: EntityTooLarge) -> EntityTooLarge:
    return EntityTooLarge(
        f"message {message.id!r:.80} of entity {message.correlation_id!r:.80}: its new state "
        f"and outgoing messages do not fit in one entity record ({exc}); nothing of it was "
        "saved. Make the state or the outgoing messages smaller.",
        message_id=message.id,
        correlation_id=message.correlation_id,
    )


def _unplaceable(message: Message, too_large: EntityTooLarge) -> EntityTooLarge:
    """The entity cannot hold even the message's bounded dead letter beside its state."""
    return EntityTooLarge(
        f"message {message.id!r:.80} of entity {message.correlation_id!r:.80} cannot be set "
        "aside: even its bounded dead letter does not fit beside the entity's state "
        f"({too_large})",
        message_id=message.id,
        correlation_id=message.correlation_id,
    )


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


#: What a processor's dead letter carries of the original message, replaced in this
#: order by its size and digest when the letter does not fit (:func:`bounded_letter`).
_LETTER_PARTS = (("message", "body"), ("message", "headers"))


# ---------------------------------------------------------------------- the sweep


@dataclass
class SweepResult:
    """What one sweep of one segment did."""

    segment: int = 0
    segments: int = 1
    entities_scanned: int = 0
    ids_moved: int = 0
    conflicts_retried: int = 0
    redispatched: int = 0
    ids_left: int = 0
    seconds: float = 0.0


def sweep(
    entities: EntityStore,
    dedup: DeduplicationStore,
    segment: int = 0,
    segments: int = 1,
    redispatch: Dispatcher | None = None,
    *,
    batch_ids: int = 1000,
    max_attempts: int = 10,
    progress: Callable[[SweepResult], None] | None = None,
) -> SweepResult:
    """Move the ids of dispatched outbox entries into ``dedup``, for one segment.

    For each entity of the segment with dispatched (``None``) entries: the ids go
    to the deduplication store with ``add_many`` (batched across entities, about one
    call per ``batch_ids`` ids), then leave the outbox in a save under the entity's
    token (on conflict: reload, remove the ids that were added, save; at most
    ``max_attempts`` times, then the ids stay for the next sweep: ``ids_left``).
    Each id is recorded as :func:`~dedupstore.ids.message_key` of its entity and id,
    under ``dedup``'s endpoint: an entity recorded for another consumer raises
    ``ConfigurationError`` naming both before it or anything of its batch is written
    (an entity with no consumer recorded is taken as this one's, and saved so).
    With ``redispatch``, entries still pending are dispatched first; without it they
    stay and count in ``ids_left`` (so ``ids_left == 0`` means every outbox of the
    segment was empty when the sweep saved it). Safe beside
    live consumers and other sweeps; memory is bounded by the batch.

    ``progress``, if given, is called after each batch of ids is moved (not per
    entity) with a copy of the running totals (``seconds`` so far); what it raises
    stops the sweep (the batches before it are done). Raises ``StoreUnavailable``,
    ``ConfigurationError`` (a missing store), and what ``redispatch`` raises.
    """
    started = time.perf_counter()
    result = SweepResult(segment=segment, segments=segments)
    report = _SweepProgress(result, started, dedup.endpoint, progress)
    batch: list[tuple[Entity, list[str]]] = []
    relay: list[OutgoingMessage] = []  # pending entries of the batch, sent in one call
    size = 0
    consumer = dedup.endpoint
    for entity in entities.pending_outboxes(segment, segments):
        result.entities_scanned += 1
        _swept(entity, consumer)
        pending = entity.pending if redispatch is not None else []
        for mid in pending:
            relay.extend(entity.outbox[mid] or [])
            _dispatched(entity, mid)
        result.redispatched += len(pending)
        if redispatch is None:
            result.ids_left += len(entity.pending)  # still awaiting dispatch: not moved
        done = entity.dispatched
        if not done:
            continue
        batch.append((entity, done))
        size += len(done)
        if size >= batch_ids:
            _flush(entities, dedup, batch, result, max_attempts, redispatch, relay)
            report.flushed()
            batch, relay, size = [], [], 0
    if batch:
        _flush(entities, dedup, batch, result, max_attempts, redispatch, relay)
        report.flushed()
    result.seconds = time.perf_counter() - started
    report.done()
    return result


def _swept(entity: Entity, consumer: str) -> Entity:
    """An entity a sweep for ``consumer`` loaded, claimed for it (or refused)."""
    if entity.consumer != consumer:
        if entity.consumer is not None:
            raise _foreign(entity, consumer)
        entity.consumer = consumer
    return entity


def applied_among(
    entities: EntityStore, dedup: DeduplicationStore, messages: Iterable[tuple[str, str]]
) -> set[tuple[str, str]]:
    """The ``(correlation id, message id)`` pairs among ``messages`` that were applied.

    A message was applied when its id is in its entity's outbox (pending, or
    dispatched and awaiting the sweep: a deferred clean-up leaves it there) or its
    :func:`~dedupstore.ids.message_key` is recorded in ``dedup``. The entities are
    loaded first, then ``dedup`` is asked about the others: an id reaches the store
    before it leaves the outbox, so a sweep running meanwhile never hides one. One
    ``load_many`` and one ``processed_among``. Raises ``InvalidMessageId`` before any
    I/O, ``ConfigurationError`` for an entity recorded for another consumer than
    ``dedup``'s endpoint (its outbox says nothing about this one), ``StoreUnavailable``.
    """
    pairs = list(dict.fromkeys(messages))
    for cid, mid in pairs:
        validate_message_id(cid, "correlation id")
        validate_message_id(mid)
    if not pairs:
        return set()
    loaded = entities.load_many([cid for cid, _ in pairs])
    consumer = dedup.endpoint
    for entity in loaded.values():
        if entity.consumer is not None and entity.consumer != consumer:
            raise _foreign(entity, consumer)
    found = {(cid, mid) for cid, mid in pairs if mid in loaded[cid].outbox}
    rest = {message_key(cid, mid): (cid, mid) for cid, mid in pairs if (cid, mid) not in found}
    if rest:
        found.update(rest[key] for key in dedup.processed_among(rest))
    return found


def recorded_consumer(
    consumers: Collection[str], given_by: str = "endpoint", endpoint: str | None = None
) -> str:
    """The consumer to sweep for: ``endpoint`` if given, else the one ``consumers`` holds.

    ``consumers``: the consumers recorded on an entity store's non-empty outboxes
    (:attr:`~dedupstore.stats.Backlog.consumers`). With ``endpoint``: it, or
    ``ConfigurationError`` naming both when another consumer is recorded. Without:
    none recorded is ``"default"``, the endpoint of a store opened without one;
    several are a ``ConfigurationError`` listing them (each consumer has its own
    entity store; ``given_by`` names how to choose one, e.g. ``"--endpoint"``).
    """
    if endpoint is not None:
        others = sorted(set(consumers) - {endpoint})
        if others:
            names = ", ".join(repr(c)[:80] for c in others)
            raise ConfigurationError(
                f"the entity store holds outboxes of consumer {names}, not {endpoint!r:.80} "
                "(the deduplication store's endpoint); nothing was written. Each consumer has "
                f"its own endpoint and entity store: sweep with {given_by} {others[0]!r:.80}"
            )
        return endpoint
    if not consumers:
        return "default"
    if len(consumers) == 1:
        return next(iter(consumers))
    names = ", ".join(repr(c)[:80] for c in sorted(consumers))
    raise ConfigurationError(
        f"the entity store holds the outboxes of {len(consumers)} consumers ({names}), and "
        f"no endpoint was given: name the consumer to sweep with {given_by} (a sweep "
        "refuses the entities of another consumer; each consumer should have its own "
        "entity store)"
    )


class _SweepProgress:
    """After each batch of :func:`sweep`: metrics, a log line, the caller's callback."""

    #: At most one INFO line this often (the others are DEBUG), plus the final one.
    log_every = 10.0

    def __init__(
        self,
        result: SweepResult,
        started: float,
        consumer: str,
        callback: Callable[[SweepResult], None] | None,
    ) -> None:
        self.result = result
        self.started = started
        self.consumer = consumer
        self.callback = callback
        self.moved = self.conflicts = 0
        self.logged = started

    def _count(self) -> None:
        """Record what moved and conflicted since the last call."""
        result = self.result
        metrics.count_swept(self.consumer, result.ids_moved - self.moved)
        metrics.count_conflicts(self.consumer, "sweep", result.conflicts_retried - self.conflicts)
        self.moved, self.conflicts = result.ids_moved, result.conflicts_retried

    def flushed(self) -> None:
        self._count()
        now = time.perf_counter()
        snapshot = replace(self.result, seconds=now - self.started)
        level = logging.INFO if now - self.logged >= self.log_every else logging.DEBUG
        if _log.isEnabledFor(level):
            if level == logging.INFO:
                self.logged = now
            _log.log(
                level, "sweep of consumer %s in progress: %s", self.consumer, _totals(snapshot)
            )
        if self.callback is not None:
            self.callback(snapshot)

    def done(self) -> None:
        self._count()
        _log.info("sweep of consumer %s done: %s", self.consumer, _totals(self.result))


def _totals(result: SweepResult) -> str:
    return (
        f"segment {result.segment} of {result.segments}: {result.entities_scanned} entities "
        f"scanned, {result.ids_moved} ids moved, {result.conflicts_retried} conflicts retried, "
        f"{result.redispatched} redispatched, {result.ids_left} ids left, {result.seconds:.1f} s"
    )


def _flush(
    entities: EntityStore,
    dedup: DeduplicationStore,
    batch: list[tuple[Entity, list[str]]],
    result: SweepResult,
    max_attempts: int,
    redispatch: Dispatcher | None,
    relay: list[OutgoingMessage],
) -> None:
    """Dispatch ``relay`` (one call), ``add_many`` the batch's ids, then remove them."""
    if redispatch is not None and relay:
        _send(redispatch, relay, dedup.endpoint)
    dedup.add_many([message_key(entity.id, mid) for entity, ids in batch for mid in ids])
    moved = {entity.id: ids for entity, ids in batch}
    for entity, ids in batch:
        for mid in ids:
            _remove(entity, mid)
    conflicted = entities.save_many([entity for entity, _ in batch])
    result.ids_moved += sum(len(ids) for eid, ids in moved.items() if eid not in conflicted)
    for eid in conflicted:
        ids = moved[eid]
        for _attempt in range(max_attempts):
            result.conflicts_retried += 1
            entity = _swept(entities.load(eid), dedup.endpoint)
            present = [mid for mid in ids if mid in entity.outbox]
            if not present:
                result.ids_moved += len(ids)
                break
            for mid in present:
                _remove(entity, mid)
            if not entities.save_many([entity]):
                result.ids_moved += len(ids)
                break
        else:
            result.ids_left += len(ids)
