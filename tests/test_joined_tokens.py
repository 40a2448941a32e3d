"""Token mode on one server: the token writes folded into the entity's requests.

When the token store shares the entity store's connection (SQLite: one file;
PostgreSQL and Redis: one server; DynamoDB: one account and region, through
transactions; :meth:`EntityStore._tokens_joined`), ``process``
loads the entity and reads the incoming token in one request, saves the applied
entry with its outgoing tokens created in the same atomic request (so "registered
but not made" never exists), and the inline clean-up deletes the incoming token
with the save that removes the entry. These tests check the joining rule, the
joint calls' contract (a token written only with its entity, a missing required
token writes nothing, ids checked before any I/O), a lost answer, a refused write,
the round trips, and that the interleaving harness catches broken joint calls.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import psycopg
import pytest

from dedupstore.client import Client
from dedupstore.entities import Entity, EntityStore
from dedupstore.errors import DedupStoreError
from dedupstore.outbox import InMemoryDispatcher, Message, OutboxProcessor, Send, sweep
from dedupstore.testing.entities import JointTokenContract
from dedupstore.testing.interleavings import Actor, InterleavingViolation, Scenario, explore
from dedupstore.tokens import TOKEN_HEADER, TokenChange, TokenStore, new_nonce, token_id
from tests.outbox_backends import OutboxBackend, backend_params
from tests.test_entities_redis import _LosingAnswers as LosingAnswers

FOLDED = ("sqlite", "postgres", "redis", "dynamodb")
ON_FOLDED = pytest.mark.parametrize("outbox_backend", backend_params(FOLDED), indirect=True)
ON_REDIS = pytest.mark.parametrize("outbox_backend", backend_params(("redis",)), indirect=True)
ON_POSTGRES = pytest.mark.parametrize(
    "outbox_backend", backend_params(("postgres",)), indirect=True
)
ON_DYNAMODB = pytest.mark.parametrize(
    "outbox_backend", backend_params(("dynamodb",)), indirect=True
)
NEXT = "shipper"


def _relay(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
    return {"n": state.get("n", 0) + 1}, [Send("shipping", {"of": message.id})]


@pytest.fixture
def stores(outbox_backend: OutboxBackend) -> Iterator[tuple[EntityStore, TokenStore]]:
    entities, tokens = outbox_backend.entities(), outbox_backend.tokens()
    yield entities, tokens
    entities.close()
    tokens.close()


def _tokened(consumer: str, mid: str, cid: str, tokens: TokenStore) -> Message:
    """A message whose sender minted its token for ``consumer``."""
    nonce = new_nonce()
    tokens.create({token_id(mid, consumer, nonce): consumer})
    return Message(mid, cid, {}, {TOKEN_HEADER: nonce})


# ---------------------------------------------------------------------- which stores fold


@ON_FOLDED
def test_the_token_store_of_the_entity_stores_server_is_joined(
    outbox_backend: OutboxBackend, stores: tuple[EntityStore, TokenStore]
) -> None:
    entities, tokens = stores
    dedup = outbox_backend.dedup()
    try:
        assert entities._tokens_joined(tokens)
        processor = OutboxProcessor(entities, dedup, InMemoryDispatcher(), tokens=tokens)
        assert processor._tokens_joined
        assert not OutboxProcessor(entities, dedup, InMemoryDispatcher())._tokens_joined
    finally:
        dedup.close()


@pytest.mark.parametrize("outbox_backend", backend_params(("memory", "cosmos")), indirect=True)
def test_stores_without_a_joint_request_fold_nothing(
    stores: tuple[EntityStore, TokenStore],
) -> None:
    entities, tokens = stores
    assert not entities._tokens_joined(tokens)


def test_another_file_or_connection_is_not_joined(tmp_path: Any) -> None:
    from dedupstore import open_entity_store, open_token_store

    entities = open_entity_store(f"sqlite:///{tmp_path}/a.db")
    elsewhere = open_token_store(f"sqlite:///{tmp_path}/b.db")
    try:
        assert not entities._tokens_joined(elsewhere)
    finally:
        entities.close()
        elsewhere.close()


# ---------------------------------------------------------------------- the joint calls


@ON_FOLDED
class TestJointTokenContract(JointTokenContract):
    """The contract kit's suite of the joint calls, on every backend that joins."""

    @pytest.fixture
    def entity_store_factory(self, outbox_backend: OutboxBackend) -> Any:
        return outbox_backend.entities

    @pytest.fixture
    def token_store_factory(self, outbox_backend: OutboxBackend) -> Any:
        return outbox_backend.tokens


