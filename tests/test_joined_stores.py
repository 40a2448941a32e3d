"""An entity store and a deduplication store on one server, joined in one request.

When the two stores share a connection (:meth:`EntityStore._joined`), ``process``
loads the entity and checks the id in one round trip and the inline clean-up
records the id and saves the entity in one atomic request. These tests check the
joining rule, the round trips, and every failure of the joint calls: a record that
cannot be written, a conflict, a lost answer; and that the interleaving harness
catches a joint write that forgets the record.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import redis

from dedupstore.backends.postgres._client import PostgresConnection
from dedupstore.backends.redis._client import _Bounded
from dedupstore.client import Client
from dedupstore.entities import Entity, EntityStore
from dedupstore.errors import (
    ConcurrencyConflict,
    ConfigurationError,
    DedupStoreError,
    EntityTooLarge,
    StoreUnavailable,
)
from dedupstore.outbox import InMemoryDispatcher, Message, OutboxProcessor, Send, message_key
from dedupstore.steps import run
from dedupstore.store import DeduplicationStore
from dedupstore.testing.interleavings import (
    Actor,
    InterleavingViolation,
    Scenario,
    explore,
)
from tests.outbox_backends import OutboxBackend, backend_params, patient
from tests.test_entities_redis import _LosingAnswers as LosingAnswers

JOINED = ("redis", "postgres")
#: the tests' backends (each parameter carries its backend's mark)
ON_JOINED = pytest.mark.parametrize("outbox_backend", backend_params(JOINED), indirect=True)
ON_REDIS = pytest.mark.parametrize("outbox_backend", backend_params(("redis",)), indirect=True)
ON_POSTGRES = pytest.mark.parametrize(
    "outbox_backend", backend_params(("postgres",)), indirect=True
)


def _handler(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
    return {"n": state.get("n", 0) + 1}, [Send("out", {"of": message.id})]


@pytest.fixture
def pair(outbox_backend: OutboxBackend) -> Iterator[tuple[EntityStore, DeduplicationStore]]:
    entities, dedup = outbox_backend.entities(), outbox_backend.dedup()
    yield entities, dedup
    entities.close()
    dedup.close()


@pytest.fixture
def requests(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Requests sent to Redis (a pipeline or a script call is one), counted."""
    sent = [0]
    original = _Bounded.send_packed_command

    def counting(self: Any, command: Any, check_health: bool = True) -> None:
        sent[0] += 1
        original(self, command, check_health)

    monkeypatch.setattr(_Bounded, "send_packed_command", counting)
    return sent


# ---------------------------------------------------------------------- which stores join


@ON_JOINED
def test_the_stores_of_one_connection_are_joined(outbox_backend: OutboxBackend) -> None:
    entities = outbox_backend.entities()
    same = outbox_backend.dedup()
    other_endpoint = outbox_backend.dedup(endpoint="another-consumer")
    other_timeout = outbox_backend.dedup(timeout=4.5)
    # Redis: writes that retry or wait for replicas otherwise cannot share a script
    other_retries = outbox_backend.dedup(
        **({"retries": 1} if outbox_backend.name == "redis" else {"timeout": 4.4})
    )
    try:
        assert entities._joined(same) and entities._joined(other_endpoint)
        assert OutboxProcessor(entities, same, InMemoryDispatcher())._joined
        # another connection (its options differ) or other retries: two requests
        assert not entities._joined(other_timeout)
        assert not entities._joined(other_retries)
        assert not OutboxProcessor(entities, other_retries, InMemoryDispatcher())._joined
    finally:
        for store in (entities, same, other_endpoint, other_retries, other_timeout):
            store.close()


@pytest.mark.parametrize("outbox_backend", backend_params(("memory", "sqlite")), indirect=True)
def test_stores_without_a_joint_request_are_not_joined(
    pair: tuple[EntityStore, DeduplicationStore],
) -> None:
    entities, dedup = pair
    assert not entities._joined(dedup)
    assert not OutboxProcessor(entities, dedup, InMemoryDispatcher())._joined


