""":func:`sweep` (the deferred clean-up: dispatched ids moved to the deduplication store)
and the questions asked of an entity store's outboxes: :func:`applied_among`
(:func:`recorded_among` without them), :func:`recorded_consumer`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace

from dedupstore import metrics
from dedupstore.entities import Entity, EntityStore, OutgoingMessage
from dedupstore.errors import ConfigurationError
from dedupstore.ids import message_key, validate_ids, validate_message_id
from dedupstore.outbox.entries import _dispatched, _foreign, _log, _remove, _send
from dedupstore.outbox.messages import Dispatcher
from dedupstore.outbox.tokened import (
    _no_token_store,
    foldable,
    retire,
    retire_joined,
    retirement,
    stamped,
    unmade,
)
from dedupstore.steps import Steps, call, io, run, user
from dedupstore.store import DeduplicationStore
from dedupstore.tokens import TokenStore


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
    tokens: TokenStore | None = None,
) -> SweepResult:
    """Move the ids of dispatched outbox entries into ``dedup``, for one segment.

    For each entity of the segment with dispatched (``None``) entries: the ids go to the
    deduplication store with ``add_many`` (batched across entities, about one call per
    ``batch_ids`` ids), then leave the outbox in a save under the entity's token (on
    conflict: reload, remove the ids that were added, save; at most ``max_attempts``
    times, then the ids stay for the next sweep: ``ids_left``). Each id is recorded as
    :func:`~dedupstore.ids.message_key` of its entity and id, under ``dedup``'s
    endpoint: an entity recorded for another consumer raises ``ConfigurationError``
    naming both before it or anything of its batch is written (an entity with no
    consumer recorded is taken as this one's, and saved so). With ``redispatch``,
    entries still pending are dispatched first; without it they stay and count in
    ``ids_left`` (so ``ids_left == 0`` means every outbox of the segment was empty when
    the sweep saved it). Safe beside live consumers and other sweeps; memory is bounded
    by the batch.

    ``progress``, if given, is called after each batch of ids is moved (not per entity)
    with a copy of the running totals (``seconds`` so far); what it raises stops the
    sweep (the batches before it are done). Raises ``StoreUnavailable``,
    ``ConfigurationError`` (a missing store), and what ``redispatch`` raises.

    Entries written in token mode need ``tokens``, the token store of the processor
    that wrote them (``ConfigurationError`` without, before anything of the entity's
    batch is written): a dispatched entry's incoming token and garbage tokens are
    deleted instead of its id being added. A pending entry whose outgoing tokens were
    not made yet (its consumer died before) is not redispatched: it counts in
    ``ids_left`` and the message's redelivery completes it.
    """
    return run(
        _sweep(
            entities,
            dedup,
            segment,
            segments,
            redispatch,
            batch_ids=batch_ids,
            max_attempts=max_attempts,
            progress=progress,
            tokens=tokens,
        )
    )


def _sweep(
    entities: EntityStore,
    dedup: DeduplicationStore,
    segment: int,
    segments: int,
    redispatch: Dispatcher | None,
    *,
    batch_ids: int,
    max_attempts: int,
    progress: Callable[[SweepResult], object] | None,
    tokens: TokenStore | None,
) -> Steps[SweepResult]:
    """The steps of :func:`sweep`."""
    started = time.perf_counter()
    result = SweepResult(segment=segment, segments=segments)
    report = _SweepProgress(result, started, dedup.endpoint, progress)
    batch: list[tuple[Entity, list[str]]] = []
    relay: list[OutgoingMessage] = []  # pending entries of the batch, sent in one call
    size = 0
    consumer = dedup.endpoint
    scan = yield from io(entities.pending_outboxes, segment, segments)
    while True:
        entity = yield from io(_next, scan)
        if entity is None:
            break
        result.entities_scanned += 1
        _swept(entity, consumer)
        if entity.tokens and tokens is None:
            raise _no_token_store(consumer)
        pending = entity.pending if redispatch is not None else []
        pending = [mid for mid in pending if not unmade(entity, mid)]
        for mid in pending:
            relay.extend(stamped(entity, mid))
            _dispatched(entity, mid)
        result.redispatched += len(pending)
        # still awaiting dispatch (all, without redispatch; with, those whose tokens
        # are not made yet): not moved
        result.ids_left += len(entity.pending)
        done = entity.dispatched
        if not done:
            continue
        batch.append((entity, done))
        size += len(done)
        if size >= batch_ids:
            yield from _flush(
                entities, dedup, tokens, batch, result, max_attempts, redispatch, relay
            )
            yield from report.flushed()
            batch, relay, size = [], [], 0
    if batch:
        yield from _flush(entities, dedup, tokens, batch, result, max_attempts, redispatch, relay)
        yield from report.flushed()
    result.seconds = time.perf_counter() - started
    report.done()
    return result


def _next(scan: Iterator[Entity]) -> Entity | None:
    """The next entity of a scan (I/O when it reads a page), None at its end."""
    return next(scan, None)


def _swept(entity: Entity, consumer: str) -> Entity:
    """An entity a sweep for ``consumer`` loaded, claimed for it (or refused)."""
    if entity.consumer != consumer:
        if entity.consumer is not None:
            raise _foreign(entity, consumer)
        entity.consumer = consumer
    return entity


def applied_among(
    entities: EntityStore,
    dedup: DeduplicationStore,
    messages: Iterable[tuple[str, str]],
    *,
    tokens: TokenStore | None = None,
    token_ids: Mapping[tuple[str, str], str] | None = None,
) -> set[tuple[str, str]]:
    """The ``(correlation id, message id)`` pairs among ``messages`` that were applied.

    A message was applied when its id is in its entity's outbox (pending, or
    dispatched and awaiting the sweep: a deferred clean-up leaves it there) or its
    :func:`~dedupstore.ids.message_key` is recorded in ``dedup``. The entities are
    loaded first, then ``dedup`` is asked about the others: an id reaches the store
    before it leaves the outbox, so a sweep running meanwhile never hides one. One
    ``load_many`` and one ``processed_among``.

    Token mode: a pair of ``token_ids`` (pair -> its token id for ``dedup``'s
    endpoint, :func:`~dedupstore.tokens.token_of`) was applied when its id is in the
    outbox or its token is gone from ``tokens`` (read after the load, as the
    processor does; one ``present_among``); ``dedup`` is not asked about it.

    Raises ``InvalidMessageId`` before any I/O, ``ConfigurationError`` for an entity
    recorded for another consumer than ``dedup``'s endpoint (its outbox says nothing
    about this one) or ``token_ids`` without ``tokens``, ``StoreUnavailable``.
    """
    return run(_applied_among(entities, dedup, messages, tokens=tokens, token_ids=token_ids))


def _applied_among(
    entities: EntityStore,
    dedup: DeduplicationStore,
    messages: Iterable[tuple[str, str]],
    *,
    tokens: TokenStore | None,
    token_ids: Mapping[tuple[str, str], str] | None,
) -> Steps[set[tuple[str, str]]]:
    """The steps of :func:`applied_among`."""
    pairs, tokened = _asked(messages, tokens, token_ids)
    if not pairs:
        return set()
    loaded = yield from call(entities, "load_many", [cid for cid, _ in pairs])
    consumer = dedup.endpoint
    for entity in loaded.values():
        if entity.consumer is not None and entity.consumer != consumer:
            raise _foreign(entity, consumer)
    found = {(cid, mid) for cid, mid in pairs if mid in loaded[cid].outbox}
    rest = [pair for pair in pairs if pair not in found]
    return found | (yield from _recorded(dedup, rest, tokens, tokened))


def recorded_among(
    dedup: DeduplicationStore,
    messages: Iterable[tuple[str, str]],
    *,
    tokens: TokenStore | None = None,
    token_ids: Mapping[tuple[str, str], str] | None = None,
) -> set[tuple[str, str]]:
    """The ``(correlation id, message id)`` pairs among ``messages`` whose record says
    they were applied: :func:`applied_among` without the entity store, so without the
    ids still in an outbox (read after a sweep, or accept that those look unapplied).

    A pair of ``token_ids`` was applied when its token is gone from ``tokens`` (one
    ``present_among``); the others when their key is recorded in ``dedup`` (one
    ``processed_among``). Raises ``InvalidMessageId`` before any I/O,
    ``ConfigurationError`` for ``token_ids`` without ``tokens``, ``StoreUnavailable``.
    """
    return run(_recorded_among(dedup, messages, tokens=tokens, token_ids=token_ids))


def _recorded_among(
    dedup: DeduplicationStore,
    messages: Iterable[tuple[str, str]],
    *,
    tokens: TokenStore | None,
    token_ids: Mapping[tuple[str, str], str] | None,
) -> Steps[set[tuple[str, str]]]:
    """The steps of :func:`recorded_among`."""
    pairs, tokened = _asked(messages, tokens, token_ids)
    return (yield from _recorded(dedup, pairs, tokens, tokened))


def _asked(
    messages: Iterable[tuple[str, str]],
    tokens: TokenStore | None,
    token_ids: Mapping[tuple[str, str], str] | None,
) -> tuple[list[tuple[str, str]], dict[tuple[str, str], str]]:
    """The pairs asked about (each once) and the token ids of those with one, checked
    before any I/O."""
    pairs = list(dict.fromkeys(messages))
    for cid, mid in pairs:
        validate_message_id(cid, "correlation id")
        validate_message_id(mid)
    tokened = {pair: token_ids[pair] for pair in pairs if pair in token_ids} if token_ids else {}
    if tokened and tokens is None:
        raise ConfigurationError(
            "messages with a token need the token store (tokens=): nothing was read"
        )
    validate_ids(list(tokened.values()), "token id")
    return pairs, tokened


def _recorded(
    dedup: DeduplicationStore,
    pairs: list[tuple[str, str]],
    tokens: TokenStore | None,
    tokened: Mapping[tuple[str, str], str],
) -> Steps[set[tuple[str, str]]]:
    """Those of ``pairs`` whose token is gone (tokened) or whose key ``dedup`` holds."""
    found: set[tuple[str, str]] = set()
    waiting = [pair for pair in pairs if pair in tokened]
    if waiting:
        assert tokens is not None
        present = yield from call(tokens, "present_among", sorted({tokened[p] for p in waiting}))
        found.update(p for p in waiting if tokened[p] not in present)
    rest = {message_key(cid, mid): (cid, mid) for cid, mid in pairs if (cid, mid) not in tokened}
    if rest:
        found.update(rest[key] for key in (yield from call(dedup, "processed_among", rest)))
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
        callback: Callable[[SweepResult], object] | None,
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

    def flushed(self) -> Steps[None]:
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
            yield from user(self.callback, snapshot)

    def done(self) -> None:
        self._count()
        _log.info("sweep of consumer %s done: %s", self.consumer, _totals(self.result))


def _totals(result: SweepResult) -> str:
    return (
        f"segment {result.segment} of {result.segments}: {result.entities_scanned} entities "
        f"scanned, {result.ids_moved} ids moved, {result.conflicts_retried} conflicts retried, "
        f"{result.redispatched} redispatched, {result.ids_left} ids left, {result.seconds:.1f} s"
    )


def _joint_limit(entities: EntityStore, tokens: TokenStore | None) -> int:
    """Most token ids one entity's joint save may name, or 0: the token store does not
    share the entity store's server (``EntityStore._tokens_joined``)."""
    joined = getattr(entities, "_tokens_joined", None)
    if tokens is None or joined is None or not joined(tokens):
        return 0
    return entities.joint_token_limit(tokens)


