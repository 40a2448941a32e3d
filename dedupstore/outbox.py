"""The improving-outbox algorithm: :class:`OutboxProcessor` and :func:`sweep`.

For an incoming message ``m`` (id ``mid``) of entity ``cid``:

1. load the entity;
2. if ``mid`` is not in its outbox: if the deduplication store has ``mid``, it is a
   duplicate (this check comes AFTER the load, so a concurrent copy that cleans the
   outbox in between makes this copy's save fail on the token instead of applying
   the change twice); else run the handler on the state, put the outgoing messages
   (ids derived from ``mid`` and their position) in ``outbox[mid]`` and save;
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

import copy
import json
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol, runtime_checkable

from dedupstore.entities import Entity, EntityStore, OutgoingMessage
from dedupstore.errors import ConcurrencyConflict, ConfigurationError
from dedupstore.ids import validate_message_id
from dedupstore.store import DeduplicationStore

__all__ = [
    "Dispatcher",
    "Handler",
    "InMemoryDispatcher",
    "Message",
    "OutboxProcessor",
    "ProcessResult",
    "Send",
    "SweepResult",
    "outgoing_id",
    "sweep",
]

#: Namespace of the UUIDv5 outgoing message ids.
OUTGOING_NAMESPACE = uuid.UUID("6f1e6a52-4d0b-5c55-9a57-2a7d1c0b9e41")

Outcome = Literal["processed", "duplicate", "redispatched"]


@dataclass(frozen=True)
class Message:
    """An incoming message: its id, the correlation (entity) id, a body and headers."""

    id: str
    correlation_id: str
    body: Any
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Send:
    """An outgoing message a handler asks for; the processor gives it its id."""

    destination: str
    body: Any
    headers: Mapping[str, str] = field(default_factory=dict)


#: ``handler(state, message) -> (new_state, sends)``: pure, deterministic.
Handler = Callable[[dict[str, Any], Message], tuple[dict[str, Any], Sequence[Send]]]


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


@dataclass(frozen=True)
class ProcessResult:
    """What processing one message did.

    ``outcome``: ``"processed"`` (this call applied the state change),
    ``"duplicate"`` (applied before; nothing left to do, or only the clean-up), or
    ``"redispatched"`` (applied before, its outgoing messages still pending: this
    call dispatched them again). ``outgoing``: the message's outgoing messages when
    known. ``attempts``: loads, including those after a concurrency conflict.
    """

    message_id: str
    outcome: Outcome
    outgoing: tuple[OutgoingMessage, ...] = ()
    attempts: int = 1


def outgoing_id(message_id: str, position: int) -> str:
    """The id of the ``position``-th outgoing message of ``message_id`` (UUIDv5)."""
    # "<position>:<id>" is unambiguous: the position is digits, the first ":" ends it.
    return str(uuid.uuid5(OUTGOING_NAMESPACE, f"{position}:{message_id}"))


def _normalized(value: Any) -> Any:
    """``value`` as it will be after a JSON round trip (tuples become lists, ...)."""
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"the new state and every outgoing message body must be JSON-compatible: {exc}"
        ) from None


class OutboxProcessor:
    """Processes messages exactly once: entity state, outbox, dispatch, then the id.

    ``cleanup="inline"`` moves each id to the deduplication store as part of
    processing (two more round trips); ``"deferred"`` only marks the outbox entry
    dispatched and leaves the move to :func:`sweep`. ``max_attempts`` bounds the
    retries after ``ConcurrencyConflict``. Thread-safe if the stores are.
    """

    def __init__(
        self,
        entities: EntityStore,
        dedup: DeduplicationStore,
        dispatcher: Dispatcher,
        *,
        cleanup: Literal["inline", "deferred"] = "inline",
        max_attempts: int = 10,
    ) -> None:
        """Raises ``ConfigurationError`` for an unknown ``cleanup`` or ``max_attempts < 1``."""
        if cleanup not in ("inline", "deferred"):
            raise ConfigurationError(f"cleanup must be 'inline' or 'deferred', got {cleanup!r}")
        if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
            raise ConfigurationError(f"max_attempts must be an int >= 1, got {max_attempts!r}")
        self.entities = entities
        self.dedup = dedup
        self.dispatcher = dispatcher
        self.cleanup = cleanup
        self.max_attempts = max_attempts

    # ------------------------------------------------------------------ one message

    def process(self, message: Message, handler: Handler) -> ProcessResult:
        """Run the algorithm for one message; return what it did.

        Raises ``InvalidMessageId`` (before any I/O), ``ConcurrencyConflict`` after
        ``max_attempts`` conflicts, ``StoreUnavailable``, and whatever the handler or
        the dispatcher raises (then the message must be redelivered).
        """
        return self._process(message, handler, set())

    def _process(self, message: Message, handler: Handler, dispatched: set[str]) -> ProcessResult:
        """:meth:`process`, not sending again the outgoing ids in ``dispatched``."""
        mid = validate_message_id(message.id)
        validate_message_id(message.correlation_id, "correlation id")
        applied = False
        outcome: Outcome | None = None
        for attempt in range(1, self.max_attempts + 1):
            try:
                entity = self.entities.load(message.correlation_id)
                if mid not in entity.outbox:
                    if self.dedup.has_been_processed(mid):
                        return ProcessResult(
                            mid, "processed" if applied else "duplicate", (), attempt
                        )
                    outgoing: list[OutgoingMessage] | None = self._apply(entity, message, handler)
                    self.entities.save(entity)
                    applied, outcome = True, "processed"
                else:
                    outgoing = entity.outbox[mid]
                    if outcome is None:
                        outcome = "duplicate" if outgoing is None else "redispatched"
                if outgoing is not None and not {m.id for m in outgoing} <= dispatched:
                    self.dispatcher.dispatch(outgoing)
                    dispatched.update(m.id for m in outgoing)
                self._clean_up(entity, mid)
                return ProcessResult(mid, outcome, tuple(outgoing or ()), attempt)
            except ConcurrencyConflict:
                continue
        raise ConcurrencyConflict(
            f"message {mid!r:.80} of entity {message.correlation_id!r:.80}: the entity kept "
            f"changing under it for {self.max_attempts} attempts; redeliver it"
        )

    def _apply(self, entity: Entity, message: Message, handler: Handler) -> list[OutgoingMessage]:
        """Steps 2b-2c in memory: run the handler, record its outputs in the outbox."""
        state, sends = handler(copy.deepcopy(entity.state), message)
        if not isinstance(state, dict):
            raise TypeError(f"a handler must return (dict, sends), got {type(state).__name__}")
        sends = list(sends)
        # One JSON round trip for the state and every body: what a reload will show.
        state, bodies = _normalized([state, [send.body for send in sends]])
        outgoing = [
            OutgoingMessage(
                id=outgoing_id(message.id, position),
                destination=validate_message_id(str(send.destination), "destination"),
                body=body,
                headers={str(k): str(v) for k, v in dict(send.headers).items()},
            )
            for position, (send, body) in enumerate(zip(sends, bodies, strict=True))
        ]
        entity.state = state
        entity.outbox[message.id] = outgoing
        return outgoing

    def _clean_up(self, entity: Entity, mid: str) -> None:
        """Step 5 for one message on a loaded entity (saves it)."""
        if self.cleanup == "inline":
            self.dedup.add(mid)
            del entity.outbox[mid]
            self.entities.save(entity)
        elif entity.outbox[mid] is not None:
            entity.outbox[mid] = None
            self.entities.save(entity)

    # ------------------------------------------------------------------ batches

    def process_batch(self, messages: Sequence[Message], handler: Handler) -> list[ProcessResult]:
        """Run the algorithm for many messages at once; one result per message, in order.

        Round trips per batch, not per message: ``load_many``, one
        ``processed_among``, ``save_many``, one ``dispatch``, then the clean-up
        (``add_many`` + ``save_many`` inline, ``save_many`` deferred). Each entity's
        messages are handled in their order in ``messages``. Entities whose save
        conflicts are retried alone with :meth:`process`. Same guarantees and errors
        as :meth:`process` for every message.
        """
        for message in messages:
            validate_message_id(message.id)
            validate_message_id(message.correlation_id, "correlation id")
        if not messages:
            return []
        entities = self.entities.load_many([m.correlation_id for m in messages])
        fresh = [m.id for m in messages if m.id not in entities[m.correlation_id].outbox]
        already = self.dedup.processed_among(fresh) if fresh else set()
        results: list[ProcessResult | None] = [None] * len(messages)
        applied: set[str] = set()
        changed: set[str] = set()
        for index, message in enumerate(messages):
            entity = entities[message.correlation_id]
            if message.id in entity.outbox:
                entry = entity.outbox[message.id]
                outcome: Outcome = (
                    "duplicate" if entry is None or message.id in applied else "redispatched"
                )
                results[index] = ProcessResult(message.id, outcome, tuple(entry or ()))
            elif message.id in already:
                results[index] = ProcessResult(message.id, "duplicate")
            else:
                outgoing = self._apply(entity, message, handler)
                applied.add(message.id)
                changed.add(entity.id)
                results[index] = ProcessResult(message.id, "processed", tuple(outgoing))
        first_conflicts = self.entities.save_many([entities[cid] for cid in changed])
        late_conflicts, sent = self._dispatch_and_clean_up(messages, entities, first_conflicts)
        for index, message in enumerate(messages):
            cid = message.correlation_id
            if cid in first_conflicts or cid in late_conflicts:
                alone = self._process(message, handler, set(sent))
                if message.id in applied and cid not in first_conflicts:
                    alone = replace(alone, outcome="processed")  # its change was saved above
                results[index] = alone
        return [r for r in results if r is not None]

    def _dispatch_and_clean_up(
        self, messages: Sequence[Message], entities: dict[str, Entity], skip: set[str]
    ) -> tuple[set[str], set[str]]:
        """Steps 4-5 for the entities saved.

        Returns the ids of the entities whose clean-up conflicted, and the outgoing ids
        dispatched (a retry of a conflicted entity does not send them again).
        """
        entries: dict[str, Entity] = {}  # message id -> its (saved) entity holding the entry
        for message in messages:
            entity = entities[message.correlation_id]
            if entity.id not in skip and message.id in entity.outbox:
                entries[message.id] = entity
        outgoing = [m for mid, entity in entries.items() for m in entity.outbox[mid] or []]
        if outgoing:
            self.dispatcher.dispatch(outgoing)
        to_save: dict[str, Entity] = {}
        if self.cleanup == "inline" and entries:
            self.dedup.add_many(list(entries))
        for mid, entity in entries.items():
            if self.cleanup == "inline":
                del entity.outbox[mid]
            elif entity.outbox[mid] is not None:
                entity.outbox[mid] = None
            else:
                continue
            to_save[entity.id] = entity
        conflicts = self.entities.save_many(list(to_save.values())) if to_save else set()
        return conflicts, {m.id for m in outgoing}


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
) -> SweepResult:
    """Move the ids of dispatched outbox entries into ``dedup``, for one segment.

    For each entity of the segment with dispatched (``None``) entries: the ids go
    to the deduplication store with ``add_many`` (batched across entities, about one
    call per ``batch_ids`` ids), then leave the outbox in a save under the entity's
    token (on conflict: reload, remove the ids that were added, save; at most
    ``max_attempts`` times, then the ids stay for the next sweep: ``ids_left``).
    With ``redispatch``, entries still pending are dispatched first. Safe beside
    live consumers and other sweeps; memory is bounded by the batch.
    """
    started = time.perf_counter()
    result = SweepResult(segment=segment, segments=segments)
    batch: list[tuple[Entity, list[str]]] = []
    relay: list[OutgoingMessage] = []  # pending entries of the batch, sent in one call
    size = 0
    for entity in entities.pending_outboxes(segment, segments):
        result.entities_scanned += 1
        pending = entity.pending if redispatch is not None else []
        for mid in pending:
            relay.extend(entity.outbox[mid] or [])
            entity.outbox[mid] = None
        result.redispatched += len(pending)
        done = entity.dispatched
        if not done:
            continue
        batch.append((entity, done))
        size += len(done)
        if size >= batch_ids:
            _flush(entities, dedup, batch, result, max_attempts, redispatch, relay)
            batch, relay, size = [], [], 0
    if batch:
        _flush(entities, dedup, batch, result, max_attempts, redispatch, relay)
    result.seconds = time.perf_counter() - started
    return result


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
        redispatch.dispatch(relay)
    dedup.add_many([mid for _, ids in batch for mid in ids])
    moved = {entity.id: ids for entity, ids in batch}
    for entity, ids in batch:
        for mid in ids:
            entity.outbox.pop(mid, None)
    conflicted = entities.save_many([entity for entity, _ in batch])
    result.ids_moved += sum(len(ids) for eid, ids in moved.items() if eid not in conflicted)
    for eid in conflicted:
        ids = moved[eid]
        for _attempt in range(max_attempts):
            result.conflicts_retried += 1
            entity = entities.load(eid)
            present = [mid for mid in ids if mid in entity.outbox]
            if not present:
                result.ids_moved += len(ids)
                break
            for mid in present:
                del entity.outbox[mid]
            if not entities.save_many([entity]):
                result.ids_moved += len(ids)
                break
        else:
            result.ids_left += len(ids)
