"""The improving-outbox algorithm's steps: :class:`OutboxProcessor`.

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

import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

from dedupstore import metrics
from dedupstore.entities import Entity, EntityStore, EntryMark, OutgoingMessage
from dedupstore.errors import ConcurrencyConflict, ConfigurationError, EntityTooLarge
from dedupstore.ids import MAX_ID_BYTES, message_key, outgoing_id, validate_name
from dedupstore.outbox.batch import _Batching
from dedupstore.outbox.cache import _EntityCache
from dedupstore.outbox.entries import (
    _dispatched,
    _foreign,
    _log,
    _remove,
    _retrying,
    _send,
    _too_large,
)
from dedupstore.outbox.handlers import _DEDUP_CALLS, _ENTITY_CALLS, _check_part
from dedupstore.outbox.letters import _letter_error, _Redriving, _SetAside, refusing
from dedupstore.outbox.messages import (
    BeforeCleanup,
    Dispatcher,
    Handler,
    Message,
    Outcome,
    ProcessResult,
    _bounds,
    _shown,
    _validate,
)
from dedupstore.outbox.tokened import (
    _Outraced,
    _Tokened,
    check_subscriptions,
    foldable,
    new_call,
    retirement,
    stamped,
    unmade,
)
from dedupstore.steps import Steps, call, run
from dedupstore.store import DeduplicationStore
from dedupstore.tokens import TokenChange, TokenStore


class _Processor(_Batching, _Redriving, _Tokened):
    """The processor's arguments and the algorithm's steps, written once without I/O
    (:mod:`dedupstore.steps`): what :class:`OutboxProcessor` drives in the calling
    thread and :class:`~dedupstore.aio.AsyncOutboxProcessor` on an event loop."""

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
        tokens: TokenStore | None = None,
        subscriptions: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        """Raises ``ConfigurationError`` (no I/O) for an ``entities`` that is not an
        ``EntityStore``, a ``dedup`` that is not a ``DeduplicationStore``, a
        ``dispatcher`` without a callable ``dispatch``, an unknown ``cleanup``, a bad
        ``dead_letters`` destination or ``run`` name, ``max_attempts``,
        ``deferred_limit`` or ``handler_attempts`` below 1, ``entity_cache``
        below 0, a ``gc_threshold`` that is neither None nor an int >= 1, a ``tokens``
        that is not a ``TokenStore``, or ``subscriptions`` without ``tokens`` or not a
        mapping of destinations to lists of endpoints."""
        if cleanup not in ("inline", "deferred"):
            raise ConfigurationError(f"cleanup must be 'inline' or 'deferred', got {cleanup!r}")
        for name, value, low in (
            ("max_attempts", max_attempts, 1),
            ("deferred_limit", deferred_limit, 1),
            ("handler_attempts", handler_attempts, 1),
            ("entity_cache", entity_cache, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigurationError(f"{name} must be an int >= {low}, got {value!r}")
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
        if tokens is not None:
            _check_part(
                "tokens",
                tokens,
                TokenStore,
                ("create", "present_among", "delete"),
                "open_token_store(url)",
            )
        elif subscriptions:
            raise ConfigurationError(
                "subscriptions need a token store: pass tokens=open_token_store(url)"
            )
        self.subscriptions = check_subscriptions(subscriptions)
        self.tokens = tokens
        self._untokened_reported = False
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
        # (the private attributes are described where _Base declares them)
        self._checked_handler = None
        self._bounds = _bounds(dispatcher)
        self._destinations = {}
        self._kept = _EntityCache(entity_cache)
        # getattr: an entity store that wraps another need not implement the joined calls
        joined = getattr(entities, "_joined", None)
        self._joined = joined is not None and bool(joined(dedup))
        token_joined = getattr(entities, "_tokens_joined", None)
        self._tokens_joined = (
            tokens is not None and token_joined is not None and bool(token_joined(tokens))
        )
        self._joint_tokens = (
            entities.joint_token_limit(tokens) if tokens is not None and self._tokens_joined else 0
        )

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

    def _process_one(self, message: Message, handler: Handler) -> Steps[ProcessResult]:
        """The steps of :meth:`OutboxProcessor.process`."""
        _validate(message)
        self._token_of(message)  # a bad token header: before any I/O
        if handler is not self._checked_handler:
            self._check_handler(handler)
        new_call()
        result = yield from self._process(message, handler, set())
        self._report([message], [result])
        return result

    def _begin_attempt(self, message: Message) -> Steps[int]:
        """The steps of :meth:`OutboxProcessor.begin_attempt`."""
        _validate(message)
        token = self._token_of(message)
        mid, cid = message.id, message.correlation_id
        key = message_key(cid, mid)
        for _attempt in range(self.max_attempts):
            self._kept.take(cid)  # a fresh load: the count must be the stored one
            entity = self._claim((yield from call(self.entities, "load", cid)))
            if mid in entity.outbox or (
                (yield from call(self.dedup, "has_been_processed", key))
                if token is None
                else bool((yield from self._recorded_by_token({key: token})))
            ):
                return 0
            runs = entity.attempts.get(mid, 0) + 1
            entity.attempts[mid] = runs
            try:
                yield from call(self.entities, "save", entity)
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
    ) -> Steps[ProcessResult]:
        """:meth:`process`, not sending again the outgoing ids in ``dispatched``
        (which gets those it sends); without ``clean``, steps 1-4 only."""
        mid, cid = message.id, message.correlation_id
        key = message_key(cid, mid)
        token = self._token_of(message)
        joined = self._joined and token is None  # (a token is read from its own store)
        # stores on one server: the load reads the token in its request, and the save
        # of a kept entity (no load) checks it itself
        folded = token is not None and self._tokens_joined
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
                    if joined:
                        entity, recorded = yield from call(
                            self.entities, "_load_checked", cid, self.dedup, key
                        )
                    elif folded and token is not None:
                        entity, present = yield from call(
                            self.entities, "_load_tokened", cid, self._token_store(), token
                        )
                        recorded = not present
                        if recorded:
                            metrics.count_tokens(self.consumer, "missing", 1)
                    else:
                        entity = yield from call(self.entities, "load", cid)
                    self._claim(entity)
                found = mid in entity.outbox
                if not found:
                    # (a kept entity of joined stores: the save itself checks the id)
                    checked = joined and recorded is None
                    if not checked and not (folded and taken) and recorded is None:
                        recorded = (
                            (yield from call(self.dedup, "has_been_processed", key))
                            if token is None
                            else bool((yield from self._recorded_by_token({key: token})))
                        )
                    if not recorded:
                        outgoing, failed = yield from self._apply(entity, message, run_handler)
                        try:
                            saved = yield from self._save_applied(
                                entity, message, key if checked else None, token if folded else None
                            )
                        except _SetAside as refusal:
                            # set it aside instead, from a fresh load (not a conflict:
                            # at most twice, the letter whole then bounded)
                            run_handler = refusing(handler, {(cid, mid): refusal})
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
                        entity = self._claim((yield from call(self.entities, "load", cid)))
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
                    if (yield from self._make([(entity, mid)], alone=True)):
                        raise ConcurrencyConflict(f"entity {cid!r:.80} changed")
                    yield from _send(self.dispatcher, stamped(entity, mid), self.consumer)
                    dispatched.update(m.id for m in outgoing)
                if clean:
                    yield from self._clean_up(entity, mid)
                    self._kept.keep(entity)
                return ProcessResult(mid, outcome, tuple(outgoing or ()), attempt, error)
            except _Outraced:
                raise
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

    def _save_applied(
        self, entity: Entity, message: Message, checked: str | None, required: str | None = None
    ) -> Steps[bool | None]:
        """Save the entity holding ``message``'s new entry (step 2c); with ``checked``
        (the message's key), unless the deduplication store holds it, and with
        ``required`` (its incoming token; stores on one server), unless that token is
        gone: None then. On one server the entry's outgoing tokens are created in the
        same request (:meth:`_minting`).

        When it does not fit, the entity's other entries are cleared (:meth:`_clear`,
        on a fresh load) and False says: start again; without others, ``EntityTooLarge``
        names the message, or (``dead_letters``) ``_SetAside`` says how to set it aside.
        """
        try:
            # (a save checked against the deduplication store mints the unfolded way)
            made = self._minting(entity, message.id) if self._tokens_joined and not checked else {}
            if checked is None and (required is not None or made):
                missing, conflicts = yield from self._save_folded(
                    [entity], {entity.id: TokenChange(required, made)}
                )
                if missing:
                    metrics.count_tokens(self.consumer, "missing", 1)
                    return None
                if conflicts:
                    raise _conflict(entity)
            elif checked is None:
                yield from call(self.entities, "save", entity)
            elif (yield from call(self.entities, "_save_checked", entity, self.dedup, checked)):
                return None
            return True
        except EntityTooLarge as exc:
            if checked is not None and (yield from call(self.dedup, "has_been_processed", checked)):
                return None
            key = message_key(entity.id, message.id)
            if required is not None and (yield from self._recorded_by_token({key: required})):
                return None
            fresh = self._claim((yield from call(self.entities, "load", entity.id)))
            if not fresh.outbox:
                too_large = _too_large(message, exc)
                if self.dead_letters is None:
                    raise too_large from None
                refusals = self._refusals(message, entity.outbox.get(message.id), too_large)
                if not refusals:
                    raise _too_large(message, too_large, set_aside=True) from None
                raise refusals[0] from None
            if not (yield from self._clear([fresh], set())):
                raise ConcurrencyConflict(f"entity {entity.id!r:.80} changed") from None
            return False

    def _apply(
        self, entity: Entity, message: Message, handler: Handler, mark: EntryMark | None = None
    ) -> Steps[tuple[list[OutgoingMessage], str | None]]:
        """Steps 2b-2c in memory: run the handler, record its outputs in the outbox,
        marked with ``mark`` (one per batch; a new one by default).

        Returns the outgoing messages and, for a dead-lettered message, the error.
        """
        state, text, outgoing, error = yield from self._run(
            entity.state, message, handler, entity._source()
        )
        if text is not None:
            entity._set_state(state, text)
        else:  # dead-lettered: the state as it was (decoded again if the handler had it)
            entity.state = state
        entity.outbox[message.id] = outgoing
        entity.marks[message.id] = self._mark() if mark is None else mark
        if self.tokens is not None:
            self._register(entity, message, error is not None)
        if entity.attempts:  # applied (or dead-lettered): its count of runs is done
            entity.attempts.pop(message.id, None)
        return outgoing, error

    def _mark(self) -> EntryMark:
        """The mark of an entry written now."""
        return EntryMark(int(time.time() * 1000), self.run)

    def _clean_up(self, entity: Entity, mid: str) -> Steps[None]:
        """Step 5 for one message on a loaded entity (saves it)."""
        if self.cleanup == "inline":
            key = message_key(entity.id, mid)
            plan = retirement([(entity, mid)], self.consumer) if mid in entity.tokens else None
            if plan is not None and plan.changes:
                if self._tokens_joined and foldable(plan, self._joint_tokens):
                    # one atomic request: the tokens go with the entry
                    _remove(entity, mid)
                    if (yield from self._save_retired([entity], plan)):
                        raise _conflict(entity)
                    return
                # token mode: its tokens deleted, then the save
                yield from self._retire([(entity, mid)])
                _remove(entity, mid)
                yield from call(self.entities, "save", entity)
                return
            _remove(entity, mid)
            if self._joined:  # one atomic request, the id recorded first
                yield from call(self.entities, "_save_recording", entity, self.dedup, key)
            else:
                yield from call(self.dedup, "add", key)
                yield from call(self.entities, "save", entity)
        elif entity.outbox[mid] is not None:
            _dispatched(entity, mid)
            if self._over_limit(entity):
                if (yield from self._move_and_save([entity], [entity])):
                    raise _conflict(entity)
                return
            yield from call(self.entities, "save", entity)

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

    def _move_and_save(
        self,
        to_save: Sequence[Entity],
        moving: Sequence[Entity],
        retiring: Sequence[tuple[Entity, str]] = (),
    ) -> Steps[set[str]]:
        """Record the dispatched ids of ``moving`` and the entries ``retiring`` as done
        (:meth:`_retire`), remove them from the outboxes, then save ``to_save`` (which
        holds the entities of both); returns the ids whose save conflicted. The inline
        clean-up, and that of the entries a deferred one left. On one server the token
        writes go in the saves (:meth:`_save_retired`)."""
        pairs = [*retiring, *((e, mid) for e in moving for mid in e.dispatched)]
        plan = retirement(pairs, self.consumer) if self._tokens_joined and pairs else None
        if plan is not None and foldable(plan, self._joint_tokens):
            for entity, mid in pairs:
                _remove(entity, mid)
            return (yield from self._save_retired(to_save, plan))
        if pairs:
            yield from self._retire(pairs)
        for entity, mid in pairs:
            _remove(entity, mid)
        return (yield from call(self.entities, "save_many", to_save)) if to_save else set()

    def _clear(self, entities: Iterable[Entity], keep: set[tuple[str, str]]) -> Steps[set[str]]:
        """Empty the outboxes of ``entities`` but for the entries of ``keep`` (and save).

        Entries still pending for other messages are dispatched again (at least once,
        same ids), then every entry but ``keep``'s moves to the deduplication store
        before the save that removes it. Returns the ids of the entities saved.
        """
        relay: list[OutgoingMessage] = []
        cleared: list[Entity] = []
        entities = list(entities)
        others = [(e, m) for e in entities for m in e.pending if (e.id, m) not in keep]
        unmade_left = yield from self._make([(e, m) for e, m in others if unmade(e, m)])
        for entity, mid in others:
            if entity.id not in unmade_left:
                relay.extend(stamped(entity, mid))
                _dispatched(entity, mid)
        for entity in entities:
            if entity.dispatched:
                cleared.append(entity)
        if relay:
            yield from _send(self.dispatcher, relay, self.consumer)
        if not cleared:
            return set()
        conflicts = yield from self._move_and_save(cleared, cleared)
        return {e.id for e in cleared} - conflicts

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


class OutboxProcessor(_Processor):
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
    (an int, e.g. :data:`~dedupstore.calls.GC_BATCH_THRESHOLD`) raises CPython's
    young-generation GC threshold to it for the whole process while :meth:`process_batch`
    runs (:func:`~dedupstore.calls.gc_relaxed`; put back when the last batch ends): a
    batch's objects would otherwise set off full collections, each walking every object
    of the process, which in a process holding much data cost more than the batch.

    Every outbox entry it writes is marked with the time it was written (what
    :func:`~dedupstore.stats.outbox_backlog` reports as the oldest pending entry) and
    with ``run``, a name for one run of a job over its input: with a ``run``, a
    message this run applied (or dead-lettered) in an earlier call whose clean-up did
    not finish (a crash, a retried task) comes out ``processed`` (or
    ``dead_lettered``) again, not ``redispatched``: outcomes say what the run did,
    whichever call of it got through.

    Token mode (``tokens``, a :class:`~dedupstore.tokens.TokenStore`): a message that
    carries a token (:data:`~dedupstore.tokens.TOKEN_HEADER`) is a duplicate when its
    token is absent, and its token is deleted once its outputs are dispatched; one
    without a token goes through the deduplication store as in retention mode (a
    hybrid endpoint, in the same batch). Each outgoing message to a destination of
    ``subscriptions`` (destination -> receiving endpoints) gets one token per
    endpoint, created before it is dispatched and never again after. The guide's
    "Token mode" page says how, and when to choose it.
    """

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
        return run(self._process_one(message, handler))

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
        return run(self._begin_attempt(message))

    def process_batch(
        self,
        messages: Sequence[Message],
        handler: Handler,
        *,
        before_cleanup: BeforeCleanup | None = None,
    ) -> list[ProcessResult]:
        """Run the algorithm for many messages at once; one result per message, in order.

        Round trips per batch, not per message: ``load_many``, one ``processed_among``,
        ``save_many``, one ``dispatch``, then the clean-up (``add_many`` + ``save_many``
        inline, ``save_many`` deferred); a batch that finds messages of entities it kept
        recorded loads those entities too (and may ask ``processed_among`` once more).
        Each entity's messages are handled in their order in ``messages``. Entities whose
        save conflicts are retried alone with :meth:`process`. When one entity's share of
        the batch does not fit in its record, the batch runs in consecutive rounds that
        each fit. The same message (same entity and id) twice in a batch is applied once:
        the first copy says ``processed``, the others ``duplicate``. Same guarantees and
        errors as :meth:`process` for every message: with ``dead_letters`` a message too
        large to process is ``dead_lettered`` and the others go on; without, the batch
        raises ``EntityTooLarge``/``MessageTooLarge`` for the first such message
        (``message_id``, ``correlation_id``) with nothing of it saved.

        ``before_cleanup(messages, results)`` is called once the outcomes of ``messages``
        (all of them, or one round's) are final and their outgoing messages dispatched,
        before any of their entries is cleaned up (step 5): with a ``run``, whatever it
        records of them (and makes durable) before it returns stays true when the call is
        cut short and run again. Should it raise, nothing is cleaned up and the error
        propagates (a later call cleans up).
        """
        return run(self._process_batch(messages, handler, before_cleanup))

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
        a message: nothing to redrive), a letter of another consumer (naming both) or
        a letter that keeps a redrive token given to a processor without ``tokens``,
        ``DeadLetterIncomplete`` for a bounded letter (the original's body or headers
        replaced by their size and digest), and what :meth:`process` raises.
        """
        return run(self._redrive(letter, handler))


def _conflict(entity: Entity) -> ConcurrencyConflict:
    """The conflict of a save of ``entity`` that another writer beat."""
    return ConcurrencyConflict(
        f"entity {entity.id!r:.80} was saved by someone else since it was loaded"
    )
