"""Token mode of the outbox processor (issue 38), on every backend.

Service A takes input without tokens (the boundary: retention mode) and sends to
``b-in``, to which endpoint B (and for fan-out C) subscribes; B and C run in token
mode. The tests play the broker: each outgoing message becomes the receiver's
message with the same id and headers.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from dedupstore import canonical
from dedupstore.dead_letters import DeadLetterQueue, ReadMessage, redrive_token
from dedupstore.entities import Entity, EntityStore, OutgoingMessage
from dedupstore.errors import ConfigurationError, InvalidMessageId
from dedupstore.ids import message_key
from dedupstore.outbox import (
    InMemoryDispatcher,
    Message,
    OutboxProcessor,
    Send,
    applied_among,
    recorded_among,
    sweep,
)
from dedupstore.steps import run
from dedupstore.store import DeduplicationStore
from dedupstore.tokens import TOKEN_HEADER, TokenStore, new_nonce, token_id
from tests.outbox_backends import OutboxBackend, backend_params

pytestmark = pytest.mark.parametrize("outbox_backend", backend_params(), indirect=True)


class Crash(Exception):
    """Injected: the process dies here."""


class Crashing:
    """An entity store that raises :class:`Crash` instead of its ``n``-th save (counting
    ``save`` and ``save_many``, and with ``folded`` the joint saves of a token store on
    its server), everything else delegated."""

    def __init__(self, store: EntityStore, n: int, folded: bool = False) -> None:
        self.store, self.n, self.folded = store, n, folded
        self.max_entity_bytes = store.max_entity_bytes

    def _tokens_joined(self, tokens: TokenStore) -> bool:
        return self.folded and self.store._tokens_joined(tokens)

    def joint_token_limit(self, tokens: TokenStore) -> int:
        return self.store.joint_token_limit(tokens)

    def _load_tokened(self, entity_id: str, tokens: TokenStore, token: str) -> Any:
        return self.store._load_tokened(entity_id, tokens, token)

    def _save_tokened(self, entities: Sequence[Entity], tokens: TokenStore, changes: Any) -> Any:
        self._count()
        return self.store._save_tokened(entities, tokens, changes)

    def _count(self) -> None:
        self.n -= 1
        if self.n == 0:
            raise Crash

    def load(self, entity_id: str) -> Entity:
        return self.store.load(entity_id)

    def load_many(self, ids: Sequence[str]) -> dict[str, Entity]:
        return self.store.load_many(ids)

    def save(self, entity: Entity) -> Entity:
        self._count()
        return self.store.save(entity)

    def save_many(self, entities: Sequence[Entity]) -> set[str]:
        self._count()
        return self.store.save_many(entities)


def a_handler(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
    """A: counts its input and forwards each to B (and one log line nobody subscribes to)."""
    seen = [*state.get("seen", []), message.id]
    return {"seen": seen}, [
        Send("b-in", {"order": message.correlation_id, "n": message.body}),
        Send("log", {"n": message.body}),
    ]


def b_handler(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
    """B: sums what it received and records each message id it applied."""
    applied = [*state.get("applied", []), message.id]
    return {"applied": applied, "sum": state.get("sum", 0) + message.body["n"]}, []


class Flaky:
    """B's handler, failing until ``fixed`` (a dead letter, then its redrive)."""

    fixed = False

    def __call__(self, state: dict[str, Any], m: Message) -> tuple[dict[str, Any], list[Send]]:
        if not self.fixed:
            raise ValueError("not yet")
        return b_handler(state, m)


def delivered(out: OutgoingMessage, receiver: str = "B") -> Message:
    """What ``receiver`` gets from the broker for ``out`` (its entity: ``<r>-<order>``)."""
    return Message(out.id, f"{receiver.lower()}-{out.body['order']}", out.body, dict(out.headers))