def _retire_and_save(
    entities: EntityStore,
    dedup: DeduplicationStore,
    tokens: TokenStore | None,
    batch: list[tuple[Entity, list[str]]],
    joint: int,
) -> Steps[tuple[set[str], bool]]:
    """Record the ids of ``batch`` as done, remove them and save: the ids of the entities
    whose save conflicted, and whether the token writes went in the saves (``joint``
    allowing: on one server; then a conflicted entity wrote nothing), or before them
    (then its ids are recorded and its tokens deleted all the same)."""
    pairs = [(entity, mid) for entity, ids in batch for mid in ids]
    plan = retirement(pairs, dedup.endpoint) if joint else None
    folded = plan is not None and tokens is not None and foldable(plan, joint)
    if not folded:
        yield from retire(pairs, dedup, tokens, dedup.endpoint)
    for entity, mid in pairs:
        _remove(entity, mid)
    saved = [entity for entity, _ in batch]
    if plan is not None and tokens is not None and folded:
        conflicts = yield from retire_joined(entities, saved, plan, dedup, tokens, dedup.endpoint)
        return conflicts, True
    return (yield from call(entities, "save_many", saved)), False


def _flush(
    entities: EntityStore,
    dedup: DeduplicationStore,
    tokens: TokenStore | None,
    batch: list[tuple[Entity, list[str]]],
    result: SweepResult,
    max_attempts: int,
    redispatch: Dispatcher | None,
    relay: list[OutgoingMessage],
) -> Steps[None]:
    """Dispatch ``relay`` (one call), record the batch's ids as done (``add_many``, or
    their tokens deleted), then remove them; with a token store on the entity store's
    server, each entity's tokens are deleted in the save that removes its ids."""
    if redispatch is not None and relay:
        yield from _send(redispatch, relay, dedup.endpoint)
    joint = _joint_limit(entities, tokens)
    conflicted, folded = yield from _retire_and_save(entities, dedup, tokens, batch, joint)
    moved = {entity.id: ids for entity, ids in batch}
    result.ids_moved += sum(len(ids) for eid, ids in moved.items() if eid not in conflicted)
    for eid in conflicted:
        ids = moved[eid]
        for _attempt in range(max_attempts):
            result.conflicts_retried += 1
            entity = _swept((yield from call(entities, "load", eid)), dedup.endpoint)
            present = [mid for mid in ids if mid in entity.outbox]
            if not present:
                result.ids_moved += len(ids)
                break
            if folded:  # nothing of it was written: planned again from the reload
                again, _ = yield from _retire_and_save(
                    entities, dedup, tokens, [(entity, present)], joint
                )
            else:  # recorded already (its tokens deleted): only removed
                for mid in present:
                    _remove(entity, mid)
                again = yield from call(entities, "save_many", [entity])
            if not again:
                result.ids_moved += len(ids)
                break
        else:
            result.ids_left += len(ids)
