"""Token mode: the processor's steps for messages that carry a token (see
:mod:`dedupstore.tokens`), beside retention mode's for those that do not (a hybrid
endpoint: each message goes the way its headers say).

For an incoming message with a token ``T`` (step numbers as in ``processor``):

2. after the load, a message not in the outbox whose token is absent is a duplicate
   (a token is deleted only once the message's outputs are dispatched);
   otherwise the handler runs, and the save of the new entry *registers* a fresh
   nonce for its outgoing tokens (one per outgoing message and subscribed
   endpoint) before any of them exists (W1);
3. before the dispatch, the tokens of the last nonce this call registered are
   created (put-if-absent), then a save marks that nonce ``made`` (W2b): from then on
   the entry's messages carry it and its tokens are never created again. A pending
   entry whose last nonce is not this call's (a consumer died after W1) gets a new
   nonce registered first (W2a): only the call that registered a nonce creates its
   tokens, so a stalled copy can never bring back a token its receiver consumed. A
   call registers at most one nonce per entry: one whose nonce another copy replaced
   gives way (``ConcurrencyConflict``: redeliver it) instead of replacing it back, so
   two copies never take turns forever;
4. the dispatch stamps :data:`~dedupstore.tokens.TOKEN_HEADER` on every subscribed
   message;
5. the clean-up deletes ``T`` and the tokens of every nonce registered but not made
   (garbage of attempts that failed), then removes the entry. A dead-lettered
   message's ``T`` is exchanged for the token of its redrive (the letter's id, the
   same nonce), created first: a copy of the original is then a duplicate, and the
   redrive (or its discarding) consumes the redrive's token.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import NamedTuple

from dedupstore import canonical, metrics
from dedupstore.entities import Entity, EntityStore, EntryTokens, OutgoingMessage
from dedupstore.errors import ConcurrencyConflict, ConfigurationError
from dedupstore.ids import message_key, validate_message_id
from dedupstore.outbox._base import _Base
from dedupstore.outbox.messages import Message
from dedupstore.steps import Steps, call
from dedupstore.store import DeduplicationStore
from dedupstore.tokens import (
    TOKEN_HEADER,
    TokenChange,
    TokenStore,
    new_nonce,
    token_id,
    token_of,
)


def minted(entity: Entity, mid: str, nonce: str) -> dict[str, str]:
    """Token id -> receiving endpoint, of the tokens of ``nonce`` for the pending entry
    ``mid`` of ``entity``."""
    tokens = entity.tokens[mid]
    made: dict[str, str] = {}
    for message in entity.outbox[mid] or ():
        for endpoint in tokens.to.get(message.destination, ()):
            made[token_id(message.id, endpoint, nonce)] = endpoint
    return made


def garbage(entity: Entity, mid: str) -> list[str]:
    """The ids of the tokens of the entry ``mid`` that no message carries: those of
    nonces registered but not made (and the ``drop`` of a dispatched entry)."""
    tokens = entity.tokens.get(mid)
    if tokens is None:
        return []
    ids = list(tokens.drop)
    if entity.outbox.get(mid) is not None:
        for nonce in tokens.registered:
            if nonce != tokens.made:
                ids.extend(minted(entity, mid, nonce))
    return ids


def retired(entity: Entity, mid: str) -> EntryTokens | None:
    """The tokens of the entry ``mid`` as they stay once it is marked dispatched: the
    incoming token and the garbage ids (the messages that named them are gone)."""
    tokens = entity.tokens.get(mid)
    if tokens is None:
        return None
    return EntryTokens(tokens.incoming, drop=tuple(garbage(entity, mid)), letter=tokens.letter)


def stamped(entity: Entity, mid: str) -> list[OutgoingMessage]:
    """The pending entry ``mid``'s messages as dispatched: those of a subscribed
    destination carry the made nonce in :data:`~dedupstore.tokens.TOKEN_HEADER`."""
    entry = entity.outbox[mid] or []
    tokens = entity.tokens.get(mid)
    if tokens is None or tokens.made is None:
        return entry
    made, to = tokens.made, tokens.to
    return [
        OutgoingMessage(m.id, m.destination, m.body, {**m.headers, TOKEN_HEADER: made})
        if m.destination in to
        else m
        for m in entry
    ]


def unmade(entity: Entity, mid: str) -> bool:
    """Whether the pending entry ``mid`` has outgoing tokens not made yet (it cannot be
    dispatched before they are)."""
    tokens = entity.tokens.get(mid)
    return (
        tokens is not None
        and tokens.made is None
        and bool(tokens.to)
        and entity.outbox.get(mid) is not None
    )


def check_subscriptions(subscriptions: object) -> dict[str, tuple[str, ...]]:
    """``subscriptions`` (destination -> receiving endpoints) checked and copied, or
    ``ConfigurationError`` naming what is wrong (before any I/O)."""
    if subscriptions is None:
        return {}
    if not isinstance(subscriptions, Mapping):
        raise ConfigurationError(
            "subscriptions must map each destination to its receiving endpoints, got "
            f"{type(subscriptions).__name__}"
        )
    checked: dict[str, tuple[str, ...]] = {}
    for destination, endpoints in subscriptions.items():
        validate_message_id(destination, "subscribed destination")
        if isinstance(endpoints, str) or not isinstance(endpoints, Iterable):
            raise ConfigurationError(
                f"subscriptions[{destination!r:.80}] must be a list of receiving endpoints, "
                f"got {endpoints!r:.80}"
            )
        listed = tuple(dict.fromkeys(validate_message_id(e, "endpoint") for e in endpoints))
        if listed:
            checked[destination] = listed
    return checked


class Retirement(NamedTuple):
    """What recording entries as done writes (:func:`retirement`)."""

    #: the message keys of the entries that came without a token (to the dedup store)
    keys: list[str]
    #: per entity id, the token writes: its redrive tokens created, then its incoming
    #: and garbage tokens deleted
    changes: dict[str, TokenChange]
    #: per entity id, how many incoming tokens it consumes
    consumed: dict[str, int]


def retirement(pairs: Sequence[tuple[Entity, str]], consumer: str) -> Retirement:
    """What recording ``pairs`` (entity, incoming message id) as done writes: the
    keys of those that came without a token, and per entity its token writes (a dead
    letter's redrive token created; the incoming and garbage tokens deleted)."""
    keys: list[str] = []
    create: dict[str, dict[str, str]] = {}
    delete: dict[str, list[str]] = {}
    consumed: dict[str, int] = {}
    for entity, mid in pairs:
        entry = entity.tokens.get(mid)
        if entry is None or entry.incoming is None:
            keys.append(message_key(entity.id, mid))
        else:
            delete.setdefault(entity.id, []).append(entry.incoming)
            consumed[entity.id] = consumed.get(entity.id, 0) + 1
            if entry.letter is not None:
                create.setdefault(entity.id, {})[entry.letter] = consumer
        if entry is not None:
            delete.setdefault(entity.id, []).extend(garbage(entity, mid))
    changes = {
        eid: TokenChange(create=create.get(eid, {}), delete=tuple(delete.get(eid, ())))
        for eid in {*create, *delete}
        if create.get(eid) or delete.get(eid)
    }
    return Retirement(keys, changes, consumed)


def foldable(plan: Retirement, limit: int) -> bool:
    """Whether ``plan`` has token writes and each entity's fit in one joint save of at
    most ``limit`` token ids (else :func:`retire` makes them on their own)."""
    return bool(plan.changes) and all(c.size <= limit for c in plan.changes.values())


def retire_joined(
    entities: EntityStore,
    to_save: Sequence[Entity],
    plan: Retirement,
    dedup: DeduplicationStore,
    tokens: TokenStore,
    consumer: str,
) -> Steps[set[str]]:
    """Stores on one server: the writes of ``plan`` (:func:`retirement` of entries the
    caller then removed from ``to_save``): the keys of the entries without a token reach
    the deduplication store first, then each entity is saved with its token writes in
    its save. Returns the ids whose save conflicted (none of their tokens written: the
    retry plans them again). Counts the tokens consumed."""
    if plan.keys:
        yield from call(dedup, "add_many", plan.keys)
    conflicts: set[str]
    _, conflicts = yield from call(entities, "_save_tokened", to_save, tokens, plan.changes)
    consumed = sum(n for eid, n in plan.consumed.items() if eid not in conflicts)
    if consumed:
        metrics.count_tokens(consumer, "consumed", consumed)
    return conflicts


def retire(
    pairs: Sequence[tuple[Entity, str]],
    dedup: DeduplicationStore,
    tokens: TokenStore | None,
    consumer: str,
) -> Steps[None]:
    """Record ``pairs`` (entity, incoming message id) as done: create the redrive
    tokens of dead letters, delete the incoming tokens and the garbage tokens, then
    add the keys of those that came without a token to ``dedup``.
    ``ConfigurationError`` before any write when an entry has tokens and ``tokens``
    is None."""
    plan = retirement(pairs, consumer)
    if plan.changes:
        if tokens is None:
            raise _no_token_store(consumer)
        redrives = {t: e for change in plan.changes.values() for t, e in change.create.items()}
        if redrives:  # before the incoming tokens go: a crash between leaves both
            yield from call(tokens, "create", redrives)
        yield from call(
            tokens, "delete", [t for change in plan.changes.values() for t in change.delete]
        )
        metrics.count_tokens(consumer, "consumed", sum(plan.consumed.values()))
    if plan.keys:
        yield from call(dedup, "add_many", plan.keys)


#: The nonces the current call of a processor registered (only the registrant of a
#: nonce creates its tokens): one set per call, in the thread's or the task's context.
_NONCES: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar(
    "dedupstore_nonces", default=None
)


def new_call() -> None:
    """A public call of a processor begins: no nonce is its yet."""
    _NONCES.set(set())


def _no_token_store(consumer: str) -> ConfigurationError:
    return ConfigurationError(
        f"consumer {consumer!r:.80}: an entity holds outbox entries written in token mode, "
        "but no token store was given (tokens=...); nothing of them was written. Give the "
        "token store the entries were written with"
    )


class _Outraced(ConcurrencyConflict):
    """Another copy of the message registered a nonce after this call's: this call
    gives way (the message is redelivered) instead of taking turns with it."""


class _Tokened(_Base):
    """:class:`~dedupstore.outbox.OutboxProcessor`'s token mode."""

    def _token_of(self, message: Message) -> str | None:
        """The incoming token of ``message`` for this consumer (None: retention mode).

        Without a token store, a message carrying a token goes through retention mode;
        the first such message is logged (WARNING, once per processor): its sender
        listed this endpoint, so its token stays in the sender's token store."""
        headers = message.headers
        if not headers or TOKEN_HEADER not in headers:
            return None
        if self.tokens is None:
            if not self._untokened_reported:
                self._untokened_reported = True
                logging.getLogger("dedupstore.outbox").warning(
                    "consumer %s: message %.80r carries a %s header but this processor has "
                    "no token store: processed in retention mode, its token left in the "
                    "sender's token store (give tokens= / --tokens; reported once)",
                    self.consumer,
                    message.id,
                    TOKEN_HEADER,
                )
            return None
        return token_of(message.id, headers, self.consumer)  # (a redrive: the letter's id)

    def _register(self, entity: Entity, message: Message, letter: bool) -> None:
        """Record in ``entity`` (in memory) the tokens of ``message``'s new entry: its
        incoming token, and a fresh nonce for the outgoing tokens it needs."""
        if self.tokens is None:
            return
        mid = message.id
        incoming = self._token_of(message)
        subscribed = self.subscriptions
        to = {
            m.destination: subscribed[m.destination]
            for m in entity.outbox[mid] or ()
            if m.destination in subscribed
        }
        if incoming is None and not to:
            entity.tokens.pop(mid, None)
            return
        redrive = None
        if letter and incoming is not None:  # the letter is the entry's one message
            (dead,) = entity.outbox[mid] or []
            redrive = token_id(dead.id, self.consumer, message.headers[TOKEN_HEADER])
        entity.tokens[mid] = EntryTokens(
            incoming, to, (self._nonce(),) if to else (), None, (), redrive
        )

    def _token_room(self, message: Message, outgoing: Sequence[OutgoingMessage]) -> int:
        """Bytes the tokens of ``message``'s entry may take in its entity (as made,
        with room for two more registrations, or as a dead letter's): what a batch
        plans with, so that the saves that register and make them still fit."""
        if self.tokens is None:
            return 0
        incoming = self._token_of(message)
        to = {
            m.destination: self.subscriptions[m.destination]
            for m in outgoing
            if m.destination in self.subscriptions
        }
        if incoming is None and not to:
            return 0
        nonce = "n" * 16
        widest = EntryTokens(
            incoming, to, (nonce,) * 3 if to else (), nonce if to else None, (), incoming
        )
        record = canonical.dumps({message.id: widest.to_json()})
        return len(record.encode("utf-8")) + len(',"tokens":')

    def _nonce(self) -> str:
        """A fresh nonce, remembered as this call's (only its registrant creates a
        nonce's tokens)."""
        nonce = new_nonce()
        self._my_nonces().add(nonce)
        return nonce

    def _my_nonces(self) -> set[str]:
        """The nonces the current call registered (per thread, per task)."""
        nonces = _NONCES.get()
        if nonces is None:
            nonces = set()
            _NONCES.set(nonces)
        return nonces

    def _recorded_by_token(self, tokens: Mapping[str, str]) -> Steps[set[str]]:
        """Of ``tokens`` (message key -> incoming token id), the keys whose token is
        absent: duplicates."""
        if not tokens:
            return set()
        store = self._token_store()
        present = yield from call(store, "present_among", list(dict.fromkeys(tokens.values())))
        missing = {key for key, token in tokens.items() if token not in present}
        if missing:
            metrics.count_tokens(self.consumer, "missing", len(missing))
        return missing

    def _make(self, pairs: Sequence[tuple[Entity, str]], alone: bool = False) -> Steps[set[str]]:
        """Make the outgoing tokens of the pending entries ``pairs`` that need them
        (steps W2a, W3, W2b above, each one request for all); returns the ids of the
        entities whose saves conflicted, or that this call registered a nonce for
        that another copy replaced since (their entries are not made: retry them;
        ``alone``, for one message: ``_Outraced`` for the second kind)."""
        todo = [(e, mid) for e, mid in pairs if unmade(e, mid)]
        if not todo:
            return set()
        if self._tokens_joined:
            folded = yield from self._make_folded(todo)
            if folded is not None:
                return folded
        store = self._token_store()
        mine = self._my_nonces()
        register: dict[str, Entity] = {}
        outraced: set[str] = set()
        for entity, mid in todo:
            tokens = entity.tokens[mid]
            if tokens.registered and tokens.registered[-1] in mine:
                continue
            if mine.intersection(tokens.registered):
                if alone:
                    raise _Outraced(
                        f"message {mid!r:.80} of entity {entity.id!r:.80}: another copy is "
                        "making the tokens of its outgoing messages; redeliver it"
                    )
                outraced.add(entity.id)
                continue
            entity.tokens[mid] = replace(tokens, registered=(*tokens.registered, self._nonce()))
            register[entity.id] = entity
        todo = [(e, mid) for e, mid in todo if e.id not in outraced]
        conflicts = (
            (yield from call(self.entities, "save_many", list(register.values())))
            if register
            else set()
        )
        conflicts |= outraced
        live = [(e, mid) for e, mid in todo if e.id not in conflicts]
        made: dict[str, str] = {}
        for entity, mid in live:
            made.update(minted(entity, mid, entity.tokens[mid].registered[-1]))
        if made:
            yield from call(store, "create", made)
        marked: dict[str, Entity] = {}
        for entity, mid in live:
            tokens = entity.tokens[mid]
            entity.tokens[mid] = replace(tokens, made=tokens.registered[-1])
            marked[entity.id] = entity
        late: set[str] = yield from call(self.entities, "save_many", list(marked.values()))
        if late:
            # Nobody else registered these nonces and no message carries them: they
            # can never be made now, so no token of theirs is left behind.
            lost = {
                t
                for e, mid in live
                if e.id in late
                for t in minted(e, mid, e.tokens[mid].made or "")
            }
            yield from call(store, "delete", lost)
            made = {t: p for t, p in made.items() if t not in lost}
        if made:
            metrics.count_tokens(self.consumer, "created", len(made))
        return conflicts | late

    # ------------------------------------------------------------------ folded (one server)

    def _minting(self, entity: Entity, mid: str) -> dict[str, str]:
        """Stores on one server (``_tokens_joined``), before the save of the entry
        ``mid`` this call applied: its nonce marked made in memory, and the tokens to
        create in that save (token id -> endpoint), so registering, creating and marking
        made are one atomic request and "registered but not made" never exists. Empty
        (nothing marked) when the entry has nothing to make, its nonce is not this
        call's, or its tokens are too many for one request (then :meth:`_make` does it)."""
        if not unmade(entity, mid):
            return {}
        tokens = entity.tokens[mid]
        if not tokens.registered or tokens.registered[-1] not in self._my_nonces():
            return {}
        nonce = tokens.registered[-1]
        made = minted(entity, mid, nonce)
        if len(made) + 1 > self._joint_tokens:
            return {}
        entity.tokens[mid] = replace(tokens, made=nonce)
        return made

    def _make_folded(self, todo: Sequence[tuple[Entity, str]]) -> Steps[set[str] | None]:
        """Stores on one server: :meth:`_make` of the unmade entries ``todo`` in one joint
        save: each entry's nonce (this call's last one, else a fresh one) registered and
        marked made, its tokens created, atomically; a save that conflicts creates nothing
        (the caller retries from a fresh load, which finds the entry made or not). Returns
        the ids whose save conflicted; None (nothing done) when an entity's tokens are too
        many for one request."""
        mine = self._my_nonces()
        made: dict[str, dict[str, str]] = {}
        marked: dict[str, Entity] = {}
        plan: list[tuple[Entity, str, str]] = []
        for entity, mid in todo:
            tokens = entity.tokens[mid]
            last = tokens.registered[-1] if tokens.registered else None
            nonce = last if last is not None and last in mine else new_nonce()
            tokens_of = minted(entity, mid, nonce)
            have = made.setdefault(entity.id, {})
            if len(have) + len(tokens_of) > self._joint_tokens:
                return None
            have.update(tokens_of)
            plan.append((entity, mid, nonce))
        for entity, mid, nonce in plan:
            tokens = entity.tokens[mid]
            registered = (
                tokens.registered
                if nonce in tokens.registered
                else (
                    *tokens.registered,
                    nonce,
                )
            )
            entity.tokens[mid] = replace(tokens, registered=registered, made=nonce)
            marked[entity.id] = entity
        changes = {eid: TokenChange(create=tokens) for eid, tokens in made.items() if tokens}
        return (yield from self._save_folded(list(marked.values()), changes))[1]

    def _save_folded(
        self, entities: Sequence[Entity], changes: Mapping[str, TokenChange]
    ) -> Steps[tuple[set[str], set[str]]]:
        """``EntityStore._save_tokened`` of ``entities`` with their token ``changes``;
        ``(missing, conflicts)`` as it returns them. Counts the tokens created."""
        store = self._token_store()
        missing, conflicts = yield from call(
            self.entities, "_save_tokened", entities, store, changes
        )
        created = sum(
            len(change.create)
            for eid, change in changes.items()
            if eid not in missing and eid not in conflicts
        )
        if created:
            metrics.count_tokens(self.consumer, "created", created)
        return missing, conflicts

    def _save_retired(self, entities: Sequence[Entity], plan: Retirement) -> Steps[set[str]]:
        """Stores on one server: :func:`retire_joined` of ``plan`` with ``entities``."""
        store = self._token_store()
        return (
            yield from retire_joined(
                self.entities, entities, plan, self.dedup, store, self.consumer
            )
        )

    def _retire(self, pairs: Sequence[tuple[Entity, str]]) -> Steps[None]:
        """Record ``pairs`` (entity, incoming message id; entries about to leave their
        outboxes) as done (:func:`retire`), before the save that removes them."""
        yield from retire(pairs, self.dedup, self.tokens, self.consumer)

    def _token_store(self) -> TokenStore:
        """The token store, or ``ConfigurationError``: an entity written in token mode
        met by a processor without one."""
        if self.tokens is None:
            raise _no_token_store(self.consumer)
        return self.tokens