@pytest.fixture
def statements(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Requests the stores sent to PostgreSQL (one statement each), counted.

    Counted where a store sends a request (``run``), not per ``execute``: the pool
    opens connections in the background (up to ``pool_min_size``), and each new one
    runs its set-up statement whenever the pool gets to it.
    """
    sent = [0]
    original = PostgresConnection.run

    def counting(self: Any, *args: Any, **kwargs: Any) -> list[tuple[Any, ...]]:
        sent[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(PostgresConnection, "run", counting)
    return sent


@ON_JOINED
@pytest.mark.parametrize("cleanup", ["inline", "deferred"])
def test_process_costs_two_requests_on_one_server_once_it_kept_the_entity(
    pair: tuple[EntityStore, DeduplicationStore],
    outbox_backend: OutboxBackend,
    cleanup: Any,
    request: pytest.FixtureRequest,
) -> None:
    """An entity the processor saved last: save checking the id (one script or
    statement), clean-up (one): 2 requests. Loaded (a new processor, or
    ``entity_cache=0``): load and check (one pipeline or statement) as well, 3, not
    5 (inline) or 4 (deferred). A duplicate costs one request loaded, two kept."""
    requests: list[int] = request.getfixturevalue(
        "requests" if outbox_backend.name == "redis" else "statements"
    )
    entities, dedup = pair
    dispatcher = InMemoryDispatcher()
    processor = OutboxProcessor(entities, dedup, dispatcher, cleanup=cleanup)
    for warm_up in ("w1", "w2"):  # (Redis loads each script on its first run)
        processor.process(Message(warm_up, "e", {}), _handler)
    # (and a connection's first request sets it up: the scripts run on the connection
    # the Redis stores keep, a load on a pooled one)
    entities.load("e")
    requests[0] = 0
    for i in range(10):
        assert processor.process(Message(f"m{i}", "e", {}), _handler).outcome == "processed"
    assert requests[0] == 10 * 2
    loading = OutboxProcessor(entities, dedup, dispatcher, cleanup=cleanup, entity_cache=0)
    requests[0] = 0
    for i in range(10, 15):
        assert loading.process(Message(f"m{i}", "e", {}), _handler).outcome == "processed"
    assert requests[0] == 5 * 3
    requests[0] = 0
    assert loading.process(Message("m3", "e", {}), _handler).outcome == "duplicate"
    assert requests[0] == 1, "a duplicate costs the one joint read"
    # the first processor's entity is stale now: one conflict, then a load
    requests[0] = 0
    assert processor.process(Message("m15", "e", {}), _handler).outcome == "processed"
    assert requests[0] == 1 + 3
    requests[0] = 0
    assert processor.process(Message("m3", "e", {}), _handler).outcome == "duplicate"
    # inline: the save finds it recorded, then a load shows the stored outbox does not
    # hold it (a kept entity is not checked by a save that writes nothing: see
    # test_kept_entities.py); deferred: the kept outbox holds it, dispatched
    assert requests[0] == (2 if cleanup == "inline" else 0)
    assert entities.load("e").state == {"n": 18}
    if cleanup == "inline":
        keys = [message_key("e", f"m{i}") for i in range(16)]
        assert dedup.processed_among(keys) == set(keys)


# ---------------------------------------------------------------------- failures of joint calls


def _pending(entities: EntityStore, dedup: DeduplicationStore, mid: str) -> Entity:
    """An entity holding ``mid`` pending, saved (steps 1-4 of ``process``)."""
    processor = OutboxProcessor(entities, dedup, InMemoryDispatcher())
    run(processor._process(Message(mid, "e", {}), _handler, set(), clean=False))
    entity = entities.load("e")
    assert entity.outbox.get(mid)
    return entity


@ON_JOINED
def test_a_conflict_leaves_the_entity_and_keeps_the_record(
    pair: tuple[EntityStore, DeduplicationStore],
) -> None:
    entities, dedup = pair
    stale = _pending(entities, dedup, "m")
    rival = entities.load("e")
    rival.state = {"rival": True}
    entities.save(rival)
    del stale.outbox["m"]
    with pytest.raises(ConcurrencyConflict):
        entities._save_recording(stale, dedup, message_key("e", "m"))
    assert dedup.has_been_processed(message_key("e", "m")), "the record is written first"
    stored = entities.load("e")
    assert stored.state == {"rival": True} and "m" in stored.outbox
    assert stale.version != stored.version
    # the processor retries: the entry is found, cleaned up, and the result honest
    processor = OutboxProcessor(entities, dedup, InMemoryDispatcher())
    assert processor.process(Message("m", "e", {}), _handler).outcome == "redispatched"
    assert "m" not in entities.load("e").outbox


@ON_REDIS
def test_a_record_that_cannot_be_written_saves_nothing(
    pair: tuple[EntityStore, DeduplicationStore], outbox_backend: OutboxBackend
) -> None:
    """A foreign value where the record goes: the whole joint write is refused."""
    entities, dedup = pair
    entity = _pending(entities, dedup, "m")
    admin = redis.Redis.from_url(outbox_backend.dedup_url.split("?")[0])
    try:
        admin.set(dedup.record_key(message_key("e", "m")), "not ours")  # type: ignore[attr-defined]
        processor = OutboxProcessor(entities, dedup, InMemoryDispatcher())
        with pytest.raises(ConfigurationError, match="did not write"):
            processor.process(Message("m", "e", {}), _handler)
        stored = entities.load("e")
        assert stored.version == entity.version and stored.outbox == entity.outbox
        # the joint read refuses it as well, and a hash where the record goes
        admin.delete(dedup.record_key(message_key("e", "m")))  # type: ignore[attr-defined]
        admin.hset(dedup.record_key(message_key("e", "other")), "x", "1")  # type: ignore[attr-defined]
        with pytest.raises(ConfigurationError):
            processor.process(Message("other", "e", {}), _handler)
        assert "other" not in entities.load("e").outbox
    finally:
        admin.close()


class _LosingAnswers(LosingAnswers):
    """Loses the answer of a script (see its base) on a connection of its own to the
    stores' server, and joins them as if it shared theirs."""

    def _shares_connection_with(self, other: Client) -> bool:
        return True


@pytest.fixture
def losing(outbox_backend: OutboxBackend) -> Iterator[_LosingAnswers]:
    """An entity store on the Redis server under test that loses answers when told."""
    store = _LosingAnswers(outbox_backend.entities_url)
    yield store
    store.close()


@ON_POSTGRES
def test_a_record_the_database_refuses_saves_nothing_on_postgres(
    pair: tuple[EntityStore, DeduplicationStore], outbox_backend: OutboxBackend
) -> None:
    """A trigger refuses the record's insert: the statement, save included, rolls back."""
    entities, dedup = pair
    entity = _pending(entities, dedup, "m")
    table = dedup.option("table")
    url = outbox_backend.dedup_url.split("?")[0]
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
        processor = OutboxProcessor(entities, dedup, InMemoryDispatcher())
        with pytest.raises(DedupStoreError, match="refused by a trigger"):
            processor.process(Message("m", "e", {}), _handler)
        stored = entities.load("e")
        assert stored.version == entity.version and stored.outbox == entity.outbox
        assert not dedup.has_been_processed(message_key("e", "m"))
    finally:
        with psycopg.connect(url, autocommit=True) as admin:
            admin.execute(f'DROP TRIGGER refuse ON "{table}"')
            admin.execute(f'DROP FUNCTION "refuse_{table}"()')


@ON_REDIS
def test_a_lost_answer_of_the_joint_write(
    pair: tuple[EntityStore, DeduplicationStore], losing: _LosingAnswers
) -> None:
    entities, dedup = pair
    assert losing._joined(dedup)
    entity = _pending(entities, dedup, "m")
    version = entity.version
    del entity.outbox["m"]
    # the script ran, its answer was lost: the re-sent one finds its own token
    losing._redis.losses = 1
    losing._save_recording(entity, dedup, message_key("e", "m"))
    assert entity.version == version + 1
    assert dedup.has_been_processed(message_key("e", "m"))
    assert "m" not in entities.load("e").outbox

    # lost, and a rival saved on top before the re-send: unknown, never a conflict
    entity = _pending(entities, dedup, "n")
    del entity.outbox["n"]

    def rival_saves_on_top() -> None:
        rival = entities.load("e")
        assert "n" not in rival.outbox, "the lost attempt wrote"
        rival.state = {"rival": True}
        entities.save(rival)

    losing._redis.losses, losing._redis.meddle = 1, rival_saves_on_top
    with pytest.raises(StoreUnavailable, match="unknown") as caught:
        losing._save_recording(entity, dedup, message_key("e", "n"))
    assert caught.value.unknown == {message_key("e", "n")}
    assert dedup.has_been_processed(message_key("e", "n"))
    assert entities.load("e").state == {"rival": True}


# ---------------------------------------------------------------------- the harness


class _JointWithoutRecord:
    """BROKEN joint calls: the clean-up saves the entity and forgets the record; with
    ``check=False``, the save of a kept entity forgets the check instead."""

    def __init__(self, real: Any, check: bool = True) -> None:
        self._real, self._check = real, check

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def _save_recording(self, entity: Entity, dedup: Any, key: str) -> None:
        if self._check:
            self._real.save(entity)
        else:
            self._real._save_recording(entity, dedup, key)

    def _save_checked(self, entity: Entity, dedup: Any, key: str) -> bool:
        if self._check:
            return self._real._save_checked(entity, dedup, key)  # type: ignore[no-any-return]
        self._real.save(entity)
        return False


class JointForgetsTheRecord(OutboxProcessor):
    """BROKEN: the inline clean-up removes the entry without recording the id."""

    def __init__(self, entities: EntityStore, *args: Any, **kwargs: Any) -> None:
        super().__init__(_JointWithoutRecord(entities), *args, **kwargs)  # type: ignore[arg-type]


class JointForgetsTheCheck(OutboxProcessor):
    """BROKEN: applies a message the entity it kept lacks without asking the store."""

    def __init__(self, entities: EntityStore, *args: Any, **kwargs: Any) -> None:
        super().__init__(_JointWithoutRecord(entities, check=False), *args, **kwargs)  # type: ignore[arg-type]


@ON_JOINED
def test_the_harness_explores_and_checks_the_joint_calls(outbox_backend: OutboxBackend) -> None:
    one = Actor("process", (0,))
    options = patient(outbox_backend.name)  # (the harness checks the algorithm, not deadlines)
    entities = functools.partial(outbox_backend.entities, **options)
    dedup = functools.partial(outbox_backend.dedup, **options)
    runs = explore(Scenario((one, one), 1, "inline"), entities, dedup)
    assert runs >= 3
    with pytest.raises(InterleavingViolation) as caught:
        explore(
            Scenario((one, one), 1, "inline"),
            entities,
            dedup,
            processor=JointForgetsTheRecord,
        )
    assert caught.value.invariant in {"in-outbox-or-store", "once"}, str(caught.value)
    assert any("load_and_check" in step for step in caught.value.schedule)
    # a consumer that kept the entity, m0 redelivered to it
    again = Scenario((Actor("process", (0,), after=(0,)),), 1, "inline")
    assert explore(again, entities, dedup) == 1
    with pytest.raises(InterleavingViolation) as caught:
        explore(again, entities, dedup, processor=JointForgetsTheCheck)
    assert caught.value.invariant == "once", str(caught.value)
    assert caught.value.schedule == ["A:process(m0 after m0).save"]


# ---------------------------------------------------------------------- the save of a kept entity


@ON_JOINED
def test_the_save_of_a_kept_entity_writes_nothing_when_the_id_is_recorded(
    pair: tuple[EntityStore, DeduplicationStore],
) -> None:
    entities, dedup = pair
    kept = entities.load("e")
    kept.state = {"n": 1}
    entities.save(kept)
    version = kept.version
    dedup.add(message_key("e", "m"))
    kept.state = {"n": 2}
    assert entities._save_checked(kept, dedup, message_key("e", "m")) is True
    assert kept.version == version and entities.load("e").state == {"n": 1}
    assert entities._save_checked(kept, dedup, message_key("e", "other")) is False
    assert kept.version != version and entities.load("e").state == {"n": 2}
    stale = entities.load("e")
    entities.save(entities.load("e"))
    with pytest.raises(ConcurrencyConflict):
        entities._save_checked(stale, dedup, message_key("e", "new"))
    # a new entity (no version) is saved only while absent, the same way
    fresh = Entity("f", {"n": 1})
    assert entities._save_checked(fresh, dedup, message_key("f", "m")) is False
    with pytest.raises(ConcurrencyConflict):
        entities._save_checked(Entity("f", {"n": 9}), dedup, message_key("f", "m2"))


@ON_REDIS
def test_the_save_of_a_kept_entity_refuses_a_foreign_record(
    pair: tuple[EntityStore, DeduplicationStore], outbox_backend: OutboxBackend
) -> None:
    entities, dedup = pair
    processor = OutboxProcessor(entities, dedup, InMemoryDispatcher())
    processor.process(Message("m0", "e", {}), _handler)  # the processor keeps "e"
    stored = entities.load("e")
    admin = redis.Redis.from_url(outbox_backend.dedup_url.split("?")[0])
    try:
        admin.set(dedup.record_key(message_key("e", "m1")), "not ours")  # type: ignore[attr-defined]
        with pytest.raises(ConfigurationError, match="did not write"):
            processor.process(Message("m1", "e", {}), _handler)
        assert entities.load("e").version == stored.version
        # a key of another type where the record goes: refused as well
        processor.process(Message("m2", "e", {}), _handler)  # kept again
        stored = entities.load("e")
        admin.hset(dedup.record_key(message_key("e", "m3")), "x", "1")  # type: ignore[attr-defined]
        with pytest.raises(ConfigurationError):
            processor.process(Message("m3", "e", {}), _handler)
        assert entities.load("e").version == stored.version
    finally:
        admin.close()


@ON_REDIS
def test_a_lost_answer_of_the_save_of_a_kept_entity(
    pair: tuple[EntityStore, DeduplicationStore], losing: _LosingAnswers
) -> None:
    """Re-sent, the save finds its own token: saved, even once the id is recorded."""
    entities, dedup = pair
    kept = losing.load("e")
    kept.state = {"n": 1}
    losing.save(kept)
    kept.state = {"n": 2}

    def recorded_meanwhile() -> None:
        assert entities.load("e").state == {"n": 2}, "the lost attempt wrote"
        dedup.add(message_key("e", "m"))

    losing._redis.losses, losing._redis.meddle = 1, recorded_meanwhile
    assert losing._save_checked(kept, dedup, message_key("e", "m")) is False
    assert kept.version == 2 and entities.load("e").version == 2
    assert dedup.has_been_processed(message_key("e", "m")), "recorded before the re-send"
    # without the token (another call) the record stops the save
    kept.state = {"n": 3}
    assert losing._save_checked(kept, dedup, message_key("e", "m")) is True
    assert entities.load("e").version == 2


@ON_JOINED
def test_a_kept_entity_too_large_for_the_message_is_checked_before_the_error(
    pair: tuple[EntityStore, DeduplicationStore],
) -> None:
    """The save of a kept entity is refused before any I/O when the message makes it
    too large: a recorded id is still a duplicate, a new one ``EntityTooLarge``."""
    entities, dedup = pair
    processor = OutboxProcessor(entities, dedup, InMemoryDispatcher())

    def huge(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
        return {"blob": "x" * entities.max_entity_bytes}, []

    processor.process(Message("m0", "e", {}), _handler)  # kept
    dedup.add(message_key("e", "m1"))
    assert processor.process(Message("m1", "e", {}), huge).outcome == "duplicate"
    processor.process(Message("m2", "e", {}), _handler)  # kept again
    with pytest.raises(EntityTooLarge, match="m3"):
        processor.process(Message("m3", "e", {}), huge)
    assert entities.load("e").state == {"n": 2}