class _LosingTokenJoined(LosingAnswers):
    """Loses a script's answer (see its base), joined to the token store as if it
    shared its connection."""

    def _shares_connection_with(self, other: Client) -> bool:
        return True


@ON_REDIS
def test_a_lost_answer_never_creates_a_consumed_token_again(
    outbox_backend: OutboxBackend, stores: tuple[EntityStore, TokenStore]
) -> None:
    """The script ran (entity saved, token created), its answer was lost, and the
    receiver consumed the token before the re-send: the re-send finds its own write
    token on the entity and writes nothing again."""
    entities, tokens = stores
    losing = _LosingTokenJoined(outbox_backend.entities_url)
    try:
        tokens.create({"t-in": "me"})
        entity = losing.load("e")
        entity.state = {"v": 1}
        losing._redis.losses = 1
        losing._redis.meddle = lambda: tokens.delete(["t-out"])  # the receiver was quick
        change = TokenChange("t-in", {"t-out": NEXT})
        assert losing._save_tokened([entity], tokens, {"e": change}) == (set(), set())
        assert entity.version == 1 and entities.load("e").state == {"v": 1}
        assert not tokens.present("t-out"), "a consumed token came back"
    finally:
        losing.close()


@ON_DYNAMODB
def test_a_resent_transaction_never_creates_a_consumed_token_again(
    outbox_backend: OutboxBackend, stores: tuple[EntityStore, TokenStore], dynamodb_server: Any
) -> None:
    """botocore sends the joint transaction again after it was applied (its answer lost),
    and the receiver consumed the token in between: the re-send writes nothing (DynamoDB
    answers it from its ClientRequestToken; moto runs it again and it is cancelled on the
    entity's version, which holds this save's write token), and it counts as saved."""
    from tests.test_dynamodb import _client

    entities, tokens = stores
    client = _client(dynamodb_server)
    losing = type(entities)(outbox_backend.entities_url, client=client)
    forced: list[int] = []

    def lose_the_first(response: Any, attempts: int, **_: Any) -> int | None:
        if response is not None and response[0].status_code == 200 and not forced:
            forced.append(attempts)
            tokens.delete(["t-out"])  # the receiver was quick
            return 0
        return None

    client.meta.events.register("needs-retry.dynamodb.TransactWriteItems", lose_the_first)
    try:
        tokens.create({"t-in": "me"})
        entity = losing.load("e")
        entity.state = {"v": 1}
        change = TokenChange("t-in", {"t-out": NEXT})
        assert losing._save_tokened([entity], tokens, {"e": change}) == (set(), set())
        assert forced == [1] and entity.version == 1
        assert entities.load("e").state == {"v": 1}
        assert not tokens.present("t-out"), "a consumed token came back"
    finally:
        losing.close()


@ON_POSTGRES
def test_a_token_the_database_refuses_saves_nothing(
    outbox_backend: OutboxBackend, stores: tuple[EntityStore, TokenStore]
) -> None:
    """A trigger refuses the token's insert: the statement, save included, rolls back."""
    entities, tokens = stores
    table = tokens.option("table")
    url = outbox_backend.tokens_url.split("?")[0]
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute(
            f'CREATE FUNCTION "refuse_{table}"() RETURNS trigger LANGUAGE plpgsql '
            "AS $$ BEGIN RAISE EXCEPTION 'refused by a trigger'; END $$"
        )
        admin.execute(
            f'CREATE TRIGGER refuse BEFORE INSERT ON "{table}" '
            f'FOR EACH ROW EXECUTE FUNCTION "refuse_{table}"()'
        )
    try:
        entity = entities.load("e")
        entity.state = {"v": 1}
        with pytest.raises(DedupStoreError, match="refused by a trigger"):
            entities._save_tokened([entity], tokens, {"e": TokenChange(None, {"t": NEXT})})
        assert entities.load("e").version is None
    finally:
        with psycopg.connect(url, autocommit=True) as admin:
            admin.execute(f'DROP TRIGGER refuse ON "{table}"')
            admin.execute(f'DROP FUNCTION "refuse_{table}"()')


