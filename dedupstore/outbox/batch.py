""":meth:`OutboxProcessor.process_batch`: the algorithm's steps for many messages at
once, in one round trip per step, and the planning of a batch in rounds when one
entity's share does not fit in its record.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from dedupstore.calls import gc_relaxed
from dedupstore.entities import (
    ENTITY_FRAME_BYTES,
    Entity,
    OutgoingMessage,
    entry_size,
    head_size,
    json_size,
)
from dedupstore.errors import ConcurrencyConflict, EntityTooLarge
from dedupstore.ids import message_key, plain_ids
from dedupstore.outbox.entries import (
    _dispatched,
    _retrying,
    _send,
    _too_large,
)
from dedupstore.outbox.handlers import _Handling
from dedupstore.outbox.letters import _SetAside, refusing
from dedupstore.outbox.messages import (
    BeforeCleanup,
    Handler,
    Message,
    Outcome,
    ProcessResult,
    _validate,
)
from dedupstore.outbox.tokened import new_call, stamped
from dedupstore.steps import Steps, call, user
from dedupstore.tokens import TokenChange


class _Batching(_Handling):
    """:class:`~dedupstore.outbox.OutboxProcessor`'s batches (built on its calls of the
    handler)."""

    def _process_batch(
        self,
        messages: Sequence[Message],
        handler: Handler,
        before_cleanup: BeforeCleanup | None = None,
    ) -> Steps[list[ProcessResult]]:
        """The steps of :meth:`OutboxProcessor.process_batch`."""
        if handler is not self._checked_handler:
            self._check_handler(handler)
        if not messages:
            return []
        if not plain_ids([m.id for m in messages] + [m.correlation_id for m in messages]):
            for message in messages:
                _validate(message)
        if self.tokens is not None:
            for message in messages:
                self._token_of(message)  # a bad token header: before any I/O
        new_call()
        with gc_relaxed(self.gc_threshold):
            results = yield from self._batch(list(messages), handler, 0, before_cleanup)
        self._report(messages, results)
        return results

    def _recorded(
        self, messages: list[Message], entities: dict[str, Entity], taken: Collection[str] = ()
    ) -> Steps[tuple[list[str], set[str]]]:
        """Each message's key, and the keys the store holds among those not in an outbox.

        ``taken``: the ids of the kept entities among ``entities``. A recorded message
        saves nothing, so nothing checks a kept entity, whose stored outbox may still
        hold its entry (a consumer recorded the id, then died before the save removing
        it): those entities are reloaded in place in ``entities`` and checked again
        (an entry found is then cleaned up).
        """
        keys = [message_key(m.correlation_id, m.id) for m in messages]
        tokens: dict[str, str] = {}
        if self.tokens is not None:
            for key, message in zip(keys, messages, strict=True):
                token = self._token_of(message)
                if token is not None:
                    tokens[key] = token
        fresh = [
            keys[i] for i, m in enumerate(messages) if m.id not in entities[m.correlation_id].outbox
        ]
        already = yield from self._asked(fresh, tokens)
        if not (already and taken):
            return keys, already
        pairs = list(zip(messages, keys, strict=True))
        stale = {m.correlation_id for m, k in pairs if k in already} & set(taken)
        if stale:
            kept = {cid: entities[cid].version for cid in stale}
            entities.update(
                self._claim_all((yield from call(self.entities, "load_many", sorted(stale))))
            )
            # An answer holds only for an entity loaded before it was asked (the id
            # reaches the store before its entry leaves the outbox): a version that moved
            # may have moved after the question, so its ids not recorded then and not in
            # its new outbox are asked again. One that did not is the kept record itself.
            moved = {cid for cid in stale if entities[cid].version != kept[cid]}
            again = [
                k
                for m, k in pairs
                if m.correlation_id in moved
                and k not in already
                and m.id not in entities[m.correlation_id].outbox
            ]
            if again:
                already |= yield from self._asked(again, tokens)
        return keys, already

    def _asked(self, keys: list[str], tokens: dict[str, str]) -> Steps[set[str]]:
        """The ``keys`` recorded as done: those of messages with a token (``tokens``:
        key -> token id) whose token is absent, the others' in the deduplication store."""
        if not keys:
            return set()
        if not tokens:
            found: set[str] = yield from call(self.dedup, "processed_among", keys)
            return found
        plain = [k for k in keys if k not in tokens]
        found = (yield from call(self.dedup, "processed_among", plain)) if plain else set()
        return found | (
            yield from self._recorded_by_token({k: tokens[k] for k in keys if k in tokens})
        )

    def _batch(
        self,
        messages: list[Message],
        handler: Handler,
        depth: int,
        before_cleanup: BeforeCleanup | None = None,
    ) -> Steps[list[ProcessResult]]:
        # the kept entities stand for loads (a stale one conflicts: retried alone below)
        entities = self._kept.take_many([m.correlation_id for m in messages])
        taken = set(entities)
        missing = [m.correlation_id for m in messages if m.correlation_id not in entities]
        if missing:
            entities.update(self._claim_all((yield from call(self.entities, "load_many", missing))))
        keys, already = yield from self._recorded(messages, entities, taken)
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
                outgoing, error = yield from self._apply(entity, message, handler, mark)
                applied[key] = index
                changed[entity.id] = entity
                done: Outcome = "processed" if error is None else "dead_lettered"
                results.append(ProcessResult(mid, done, tuple(outgoing), 1, error))
                entries[key] = (entity, mid)
        try:
            first_conflicts = yield from self._save_applied_many(changed, entries)
        except EntityTooLarge:
            if depth >= 3:  # the rounds were measured to fit: only a racing writer gets here
                raise
            return (yield from self._in_rounds(messages, handler, depth, before_cleanup))
        if before_cleanup is not None:
            return (
                yield from self._in_two_phases(
                    messages, handler, entities, first_conflicts, results, before_cleanup
                )
            )
        if first_conflicts:
            entries = {k: e for k, e in entries.items() if e[0].id not in first_conflicts}
        late_conflicts, sent = yield from self._dispatch_and_clean_up(entries)
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
                alone = yield from self._process(message, handler, set(sent))
                if applied.get(keys[index]) == index and cid not in first_conflicts:
                    first = results[index]  # its change was saved above: what it did then
                    alone = replace(alone, outcome=first.outcome, error=first.error)
                results[index] = alone
        return results

    def _save_applied_many(
        self, changed: dict[str, Entity], entries: dict[str, tuple[Entity, str]]
    ) -> Steps[set[str]]:
        """The batch's save of the entities it ``changed``; the ids that conflicted. On
        one server the outgoing tokens of the entries it applied are created in the same
        requests (:meth:`_minting`)."""
        entities = list(changed.values())
        if not self._tokens_joined:
            conflicts: set[str] = yield from call(self.entities, "save_many", entities)
            return conflicts
        limit = self._joint_tokens - 1
        made: dict[str, dict[str, str]] = {}
        for entity, mid in entries.values():
            if entity.id not in changed:
                continue
            before = entity.tokens.get(mid)
            tokens = self._minting(entity, mid)
            if not tokens:
                continue
            have = made.setdefault(entity.id, {})
            if len(have) + len(tokens) > limit and before is not None:
                entity.tokens[mid] = before  # too many for one request: _make does it
                continue
            have.update(tokens)
        changes = {eid: TokenChange(create=m) for eid, m in made.items() if m}
        if not changes:
            conflicts = yield from call(self.entities, "save_many", entities)
            return conflicts
        return (yield from self._save_folded(entities, changes))[1]

    def _in_two_phases(
        self,
        messages: list[Message],
        handler: Handler,
        entities: dict[str, Entity],
        conflicts: set[str],
        results: list[ProcessResult],
        before_cleanup: BeforeCleanup,
    ) -> Steps[list[ProcessResult]]:
        """The rest of :meth:`_batch` with ``before_cleanup``: dispatch (steps 1-4 again
        for the entities whose save conflicted), ``before_cleanup``, then the clean-up."""
        entries = self._entries(messages, entities, conflicts)
        if self.tokens is not None:
            unmade = yield from self._make(list(entries.values()))
            if unmade:
                conflicts = conflicts | unmade
                entries = {k: e for k, e in entries.items() if e[0].id not in unmade}
        sent = yield from self._dispatch(entries, set())
        _retrying(self.consumer, conflicts)
        for index, message in enumerate(messages):
            if message.correlation_id in conflicts:
                results[index] = yield from self._process(message, handler, sent, clean=False)
        final = list(results)
        yield from user(before_cleanup, messages, final)
        # the entities saved above are as saved (their versions updated); those that
        # conflicted were handled alone on fresh copies: reload only them
        if conflicts:
            loaded = yield from call(self.entities, "load_many", sorted(conflicts))
            entities = {**entities, **self._claim_all(loaded)}
        remaining = messages
        for attempt in range(1, self.max_attempts + 1):
            conflicts, _ = yield from self._dispatch_and_clean_up(
                self._entries(remaining, entities, set()), sent
            )
            remaining = [m for m in remaining if m.correlation_id in conflicts]
            if not remaining:
                return final
            if attempt < self.max_attempts:
                _retrying(self.consumer, conflicts)
            entities = self._claim_all(
                (yield from call(self.entities, "load_many", [m.correlation_id for m in remaining]))
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

    def _dispatch(self, entries: dict[str, tuple[Entity, str]], sent: set[str]) -> Steps[set[str]]:
        """Step 4: one ``dispatch`` of the pending outgoing messages of ``entries`` but
        those in ``sent``; returns ``sent`` with them."""
        unique: dict[str, OutgoingMessage] = {}
        for entity, mid in entries.values():
            entry = entity.outbox[mid]
            if entry:
                for m in stamped(entity, mid) if entity.tokens else entry:
                    if m.id not in unique and m.id not in sent:
                        unique[m.id] = m
        if unique:
            yield from _send(self.dispatcher, list(unique.values()), self.consumer)
        return sent | unique.keys()

    def _dispatch_and_clean_up(
        self, entries: dict[str, tuple[Entity, str]], sent: set[str] | None = None
    ) -> Steps[tuple[set[str], set[str]]]:
        """Steps 4-5 for the outbox ``entries`` (:meth:`_entries`), not sending ``sent``
        again.

        Returns the ids of the entities whose clean-up conflicted, and the outgoing ids
        dispatched (a retry of a conflicted entity does not send them again).
        """
        unmade = (
            (yield from self._make(list(entries.values()))) if self.tokens is not None else set()
        )
        if unmade:
            entries = {k: e for k, e in entries.items() if e[0].id not in unmade}
        sent = yield from self._dispatch(entries, set(sent or ()))
        to_save: dict[str, Entity] = {}
        retiring: list[tuple[Entity, str]] = []
        inline = self.cleanup == "inline"
        for entity, mid in entries.values():
            if inline:
                retiring.append((entity, mid))
            elif entity.outbox[mid] is not None:
                _dispatched(entity, mid)
            else:
                continue
            to_save[entity.id] = entity
        heavy = [] if inline else [e for e in to_save.values() if self._over_limit(e)]
        # The ids reach the deduplication store (their tokens are deleted) before the
        # save that removes them, or with it on one server.
        conflicts = yield from self._move_and_save(list(to_save.values()), heavy, retiring)
        return conflicts | unmade, sent

    def _in_rounds(
        self,
        messages: list[Message],
        handler: Handler,
        depth: int,
        before_cleanup: BeforeCleanup | None = None,
    ) -> Steps[list[ProcessResult]]:
        """The batch in consecutive rounds in which each entity's new entries fit."""
        rounds: dict[int, list[int]] = {}
        numbers, refusals = yield from self._rounds(messages, handler)
        if refusals:  # the messages their entity cannot hold: set aside in their round
            handler = refusing(handler, refusals)
        for index, number in enumerate(numbers):
            rounds.setdefault(number, []).append(index)
        results: list[ProcessResult | None] = [None] * len(messages)
        for number in sorted(rounds):
            indexes = rounds[number]
            done = yield from self._batch(
                [messages[i] for i in indexes], handler, depth + 1, before_cleanup
            )
            for index, result in zip(indexes, done, strict=True):
                results[index] = result
        return [r for r in results if r is not None]

    def _rounds(
        self, messages: list[Message], handler: Handler
    ) -> Steps[tuple[list[int], dict[tuple[str, str], _SetAside]]]:
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
        entities = self._claim_all(
            (yield from call(self.entities, "load_many", [m.correlation_id for m in messages]))
        )
        yield from self._clear(entities.values(), {(m.correlation_id, m.id) for m in messages})
        keys, already = yield from self._recorded(messages, entities)
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
            state, _, outgoing, _ = yield from self._run(size.state, message, handler)
            entry = entry_size(message.id, outgoing, self._mark())
            entry += self._token_room(message, outgoing)
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
                    refused = refusing(handler, {ident: refusal})
                    state, _, outgoing, _ = yield from self._run(size.state, message, refused)
                    entry = entry_size(message.id, outgoing, self._mark())
                    entry += self._token_room(message, outgoing)
                    total = size.total_with(state, entry)
                    if total <= limit:
                        refusals[ident] = refusal
                        break
                else:
                    raise _too_large(message, too_large, set_aside=True)
            size.add(message.id, state, entry)
            numbers.append(size.round)
        return numbers, refusals


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
