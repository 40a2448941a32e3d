"""The entity store contract as a pytest base class.

Subclass :class:`EntityStoreContract` and provide ``entity_store_factory``: a callable
``(**options) -> EntityStore`` where every call opens a NEW client of the SAME
fresh, empty storage, reserved for the current test. An entity store that joins a
token store (``token_joins``) also subclasses :class:`JointTokenContract` and
provides ``token_store_factory`` too. A backend with a server also
subclasses :class:`EntityStoreRestartContract` and provides ``restartable``: a
factory on a server the test owns, and a callable that restarts that server
(stopping it and starting it again on the same address, data kept).
"""

from __future__ import annotations

import pickle
import random
import uuid
from collections.abc import Callable, Iterator

import pytest

from dedupstore.entities import BUCKETS, Entity, EntityStore, OutgoingMessage, bucket_of
from dedupstore.errors import (
    ConcurrencyConflict,
    EntityTooLarge,
    InvalidMessageId,
    InvalidValue,
    StoreClosed,
    StoreUnavailable,
)
from dedupstore.testing.contract import HOSTILE_IDS, INVALID_IDS, closing_clients, run_concurrently
from dedupstore.tokens import TokenChange, TokenStore

__all__ = [
    "EntityStoreContract",
    "EntityStoreFactory",
    "EntityStoreRestartContract",
    "JointTokenContract",
]

EntityStoreFactory = Callable[..., EntityStore]


def _eid(prefix: str = "e") -> str:
    return f"{prefix}-{uuid.uuid4()}"


def _message(mid: str, n: int = 0) -> OutgoingMessage:
    return OutgoingMessage(
        id=f"{mid}/out-{n}", destination="shipping", body={"n": n, "mid": mid}, headers={"k": "v"}
    )