class Chain:
    """A (boundary, retention) -> B (and C) in token mode, on one backend."""

    def __init__(self, backend: OutboxBackend, receivers: Sequence[str] = ("B",)) -> None:
        tag = uuid.uuid4().hex[:8]
        self.tokens: TokenStore = backend.tokens()
        self.a_out = InMemoryDispatcher()
        self.entities = {name: backend.entities() for name in ("A", *receivers)}
        self.dedups: dict[str, DeduplicationStore] = {
            name: backend.dedup(endpoint=f"{name}-{tag}") for name in ("A", *receivers)
        }
        self.names = {name: f"{name}-{tag}" for name in ("A", *receivers)}
        subscribed = {"b-in": [self.names[r] for r in receivers]}
        self.a = OutboxProcessor(
            self.entities["A"],
            self.dedups["A"],
            self.a_out,
            tokens=self.tokens,
            subscriptions=subscribed,
        )
        self.receivers = {
            r: OutboxProcessor(
                self.entities[r], self.dedups[r], InMemoryDispatcher(), tokens=self.tokens
            )
            for r in receivers
        }

    def to_b(self) -> list[Message]:
        """Every message A dispatched to ``b-in``, as delivered."""
        return [delivered(m) for m in self.a_out.sent if m.destination == "b-in"]

    def receiver(self, name: str, **options: Any) -> OutboxProcessor:
        """Another processor of receiver ``name`` (its own stores' clients)."""
        return OutboxProcessor(
            self.entities[name],
            self.dedups[name],
            InMemoryDispatcher(),
            tokens=self.tokens,
            **options,
        )

    def close(self) -> None:
        for client in [self.tokens, *self.entities.values(), *self.dedups.values()]:
            client.close()


@pytest.fixture
def chain(outbox_backend: OutboxBackend) -> Iterator[Chain]:
    made = Chain(outbox_backend)
    yield made
    made.close()


def state_of(chain: Chain, name: str, cid: str) -> dict[str, Any]:
    return chain.entities[name].load(cid).state


def outstanding(chain: Chain) -> int:
    return sum(c.outstanding for c in chain.tokens.outstanding().values())


def test_a_chain_applies_each_message_once_and_leaves_no_tokens(chain: Chain) -> None:
    inputs = [Message(f"in-{i}", f"o{i % 3}", i) for i in range(9)]
    for message in inputs:
        assert chain.a.process(message, a_handler).outcome == "processed"
    sent = chain.to_b()
    assert len(sent) == 9 and all(TOKEN_HEADER in m.headers for m in sent)
    assert not any(TOKEN_HEADER in m.headers for m in chain.a_out.sent if m.destination == "log")
    assert outstanding(chain) == 9  # one token per message in flight
    b = chain.receivers["B"]
    for message in sent + sent:  # every message delivered twice
        b.process(message, b_handler)
    for cid in ("o0", "o1", "o2"):
        state = state_of(chain, "B", f"b-{cid}")
        assert sorted(state["applied"]) == sorted(
            m.id for m in sent if m.correlation_id == f"b-{cid}"
        )
    assert outstanding(chain) == 0
    # no deduplication data left for the tokened messages: B recorded nothing
    keys = [message_key(m.correlation_id, m.id) for m in sent]
    assert chain.dedups["B"].processed_among(keys) == set()
    # an upstream retry (A's input again) changes nothing downstream
    for message in inputs:
        assert chain.a.process(message, a_handler).outcome == "duplicate"
    assert len(chain.to_b()) == 9


def test_a_duplicate_is_told_by_its_missing_token(chain: Chain) -> None:
    chain.a.process(Message("in-1", "o1", 5), a_handler)
    (message,) = chain.to_b()
    b = chain.receivers["B"]
    assert b.process(message, b_handler).outcome == "processed"
    # another consumer of B (nothing kept) gets the copy
    again = chain.receiver("B").process(message, b_handler)
    assert again.outcome == "duplicate"
    assert state_of(chain, "B", "b-o1")["sum"] == 5
    # a token never minted: a duplicate too (the token store is the proof)
    forged = Message("x-1", "b-o1", {"n": 1}, {TOKEN_HEADER: new_nonce()})
    assert b.process(forged, b_handler).outcome == "duplicate"
    assert state_of(chain, "B", "b-o1")["sum"] == 5