# ---------------------------------------------------------------------- round trips


@ON_FOLDED
def test_a_relayed_message_costs_what_retention_mode_costs(
    outbox_backend: OutboxBackend, stores: tuple[EntityStore, TokenStore]
) -> None:
    """Token in, token out, on one server: the joint load and token read (one
    request), the save that creates the outgoing token (one), the clean-up that
    deletes the incoming one (one); two once the entity is kept, as in retention
    mode; nothing left but the next hop's token."""
    entities, tokens = stores
    dedup, own = outbox_backend.dedup(), outbox_backend.tokens()  # (own: the test's view)
    calls: list[str] = []
    for name in ("_load", "_save", "_load_with_token", "_save_tokens"):
        real = getattr(entities, name)

        def counted(*args: Any, _real: Any = real, _name: str = name) -> Any:
            calls.append(_name)
            return _real(*args)

        setattr(entities, name, counted)
    for name in ("_create", "_present", "_delete"):
        setattr(tokens, name, _refused(name))
    try:
        processor = OutboxProcessor(
            entities, dedup, InMemoryDispatcher(), tokens=tokens, subscriptions={"shipping": [NEXT]}
        )
        consumer = dedup.endpoint
        messages = [_tokened(consumer, f"m{i}", "e", own) for i in range(5)]
        results = [processor.process(m, _relay) for m in messages]
        assert [r.outcome for r in results] == ["processed"] * 5
        assert calls == ["_load_with_token"] + ["_save_tokens"] * 10
        assert {e: c.outstanding for e, c in own.outstanding().items()} == {NEXT: 5}
        calls.clear()
        assert processor.process(messages[0], _relay).outcome == "duplicate"
        assert calls == ["_save_tokens", "_load"], "a kept entity: the save checks the token"
    finally:
        dedup.close()
        own.close()


def _refused(name: str) -> Any:
    def refused(*args: Any) -> Any:
        raise AssertionError(f"{name} called: the token write was not folded")

    return refused


@pytest.mark.parametrize("outbox_backend", backend_params(("postgres", "redis")), indirect=True)
def test_a_boundary_mints_in_one_request_even_after_a_death_between_its_saves(
    outbox_backend: OutboxBackend, stores: tuple[EntityStore, TokenStore]
) -> None:
    """A message without a token whose output is subscribed (the boundary of a chain),
    where the deduplication store joins too: a kept entity's save checks the
    deduplication store, so its tokens are made by one more joint save (created and
    marked made together; elsewhere the save itself creates them). A consumer that dies between
    the two leaves an entry registered but not made; its redelivery makes it in one
    request with a fresh nonce, and no token of the dead one's nonce ever exists."""
    entities, tokens = stores
    dedup, own = outbox_backend.dedup(), outbox_backend.tokens()
    try:
        for name in ("_create", "_present", "_delete"):
            setattr(tokens, name, _refused(name))
        sent = InMemoryDispatcher()
        dying = OutboxProcessor(
            entities, dedup, sent, tokens=tokens, subscriptions={"shipping": [NEXT]}
        )
        assert dying.process(Message("m0", "e", {}), _relay).outcome == "processed"

        def die(*args: Any) -> None:
            raise RuntimeError("killed between the save and the make")

        dying._make_folded = die  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="killed"):
            dying.process(Message("m1", "e", {}), _relay)
        (registered,) = entities.load("e").tokens["m1"].registered
        assert entities.load("e").tokens["m1"].made is None
        again = OutboxProcessor(
            entities, dedup, sent, tokens=tokens, subscriptions={"shipping": [NEXT]}
        )
        assert again.process(Message("m1", "e", {}), _relay).outcome == "redispatched"
        nonces = [m.headers[TOKEN_HEADER] for m in sent.sent]
        assert len(nonces) == 2 and registered not in nonces
        assert {e: c.outstanding for e, c in own.outstanding().items()} == {NEXT: 2}
        assert not entities.load("e").outbox
    finally:
        dedup.close()
        own.close()