class EntityStoreContract:
    """What every entity store guarantees; provide ``entity_store_factory``."""

    @pytest.fixture
    def entity_store_factory(self) -> EntityStoreFactory:
        """Open a new client of this test's fresh storage: override in the subclass."""
        raise NotImplementedError("provide an entity_store_factory fixture")

    @pytest.fixture
    def entity_clients(
        self, entity_store_factory: EntityStoreFactory
    ) -> Iterator[EntityStoreFactory]:
        """``entity_store_factory``, every store it opens closed after the test."""
        yield from closing_clients(entity_store_factory)

    @pytest.fixture
    def entities(self, entity_clients: EntityStoreFactory) -> EntityStore:
        """An entity store, closed after the test."""
        return entity_clients()

    # ------------------------------------------------------------------ basics

    def test_an_absent_entity_loads_new_and_empty(self, entities: EntityStore) -> None:
        eid = _eid()
        entity = entities.load(eid)
        assert entity == Entity(eid)
        assert entity.version is None

    def test_save_then_load_round_trips(self, entities: EntityStore) -> None:
        eid = _eid()
        entity = entities.load(eid)
        entity.state = {"items": ["a", "é", "🦄"], "count": 3, "nested": {"x": [1.5, None, True]}}
        entity.outbox["m-1"] = [_message("m-1", 0), _message("m-1", 1)]
        entity.outbox["m-0"] = None
        saved = entities.save(entity)
        assert saved.version is not None
        loaded = entities.load(eid)
        assert loaded.state == entity.state
        assert loaded.outbox == entity.outbox
        assert loaded.version == saved.version
        assert loaded.pending == ["m-1"] and loaded.dispatched == ["m-0"]

    def test_a_stale_save_conflicts(self, entity_clients: EntityStoreFactory) -> None:
        a, b = entity_clients(), entity_clients()
        eid = _eid()
        first = a.load(eid)
        first.state = {"v": 1}
        a.save(first)
        one, two = a.load(eid), b.load(eid)
        one.state = {"v": 2}
        a.save(one)
        two.state = {"v": 3}
        with pytest.raises(ConcurrencyConflict):
            b.save(two)
        assert b.load(eid).state == {"v": 2}
        again = b.load(eid)
        again.state = {"v": 3}
        b.save(again)
        assert a.load(eid).state == {"v": 3}

    def test_two_creators_of_one_new_entity_conflict(self, entities: EntityStore) -> None:
        eid = _eid()
        one, two = entities.load(eid), entities.load(eid)
        one.state, two.state = {"by": "one"}, {"by": "two"}
        entities.save(one)
        with pytest.raises(ConcurrencyConflict):
            entities.save(two)
        assert entities.load(eid).state == {"by": "one"}

    def test_concurrent_savers_exactly_one_wins_per_round(
        self, entity_clients: EntityStoreFactory
    ) -> None:
        clients = [entity_clients() for _ in range(4)]
        eid = _eid()

        def increment(index: int) -> int:
            done = 0
            while done < 10:
                entity = clients[index].load(eid)
                entity.state = {"count": entity.state.get("count", 0) + 1}
                try:
                    clients[index].save(entity)
                    done += 1
                except ConcurrencyConflict:
                    continue
            return done

        assert sum(run_concurrently(increment, len(clients))) == 40
        assert clients[0].load(eid).state == {"count": 40}, "an increment was lost"

    # ------------------------------------------------------------------ batches

    def test_load_many_and_save_many_with_partial_conflicts(self, entities: EntityStore) -> None:
        ids = [_eid() for _ in range(5)]
        loaded = entities.load_many(ids)
        assert set(loaded) == set(ids) and all(e.version is None for e in loaded.values())
        for n, eid in enumerate(ids):
            loaded[eid].state = {"n": n}
        assert entities.save_many(list(loaded.values())) == set()
        fresh = entities.load_many(ids)
        stale = entities.load_many(ids[:2])
        for eid in ids[:2]:
            fresh[eid].state = {"n": "fresh"}
        entities.save_many([fresh[eid] for eid in ids[:2]])
        batch = [*stale.values(), *(fresh[eid] for eid in ids[2:])]
        for entity in batch:
            entity.state = {"n": "batch"}
        assert entities.save_many(batch) == set(ids[:2])
        after = entities.load_many(ids)
        assert [after[eid].state["n"] for eid in ids] == [
            "fresh",
            "fresh",
            "batch",
            "batch",
            "batch",
        ]

    def test_many_entities_in_several_chunks(self, entities: EntityStore) -> None:
        ids = [
            _eid("chunk")
            for _ in range(max(entities.max_load_batch, entities.max_save_batch) * 2 + 3)
        ]
        loaded = entities.load_many(ids)
        for eid in ids:
            loaded[eid].state = {"id": eid}
        assert entities.save_many(list(loaded.values())) == set()
        again = entities.load_many(reversed(ids))
        assert all(again[eid].state == {"id": eid} for eid in ids)

    # ------------------------------------------------------------------ segments

    def test_segments_are_disjoint_and_complete(self, entities: EntityStore) -> None:
        pending = [_eid("pending") for _ in range(60)]
        empty = [_eid("empty") for _ in range(10)]
        loaded = entities.load_many(pending + empty)
        for eid in pending:
            loaded[eid].outbox["m"] = None if random.random() < 0.5 else [_message(eid)]
        for eid in empty:
            loaded[eid].state = {"quiet": True}
        entities.save_many(list(loaded.values()))
        for segments in (1, 3, 7):
            seen: list[str] = []
            for segment in range(segments):
                seen += [e.id for e in entities.pending_outboxes(segment, segments)]
            mine = [eid for eid in seen if eid in loaded]
            assert sorted(mine) == sorted(pending), f"segments of {segments} overlap or miss"
        assert all(0 <= bucket_of(eid) < BUCKETS for eid in pending)

    def test_an_emptied_outbox_leaves_the_scan(self, entities: EntityStore) -> None:
        eid = _eid()
        entity = entities.load(eid)
        entity.outbox["m"] = None
        entities.save(entity)
        assert eid in {e.id for e in entities.pending_outboxes()}
        entity = entities.load(eid)
        del entity.outbox["m"]
        entities.save(entity)
        assert eid not in {e.id for e in entities.pending_outboxes()}

    def test_bad_segments_are_refused(self, entities: EntityStore) -> None:
        for segment, segments in ((0, 0), (3, 3), (-1, 2)):
            with pytest.raises(ValueError):
                list(entities.pending_outboxes(segment, segments))

    # ------------------------------------------------------------------ limits and ids

    def test_an_entity_too_large_fails_before_any_write(self, entities: EntityStore) -> None:
        eid = _eid()
        entity = entities.load(eid)
        entity.state = {"blob": "x" * (entities.max_entity_bytes + 1)}
        with pytest.raises(EntityTooLarge):
            entities.save(entity)
        assert entities.load(eid).version is None, "nothing may be written"
        entity.state = {"blob": "x" * (entities.max_entity_bytes // 2)}
        entities.save(entity)
        assert len(entities.load(eid).state["blob"]) == entities.max_entity_bytes // 2

    def test_state_must_be_json_compatible(self, entities: EntityStore) -> None:
        entity = entities.load(_eid())
        entity.state = {"when": object()}
        with pytest.raises(ValueError):
            entities.save(entity)
        entity.state = {"nan": float("nan")}
        with pytest.raises(ValueError):
            entities.save(entity)
        # a key that is not str would reload as text: refused, naming where
        entity.state = {"a": [{7: "seven"}]}
        with pytest.raises(InvalidValue, match=r'state\["a"\]\[0\]\[7\]'):
            entities.save(entity)
        assert entities.load(entity.id).version is None

    @pytest.mark.parametrize("eid", HOSTILE_IDS[::3], ids=range(len(HOSTILE_IDS[::3])))
    def test_hostile_ids_round_trip(self, entities: EntityStore, eid: str) -> None:
        entity = entities.load(eid)
        entity.state = {"id": eid}
        entity.outbox[eid] = [_message(eid)]
        entities.save(entity)
        loaded = entities.load(eid)
        assert loaded.state == {"id": eid} and loaded.outbox == entity.outbox

    @pytest.mark.parametrize(("why", "bad"), INVALID_IDS, ids=[w for w, _ in INVALID_IDS])
    def test_invalid_ids_are_rejected_before_any_io(
        self, entity_store_factory: EntityStoreFactory, why: str, bad: object
    ) -> None:
        store = entity_store_factory()
        store.close()
        with pytest.raises(InvalidMessageId):
            store.load(bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidMessageId):
            store.save(Entity(bad))  # type: ignore[arg-type]

    # ------------------------------------------------------------------ lifecycle

    def test_pickles_by_configuration(self, entities: EntityStore) -> None:
        eid = _eid()
        entity = entities.load(eid)
        entity.state = {"a": 1}
        entities.save(entity)
        clone = pickle.loads(pickle.dumps(entities))
        assert clone.load(eid).state == {"a": 1}
        clone.close()

    def test_use_after_close_is_store_closed(
        self, entity_store_factory: EntityStoreFactory
    ) -> None:
        store = entity_store_factory()
        store.close()
        store.close()
        with pytest.raises(StoreClosed):
            store.load(_eid())
        with pytest.raises(StoreClosed):
            list(store.pending_outboxes())


class EntityStoreRestartContract:
    """An open entity store outlives a restart of its server; provide ``restartable``."""

    @pytest.fixture
    def restartable(self) -> tuple[EntityStoreFactory, Callable[[], None]]:
        """``(factory, restart)`` on a server this test owns: override in the subclass."""
        raise NotImplementedError("provide a restartable fixture")

    def test_an_open_store_reconnects_after_a_server_restart(
        self, restartable: tuple[EntityStoreFactory, Callable[[], None]]
    ) -> None:
        factory, restart = restartable
        store = factory()
        eid = _eid()
        entity = store.load(eid)
        entity.state, entity.outbox["m"] = {"n": 1}, [_message("m")]
        store.save(entity)
        restart()
        failures = 0
        while True:  # the first call may meet the dead connection: an error, never a guess
            try:
                loaded = store.load(eid)
                break
            except StoreUnavailable:
                failures += 1
                assert failures < 3, "the store did not reconnect"
        assert loaded.state == {"n": 1} and loaded.version == entity.version
        stale = loaded.copy()
        loaded.state = {"n": 2}
        store.save(loaded)
        with pytest.raises(ConcurrencyConflict):
            store.save(stale)
        assert eid in {e.id for e in store.pending_outboxes()}
        store.close()


class JointTokenContract:
    """What an entity store that joins a token store (``token_joins``: it implements
    ``_load_with_token`` and ``_save_tokens``) guarantees of the joint calls; provide
    ``entity_store_factory`` and ``token_store_factory``, each opening a new client of
    this test's fresh storage, the two sharing one connection (one file, one server)."""

    @pytest.fixture
    def entity_store_factory(self) -> EntityStoreFactory:
        """Open a new entity store client: override in the subclass."""
        raise NotImplementedError("provide an entity_store_factory fixture")

    @pytest.fixture
    def token_store_factory(self) -> Callable[..., TokenStore]:
        """Open a new token store client (the entity store's connection): override."""
        raise NotImplementedError("provide a token_store_factory fixture")

    @pytest.fixture
    def joined(
        self,
        entity_store_factory: EntityStoreFactory,
        token_store_factory: Callable[..., TokenStore],
    ) -> Iterator[tuple[EntityStore, TokenStore]]:
        """An entity store and a token store, closed after the test."""
        entities, tokens = entity_store_factory(), token_store_factory()
        yield entities, tokens
        entities.close()
        tokens.close()

    def test_the_stores_join(self, joined: tuple[EntityStore, TokenStore]) -> None:
        entities, tokens = joined
        assert entities._tokens_joined(tokens)
        assert 1 <= entities.joint_token_limit(tokens) <= tokens.max_batch

    def test_a_joint_save_writes_its_tokens_only_with_its_entity(
        self, joined: tuple[EntityStore, TokenStore]
    ) -> None:
        entities, tokens = joined
        tag = uuid.uuid4().hex[:8]
        required, old, kept = f"req-{tag}", f"old-{tag}", f"kept-{tag}"
        tokens.create({required: "me", old: "me", kept: "me"})
        stale_id, fresh_id, lacking_id = _eid("stale"), _eid("fresh"), _eid("lacking")
        rival = entities.load(stale_id)
        rival.state = {"v": 1}
        entities.save(rival)
        stale = entities.load(stale_id)
        rival.state = {"v": 2}
        entities.save(rival)  # ``stale`` conflicts now
        fresh, lacking = entities.load(fresh_id), entities.load(lacking_id)
        fresh.state, stale.state, lacking.state = {"v": 1}, {"v": 3}, {"v": 1}
        fresh.outbox["m"] = [_message("m")]  # pending: listed for the scan
        missing, conflicts = entities._save_tokened(
            [fresh, stale, lacking],
            tokens,
            {
                fresh_id: TokenChange(required, {f"new-{tag}": "next"}, (old,)),
                stale_id: TokenChange(None, {f"conflict-{tag}": "next"}, (kept,)),
                lacking_id: TokenChange(f"absent-{tag}", {f"missing-{tag}": "next"}, (required,)),
            },
        )
        assert (missing, conflicts) == ({lacking_id}, {stale_id})
        assert fresh.version is not None and entities.load(fresh_id) == fresh
        assert fresh_id in {e.id for e in entities.pending_outboxes()}
        assert entities.load(stale_id).state == {"v": 2}
        assert entities.load(lacking_id).version is None, "a missing token writes nothing"
        names = [required, f"new-{tag}", old, f"conflict-{tag}", kept, f"missing-{tag}"]
        assert tokens.present_among(names) == {required, f"new-{tag}", kept}
        assert [t.id for t in tokens.scan(endpoint="next")] == [f"new-{tag}"]

    def test_a_joint_save_without_token_writes_is_a_save(
        self, joined: tuple[EntityStore, TokenStore]
    ) -> None:
        entities, tokens = joined
        entity = entities.load(_eid())
        entity.state = {"v": 1}
        assert entities._save_tokened([entity], tokens, {}) == (set(), set())
        assert entities.load(entity.id) == entity
        entity.state = {"v": 2}
        entities.save(entity)
        assert entities.load(entity.id).version == entity.version

    def test_concurrent_joint_saves_of_one_version_one_wins_with_only_its_tokens(
        self,
        entity_store_factory: EntityStoreFactory,
        token_store_factory: Callable[..., TokenStore],
    ) -> None:
        eid = _eid("raced")
        with entity_store_factory() as setup:
            base = setup.load(eid)
            setup.save(base)
        clients = [(entity_store_factory(), token_store_factory()) for _ in range(4)]
        loaded = [entities.load(eid) for entities, _ in clients]  # one version, all of them

        def save(i: int) -> tuple[set[str], set[str]]:
            entities, tokens = clients[i]
            entity = loaded[i]
            entity.state = {"by": i}
            change = TokenChange(None, {f"{eid}-by-{i}": "next"})
            return entities._save_tokened([entity], tokens, {eid: change})

        try:
            outcomes = run_concurrently(save, len(clients))
            won = [i for i, (_, conflicts) in enumerate(outcomes) if not conflicts]
            entities, tokens = clients[0]
            present = tokens.present_among([f"{eid}-by-{i}" for i in range(len(clients))])
            assert len(won) == 1, outcomes
            assert entities.load(eid).state == {"by": won[0]}
            assert present == {f"{eid}-by-{won[0]}"}, "a token of a save that lost"
        finally:
            for entities, tokens in clients:
                entities.close()
                tokens.close()

    def test_joint_calls_check_everything_before_any_io(
        self, joined: tuple[EntityStore, TokenStore]
    ) -> None:
        entities, tokens = joined
        entity = entities.load(_eid())
        entity.state = {"v": 1}
        for bad in [value for _, value in INVALID_IDS if isinstance(value, str)][:4]:
            with pytest.raises(InvalidMessageId):
                entities._save_tokened([entity], tokens, {entity.id: TokenChange(None, {bad: "x"})})
            with pytest.raises(InvalidMessageId):
                entities._save_tokened([entity], tokens, {entity.id: TokenChange(bad, {})})
            with pytest.raises(InvalidMessageId):
                entities._load_tokened(entity.id, tokens, bad)
        over = entities.joint_token_limit(tokens) + 1
        too_many = {f"t{i}-{uuid.uuid4().hex[:6]}": "x" for i in range(over)}
        with pytest.raises(ValueError, match="joint_token_limit"):
            entities._save_tokened([entity], tokens, {entity.id: TokenChange(None, too_many)})
        huge = entities.load(_eid())
        huge.state = {"blob": "x" * (entities.max_entity_bytes + 1)}
        with pytest.raises(EntityTooLarge):
            entities._save_tokened([huge], tokens, {huge.id: TokenChange(None, {"t-huge": "x"})})
        assert entities.load(entity.id).version is None and not tokens.present("t-huge")

    def test_the_joint_load_reads_the_entity_and_then_the_token(
        self, joined: tuple[EntityStore, TokenStore]
    ) -> None:
        entities, tokens = joined
        eid, tid = _eid(), f"t-{uuid.uuid4()}"
        entity, present = entities._load_tokened(eid, tokens, tid)
        assert entity == Entity(eid) and entity.version is None and not present
        entity.state = {"v": 1}
        entities.save(entity)
        tokens.create({tid: "me"})
        loaded, present = entities._load_tokened(eid, tokens, tid)
        assert loaded == entity and present
        tokens.delete([tid])
        assert entities._load_tokened(eid, tokens, tid) == (entity, False)