def test_a_message_without_a_token_goes_through_the_deduplication_store(chain: Chain) -> None:
    b = chain.receivers["B"]
    plain = Message("p-1", "b-o1", {"n": 2})  # from a producer outside the protocol
    chain.a.process(Message("in-1", "o1", 3), a_handler)
    (tokened,) = chain.to_b()
    results = b.process_batch([plain, tokened, plain, tokened], b_handler)
    assert [r.outcome for r in results] == ["processed", "processed", "duplicate", "duplicate"]
    assert [r.outcome for r in b.process_batch([plain, tokened], b_handler)] == [
        "duplicate",
        "duplicate",
    ]
    assert state_of(chain, "B", "b-o1")["sum"] == 5
    assert chain.dedups["B"].processed_among(
        [message_key("b-o1", "p-1"), message_key("b-o1", tokened.id)]
    ) == {message_key("b-o1", "p-1")}
    assert outstanding(chain) == 0


@pytest.mark.parametrize(
    ("folded", "crash_at"), [(False, 1), (False, 2), (False, 3), (True, 1), (True, 2)]
)
@pytest.mark.parametrize("how", ["process", "process_batch"])
def test_a_sender_that_dies_at_any_save_mints_no_token_twice_and_leaves_none(
    outbox_backend: OutboxBackend, crash_at: int, how: str, folded: bool
) -> None:
    """A dies at its first save (the entry and its registered nonce), its second (the
    tokens made) or its third (the clean-up); folded (a token store on the entity
    store's server: SQLite, PostgreSQL, Redis; elsewhere the same as unfolded), at its
    first (the entry with its tokens made) or its second (the clean-up). Its redelivery
    completes, B applies the message once however often it is delivered, and no token
    is left."""
    chain = Chain(outbox_backend)
    try:
        message = Message("in-1", "o1", 7)
        dying = OutboxProcessor(
            Crashing(chain.entities["A"], crash_at, folded),  # type: ignore[arg-type]
            chain.dedups["A"],
            chain.a_out,
            tokens=chain.tokens,
            subscriptions={"b-in": [chain.names["B"]]},
            entity_cache=0,
        )
        with pytest.raises(Crash):
            if how == "process":
                dying.process(message, a_handler)
            else:
                dying.process_batch([message], a_handler)
        early = chain.to_b()
        b = chain.receivers["B"]
        for copy in early:  # what was dispatched before the crash is consumed first
            b.process(copy, b_handler)
        retry = chain.a.process if how == "process" else None
        if retry is not None:
            retry(message, a_handler)
        else:
            chain.a.process_batch([message], a_handler)
        for copy in chain.to_b():
            b.process(copy, b_handler)
        assert len({m.headers[TOKEN_HEADER] for m in chain.to_b()}) == 1  # one nonce made
        assert state_of(chain, "B", "b-o1")["sum"] == 7
        assert outstanding(chain) == 0
        assert not chain.entities["A"].load("o1").outbox
    finally:
        chain.close()


def test_fan_out_gives_each_receiver_its_own_token(outbox_backend: OutboxBackend) -> None:
    chain = Chain(outbox_backend, receivers=("B", "C"))
    try:
        chain.a.process(Message("in-1", "o1", 4), a_handler)
        (message,) = chain.to_b()
        for_c = delivered(chain.a_out.sent[0], "C")
        assert outstanding(chain) == 2
        nonce = message.headers[TOKEN_HEADER]
        assert token_id(message.id, chain.names["B"], nonce) != token_id(
            message.id, chain.names["C"], nonce
        )
        for name in ("B", "C", "B", "C"):
            chain.receivers[name].process(message if name == "B" else for_c, b_handler)
        assert state_of(chain, "B", "b-o1")["sum"] == 4
        assert state_of(chain, "C", "c-o1")["sum"] == 4
        assert outstanding(chain) == 0
    finally:
        chain.close()


def test_two_copies_at_once_apply_once(chain: Chain) -> None:
    for i in range(4):
        chain.a.process(Message(f"in-{i}", "o1", i), a_handler)
    sent = chain.to_b()
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def run() -> None:
        processor = chain.receiver("B")
        barrier.wait()
        try:
            for message in sent:
                processor.process(message, b_handler)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert state_of(chain, "B", "b-o1")["sum"] == 0 + 1 + 2 + 3
    assert outstanding(chain) == 0