@ON_FOLDED
def test_the_sweep_deletes_the_tokens_in_its_saves_and_plans_again_after_a_conflict(
    outbox_backend: OutboxBackend, stores: tuple[EntityStore, TokenStore]
) -> None:
    """Deferred clean-up: the sweep moves the dispatched entries, their incoming tokens
    deleted in the save that removes them (no request of the token store's own); a save
    that conflicts wrote nothing, so the retry plans the entries again from the reload."""
    entities, tokens = stores
    dedup, own = outbox_backend.dedup(), outbox_backend.tokens()
    try:
        consumer = dedup.endpoint
        processor = OutboxProcessor(
            entities, dedup, InMemoryDispatcher(), tokens=tokens, cleanup="deferred"
        )
        for i in range(3):
            message = _tokened(consumer, f"m{i}", "e", own)
            assert processor.process(message, _relay).outcome == "processed"
        assert sum(c.outstanding for c in own.outstanding().values()) == 3
        for name in ("_create", "_present", "_delete"):
            setattr(tokens, name, _refused(name))
        real = entities._save_tokened
        rivals: list[int] = []

        def rival_first(*args: Any) -> Any:
            if not rivals:
                rivals.append(1)
                rival = outbox_backend.entities()
                try:
                    entity = rival.load("e")
                    entity.state = {**entity.state, "rival": True}
                    rival.save(entity)
                finally:
                    rival.close()
            return real(*args)

        entities._save_tokened = rival_first  # type: ignore[method-assign]
        done = sweep(entities, dedup, tokens=tokens)
        assert (done.ids_moved, done.conflicts_retried, done.ids_left) == (3, 1, 0)
        assert not own.outstanding() and not entities.load("e").outbox
        assert entities.load("e").state["rival"] is True
    finally:
        dedup.close()
        own.close()


# ---------------------------------------------------------------------- the harness


class _BrokenJointSave:
    """BROKEN joint saves: ``"unchecked"`` drops the required token (the save of a kept
    entity trusts it still exists); ``"eager"`` creates the tokens of an entity whose
    save conflicted (a token no message carries)."""

    def __init__(self, real: Any, how: str) -> None:
        self._real, self._how = real, how

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def _save_tokened(
        self, entities: Sequence[Entity], tokens: Any, changes: Mapping[str, TokenChange]
    ) -> tuple[set[str], set[str]]:
        if self._how == "unchecked":
            changes = {eid: change._replace(require=None) for eid, change in changes.items()}
        missing, conflicts = self._real._save_tokened(entities, tokens, changes)
        for eid in conflicts if self._how == "eager" else ():
            if changes.get(eid) and changes[eid].create:
                tokens.create(changes[eid].create)
        return missing, conflicts


def _breaking(how: str) -> Any:
    class Broken(OutboxProcessor):
        def __init__(self, entities: EntityStore, *args: Any, **kwargs: Any) -> None:
            super().__init__(_BrokenJointSave(entities, how), *args, **kwargs)  # type: ignore[arg-type]

    return Broken


@ON_FOLDED
def test_the_harness_explores_and_checks_the_joint_token_calls(
    outbox_backend: OutboxBackend,
) -> None:
    one = Actor("process", (0,))
    copies = Scenario((one, one), 1, "inline", tokens="all")
    explored = {"token_store": outbox_backend.tokens}
    assert explore(copies, outbox_backend.entities, outbox_backend.dedup, **explored) >= 3
    with pytest.raises(InterleavingViolation) as caught:
        explore(
            copies,
            outbox_backend.entities,
            outbox_backend.dedup,
            processor=_breaking("eager"),
            **explored,
        )
    assert caught.value.invariant == "settled", str(caught.value)
    assert any("save_tokened" in step for step in caught.value.schedule)
    # a consumer that kept the entity, m0 redelivered to it
    again = Scenario((Actor("process", (0,), after=(0,)),), 1, "inline", tokens="all")
    assert explore(again, outbox_backend.entities, outbox_backend.dedup, **explored) == 1
    with pytest.raises(InterleavingViolation) as caught:
        explore(
            again,
            outbox_backend.entities,
            outbox_backend.dedup,
            processor=_breaking("unchecked"),
            **explored,
        )
    assert caught.value.invariant == "once", str(caught.value)
    assert caught.value.schedule[0] == "A:process(m0 after m0).save_tokened"