def test_deferred_clean_up_leaves_tokens_to_the_sweep(chain: Chain) -> None:
    for i in range(3):
        chain.a.process(Message(f"in-{i}", f"o{i}", i + 1), a_handler)
    b = chain.receiver("B", cleanup="deferred")
    for message in chain.to_b():
        assert b.process(message, b_handler).outcome == "processed"
    assert outstanding(chain) == 3  # consumed, deleted by the sweep
    for message in chain.to_b():
        assert b.process(message, b_handler).outcome == "duplicate"
    with pytest.raises(ConfigurationError, match="token store"):
        sweep(chain.entities["B"], chain.dedups["B"])
    assert outstanding(chain) == 3  # nothing written
    done = sweep(chain.entities["B"], chain.dedups["B"], tokens=chain.tokens)
    assert done.ids_moved == 3 and outstanding(chain) == 0
    for message in chain.to_b():
        assert b.process(message, b_handler).outcome == "duplicate"
    assert sum(state_of(chain, "B", f"b-o{i}")["sum"] for i in range(3)) == 6


@pytest.mark.parametrize("when", ["deferred", "inline-died-before-clean-up"])
def test_a_letter_redriven_before_its_clean_up_is_applied_once(chain: Chain, when: str) -> None:
    """The token of a dead-lettered message is exchanged for its redrive's by the clean-up
    (deferred: the sweep). A redrive that comes first cleans the entry up itself, so it
    is applied, not told a duplicate (which an operator would take for done)."""
    chain.a.process(Message("in-1", "o1", 9), a_handler)
    (message,) = chain.to_b()
    letters = InMemoryDispatcher()
    flaky = Flaky()

    deferred = when == "deferred"
    b = OutboxProcessor(
        chain.entities["B"],
        chain.dedups["B"],
        letters,
        tokens=chain.tokens,
        dead_letters="dlq",
        cleanup="deferred" if deferred else "inline",
    )
    if deferred:
        assert b.process(message, flaky).outcome == "dead_lettered"
    else:  # the letter dispatched, then the consumer died before its clean-up
        assert run(b._process(message, flaky, set(), clean=False)).outcome == "dead_lettered"
    (letter,) = letters.sent
    flaky.fixed = True
    assert b.redrive(letter, flaky).outcome == "processed"
    assert b.redrive(letter, flaky).outcome == "duplicate"
    assert chain.receiver("B").process(message, flaky).outcome == "duplicate"
    sweep(chain.entities["B"], chain.dedups["B"], tokens=chain.tokens)
    assert outstanding(chain) == 0
    assert state_of(chain, "B", "b-o1")["sum"] == 9
    assert not chain.entities["B"].load("b-o1").outbox


def test_a_deferred_entity_over_its_limit_deletes_its_tokens_inline(chain: Chain) -> None:
    """A deferred clean-up that holds more than ``deferred_limit`` dispatched entries
    moves them inline: their tokens are deleted (on one server, in the save that
    removes them), the others' left to the sweep."""
    for i in range(3):
        chain.a.process(Message(f"in-{i}", "o1", i + 1), a_handler)
    b = chain.receiver("B", cleanup="deferred", deferred_limit=1)
    for message in chain.to_b():
        assert b.process(message, b_handler).outcome == "processed"
    entity = chain.entities["B"].load("b-o1")
    assert len(entity.dispatched) == 1 and outstanding(chain) == 1
    for message in chain.to_b():
        assert b.process(message, b_handler).outcome == "duplicate"
    assert state_of(chain, "B", "b-o1")["sum"] == 6


def test_a_bad_token_header_is_refused_before_any_io(chain: Chain) -> None:
    b = chain.receivers["B"]
    bad = Message("m-1", "b-o1", {"n": 1}, {TOKEN_HEADER: "not a nonce!"})
    with pytest.raises(InvalidMessageId, match=r"m-1.*dedupstore-token"):
        b.process(bad, b_handler)
    with pytest.raises(InvalidMessageId, match="m-1"):
        b.process_batch([Message("m-0", "b-o1", {"n": 1}), bad], b_handler)
    assert chain.entities["B"].load("b-o1").version is None


def test_entries_in_token_mode_need_the_token_store(chain: Chain) -> None:
    chain.a.process(Message("in-1", "o1", 1), a_handler)
    (message,) = chain.to_b()
    b = chain.receiver("B", cleanup="deferred")
    b.process(message, b_handler)
    # a processor without the token store that must clean that entry up refuses
    plain = OutboxProcessor(
        chain.entities["B"],
        chain.dedups["B"],
        InMemoryDispatcher(),
        cleanup="deferred",
        deferred_limit=1,
    )
    with pytest.raises(ConfigurationError, match="token store"):
        plain.process(Message("p-2", "b-o1", {"n": 1}), b_handler)
    assert outstanding(chain) == 1  # the tokened entry's token was not touched
    with pytest.raises(ConfigurationError, match="subscriptions need a token store"):
        OutboxProcessor(
            chain.entities["B"], chain.dedups["B"], InMemoryDispatcher(), subscriptions={"x": ["y"]}
        )


def test_a_dead_letter_keeps_a_token_until_it_is_redriven(chain: Chain) -> None:
    chain.a.process(Message("in-1", "o1", 9), a_handler)
    (message,) = chain.to_b()
    letters = InMemoryDispatcher()
    flaky = Flaky()

    b = OutboxProcessor(
        chain.entities["B"], chain.dedups["B"], letters, tokens=chain.tokens, dead_letters="dlq"
    )
    assert b.process(message, flaky).outcome == "dead_lettered"
    assert outstanding(chain) == 1  # exchanged for the redrive's
    assert chain.receiver("B").process(message, flaky).outcome == "duplicate"  # a copy
    (letter,) = letters.sent
    flaky.fixed = True
    # a processor without the token store refuses it before any I/O (its token would be left)
    plain = OutboxProcessor(chain.entities["B"], chain.dedups["B"], letters, dead_letters="dlq")
    with pytest.raises(ConfigurationError, match="keeps a redrive token"):
        plain.redrive(letter, flaky)
    assert outstanding(chain) == 1
    assert b.redrive(letter, flaky).outcome == "processed"
    assert outstanding(chain) == 0
    assert b.redrive(letter, flaky).outcome == "duplicate"
    assert state_of(chain, "B", "b-o1")["sum"] == 9


def test_a_sweep_leaves_an_entry_whose_tokens_are_not_made_to_its_redelivery(
    chain: Chain,
) -> None:
    """A sender died between creating its tokens and the save marking them made: a
    sweep with redispatch must not send the messages (it cannot know the tokens are
    all there), counts the entry as left, and the redelivery completes it."""
    message = Message("in-1", "o1", 3)
    dying = OutboxProcessor(
        Crashing(chain.entities["A"], 2),  # type: ignore[arg-type]
        chain.dedups["A"],
        chain.a_out,
        tokens=chain.tokens,
        subscriptions={"b-in": [chain.names["B"]]},
    )
    with pytest.raises(Crash):
        dying.process(message, a_handler)
    relay = InMemoryDispatcher()
    done = sweep(chain.entities["A"], chain.dedups["A"], redispatch=relay, tokens=chain.tokens)
    assert (done.redispatched, done.ids_left, relay.sent) == (0, 1, [])
    assert chain.a.process(message, a_handler).outcome == "redispatched"
    for copy in chain.to_b():
        chain.receivers["B"].process(copy, b_handler)
    assert state_of(chain, "B", "b-o1")["sum"] == 3
    assert outstanding(chain) == 0


def test_applied_among_tells_tokened_messages_by_their_outbox_then_their_token(
    chain: Chain,
) -> None:
    """applied_among in token mode: an id in the outbox (deferred) or a token gone is
    applied; a token present and no entry is not; the deduplication store is not asked
    about a tokened message; a token id without the token store is refused first."""
    for i in range(3):
        chain.a.process(Message(f"in-{i}", f"o{i}", i + 1), a_handler)
    first, second, third = chain.to_b()
    b = chain.receiver("B", cleanup="deferred")
    b.process(first, b_handler)  # applied, its id in the outbox, its token not yet deleted
    chain.receivers["B"].process(second, b_handler)  # applied, token deleted, entry gone
    plain = Message("p-1", "b-o0", {"n": 1})
    chain.receivers["B"].process(plain, b_handler)
    endpoint = chain.names["B"]
    tokened = {
        (m.correlation_id, m.id): token_id(m.id, endpoint, m.headers[TOKEN_HEADER])
        for m in (first, second, third)
    }
    asked = [*tokened, ("b-o0", "p-1"), ("b-o0", "p-2")]
    found = applied_among(
        chain.entities["B"], chain.dedups["B"], asked, tokens=chain.tokens, token_ids=tokened
    )
    assert found == {
        (first.correlation_id, first.id),
        (second.correlation_id, second.id),
        ("b-o0", "p-1"),
    }
    # without the entity store: the one whose id waits in its outbox (token still there) not
    assert recorded_among(
        chain.dedups["B"], asked, tokens=chain.tokens, token_ids=tokened
    ) == found - {(first.correlation_id, first.id)}
    # without token mode, the same messages look unapplied but the one still in the outbox
    assert applied_among(chain.entities["B"], chain.dedups["B"], asked) == {
        (first.correlation_id, first.id),
        ("b-o0", "p-1"),
    }
    with pytest.raises(ConfigurationError, match="token store"):
        applied_among(chain.entities["B"], chain.dedups["B"], asked, token_ids=tokened)
    with pytest.raises(InvalidMessageId):
        applied_among(
            chain.entities["B"],
            chain.dedups["B"],
            asked,
            tokens=chain.tokens,
            token_ids={asked[0]: ""},
        )


def test_a_processor_without_a_token_store_reports_a_tokened_message_once(
    chain: Chain, caplog: pytest.LogCaptureFixture
) -> None:
    """A receiver the sender lists but that runs without tokens= processes the message
    in retention mode (exactly once within the retention) and says so once: the token
    it leaves would otherwise go unnoticed until the orphan report."""
    for i in range(2):
        chain.a.process(Message(f"in-{i}", f"o{i}", i + 1), a_handler)
    plain = OutboxProcessor(chain.entities["B"], chain.dedups["B"], InMemoryDispatcher())
    with caplog.at_level("WARNING", logger="dedupstore.outbox"):
        for message in chain.to_b() * 2:
            plain.process(message, b_handler)
    warned = [r for r in caplog.records if "no token store" in r.getMessage()]
    assert len(warned) == 1 and "in-0" not in warned[0].getMessage()
    assert sum(state_of(chain, "B", f"b-o{i}")["sum"] for i in range(2)) == 3
    assert outstanding(chain) == 2  # left in the sender's token store


class _Bounded(InMemoryDispatcher):
    """A dispatcher whose messages are at most 1,500 bytes: a large letter is bounded."""

    max_message_bytes = 1500
    max_header_bytes = None

    def read_back(self, destination: str) -> list[ReadMessage]:
        return [
            ReadMessage(m, len(canonical.dumps(m.body)), str(n))
            for n, m in enumerate(self.sent)
            if m.destination == destination
        ]

    def remove(self, destination: str, messages: Sequence[ReadMessage]) -> int:
        gone = {m.message.id for m in messages}
        before = len(self.sent)
        self.sent[:] = [m for m in self.sent if m.destination != destination or m.id not in gone]
        return before - len(self.sent)


def test_a_bounded_dead_letter_keeps_the_nonce_that_names_its_redrive_token(
    chain: Chain,
) -> None:
    """A letter too large to keep the original's headers keeps its nonce beside their
    digest: its redrive token can be named, so purging it deletes the token."""
    chain.a.process(Message("in-1", "o1", 9), a_handler)
    (message,) = chain.to_b()
    big = Message(
        message.id, message.correlation_id, message.body, {**message.headers, "x": "y" * 2000}
    )
    letters = _Bounded()

    def refuse(state: dict[str, Any], m: Message) -> tuple[dict[str, Any], list[Send]]:
        raise ValueError("no")

    b = OutboxProcessor(
        chain.entities["B"], chain.dedups["B"], letters, tokens=chain.tokens, dead_letters="dlq"
    )
    assert b.process(big, refuse).outcome == "dead_lettered"
    (sent,) = letters.sent
    assert "headers_omitted" in sent.body["message"]
    assert sent.body["message"]["token"] == message.headers[TOKEN_HEADER]
    assert outstanding(chain) == 1
    (letter,) = DeadLetterQueue(letters, "dlq").list()
    named = redrive_token(letter)
    assert named is not None and chain.tokens.present_among([named.id]) == {named.id}
    DeadLetterQueue(letters, "dlq").purge([letter], tokens=chain.tokens)
    assert outstanding(chain) == 0
