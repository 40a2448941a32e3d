"""The entity store contract on Redis, and what is specific to the Redis entity store."""

from __future__ import annotations

import pickle
import threading
import uuid
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

import dedupstore
from dedupstore.backends.redis import (
    RedisEntityStore,
    buckets_key,
    entity_key,
    pending_key,
    record_key,
)
from dedupstore.backends.redis._client import RedisConnection
from dedupstore.backends.redis.entities import _PRUNE_SCRIPT
from dedupstore.client import Connected
from dedupstore.entities import Entity, OutgoingMessage, bucket_of, encode_entity
from dedupstore.errors import (
    ConcurrencyConflict,
    ConfigurationError,
    EntityTooLarge,
    StoreUnavailable,
)
from dedupstore.options import Options
from dedupstore.registry import resolve
from dedupstore.testing.entities import (
    EntityStoreContract,
    EntityStoreFactory,
    EntityStoreRestartContract,
)
from dedupstore.urls import StoreURL
from tests.servers import HOST, RedisServer, Server, free_port
from tests.test_redis import _ReplyDroppingProxy

pytestmark = pytest.mark.redis


def _prefix() -> str:
    return f"test-ent-{uuid.uuid4().hex}:"


def _admin(url: str) -> redis.Redis:
    return redis.Redis.from_url(url)


def _calls(admin: redis.Redis, command: str) -> int:
    stats = admin.info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


def _message(mid: str) -> OutgoingMessage:
    return OutgoingMessage(f"{mid}/out", "shipping", {"mid": mid})


class TestRedisEntityStore(EntityStoreContract):
    @pytest.fixture
    def entity_store_factory(self, redis_server: Server) -> EntityStoreFactory:
        url, prefix = redis_server.url, _prefix()
        return lambda **options: RedisEntityStore(url, **{"key_prefix": prefix, **options})


class TestRedisEntityStoreRestart(EntityStoreRestartContract):
    @pytest.fixture
    def restartable(
        self, own_redis_server: RedisServer
    ) -> tuple[EntityStoreFactory, Callable[[], None]]:
        url, prefix = own_redis_server.url, _prefix()

        def factory(**options: Any) -> RedisEntityStore:
            return RedisEntityStore(url, **{"key_prefix": prefix, **options})

        return factory, own_redis_server.restart


@pytest.fixture
def store(redis_server: Server) -> Iterator[RedisEntityStore]:
    with RedisEntityStore(redis_server.url, key_prefix=_prefix()) as entities:
        yield entities


@pytest.fixture
def admin(redis_server: Server) -> Iterator[redis.Redis]:
    client = _admin(redis_server.url)
    yield client
    client.close()


# ---------------------------------------------------------------------- layout


def test_record_layout_on_the_server(store: RedisEntityStore, admin: redis.Redis) -> None:
    prefix = store.option("key_prefix")
    eid = "order:{7}%"
    key = f"{prefix}e:order%3A%7B7%7D%25"
    assert entity_key(prefix, eid) == key
    entity = store.load(eid)
    entity.state = {"n": 1}
    entity.outbox["m-1"] = [_message("m-1")]
    store.save(entity)
    fields = admin.hgetall(key)
    assert set(fields) == {b"b", b"v", b"t", b"p", b"i"}
    assert fields[b"b"] == encode_entity(entity).encode()
    assert fields[b"v"] == b"1" and fields[b"p"] == b"1" and len(fields[b"t"]) == 32
    assert fields[b"i"] == b"1", "the hash says its id is in its bucket's set"
    pending = f"{prefix}pending:{bucket_of(eid)}"
    assert pending == pending_key(prefix, bucket_of(eid))
    assert admin.smembers(pending) == {eid.encode()}
    assert admin.smembers(buckets_key(prefix)) == {str(bucket_of(eid)).encode()}
    first_token = fields[b"t"]

    entity.outbox["m-1"] = None  # dispatched, not yet moved to the dedup store: still pending
    store.save(entity)
    assert admin.hget(key, "v") == b"2" and admin.hget(key, "p") == b"1"
    assert admin.hget(key, "t") != first_token, "every save writes its own token"
    assert entity.version == 2

    entity.outbox.clear()
    store.save(entity)
    assert admin.hmget(key, "v", "p", "i") == [b"3", b"0", b"1"]
    assert admin.smembers(pending) == {eid.encode()}, "the set keeps it until a scan"
    assert list(store.pending_outboxes()) == []
    assert admin.hmget(key, "v", "p", "i") == [b"3", b"0", None], "the scan pruned it"
    assert admin.exists(pending) == 0, "an empty outbox leaves its bucket's set"
    assert admin.exists(buckets_key(prefix)) == 0, "an empty bucket leaves the index"
    assert sorted(admin.scan_iter(match=f"{prefix}*")) == [key.encode()]

    entity.outbox["m-2"] = [_message("m-2")]  # pending again: back in the set
    store.save(entity)
    assert admin.smembers(pending) == {eid.encode()}
    assert admin.hget(key, "i") == b"1"
    assert [e.id for e in store.pending_outboxes()] == [eid]


def _colliding_ids() -> list[str]:
    """Nine entity ids, three in each of three buckets."""
    by_bucket: dict[int, list[str]] = {}
    for n in range(100_000):
        eid = f"e-{n}"
        ids = by_bucket.setdefault(bucket_of(eid), [])
        ids.append(eid)
        if len(ids) == 3 and sum(len(v) == 3 for v in by_bucket.values()) == 3:
            return [e for v in by_bucket.values() if len(v) == 3 for e in v]
    raise AssertionError("no collisions found")


_SHARED = _colliding_ids()


@settings(max_examples=40, deadline=None)
@given(
    steps=st.lists(
        st.dictionaries(st.sampled_from(_SHARED), st.booleans(), min_size=1, max_size=9)
        | st.just({}),  # {}: a scan
        min_size=1,
        max_size=8,
    )
)
def test_pending_sets_and_index_follow_a_plain_model(
    redis_server: Server, steps: list[dict[str, bool]]
) -> None:
    """Saves of entities sharing buckets, pending or not, several per call, and scans
    in between: a pending entity is always in its bucket's set and its bucket in the
    index (the sweep finds it); an id is in a set exactly when its hash says so; a
    scan yields exactly the pending entities and leaves exactly them in the sets."""
    prefix = _prefix()
    client = _admin(redis_server.url)
    buckets = {bucket_of(e) for e in _SHARED}
    with RedisEntityStore(redis_server.url, key_prefix=prefix) as store:
        entities: dict[str, Entity] = {}
        pending: dict[str, bool] = {}
        for step in steps:
            batch = []
            for eid, is_pending in step.items():
                entity = entities.setdefault(eid, Entity(eid))
                entity.outbox = {"m": [_message("m")]} if is_pending else {}
                batch.append(entity)
                pending[eid] = is_pending
            if batch:
                assert store.save_many(batch) == set()
            else:
                found = sorted(e.id for e in store.pending_outboxes())
                assert found == sorted(e for e, p in pending.items() if p)
            members = {b: client.smembers(pending_key(prefix, b)) for b in buckets}
            index = client.smembers(buckets_key(prefix))
            for eid, is_pending in pending.items():
                listed = eid.encode() in members[bucket_of(eid)]
                assert listed == (client.hget(entity_key(prefix, eid), "i") == b"1")
                if is_pending:
                    assert listed and str(bucket_of(eid)).encode() in index
            assert index == {str(b).encode() for b, ids in members.items() if ids}
            if not batch:  # a scan leaves exactly the pending ids
                expected: dict[int, set[bytes]] = {b: set() for b in buckets}
                for eid, is_pending in pending.items():
                    if is_pending:
                        expected[bucket_of(eid)].add(eid.encode())
                assert members == expected
    client.close()


def test_a_scan_never_prunes_an_entity_saved_pending_meanwhile(
    store: RedisEntityStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scan reads an entity as not pending; before it prunes the id, the entity is
    saved pending again (its hash says it is in the set, so the save does not add it):
    the prune checks again and keeps it, and the next sweep finds it."""
    entity = Entity("racy", outbox={"m-1": [_message("m-1")]})
    store.save(entity)
    entity.outbox = {}
    store.save(entity)  # not pending, still in its bucket's set
    connection = store._redis  # type: ignore[attr-defined]
    run_script = connection.run_script

    def racing(client: Any, source: str, *args: Any) -> Any:
        if source == _PRUNE_SCRIPT:
            entity.outbox = {"m-2": [_message("m-2")]}
            store.save(entity)
        return run_script(client, source, *args)

    monkeypatch.setattr(connection, "run_script", racing)
    assert list(store.pending_outboxes()) == [], "read before the save"
    monkeypatch.undo()
    assert [e.id for e in store.pending_outboxes()] == ["racy"]


def test_entities_and_dedup_records_never_share_keys(redis_server: Server) -> None:
    eid = f"shared-{uuid.uuid4()}"
    with (
        dedupstore.open_store(redis_server.url) as dedup,
        dedupstore.open_entity_store(redis_server.url) as entities,
        _admin(redis_server.url) as admin,
    ):
        assert isinstance(entities, RedisEntityStore)
        assert entities.option("key_prefix") == "dedupent:"
        assert dedup.option("key_prefix") == "dedup:"
        dedup.add(eid)
        entity = entities.load(eid)
        entity.state = {"x": 1}
        entities.save(entity)
        assert admin.type(record_key("dedup:", "default", eid)) == b"string"
        assert admin.type(entity_key("dedupent:", eid)) == b"hash"
        assert dedup.has_been_processed(eid) and entities.load(eid).state == {"x": 1}


def test_open_by_url_and_pickle(redis_server: Server) -> None:
    prefix = _prefix()
    url = f"{redis_server.url}?key_prefix={prefix}&timeout=2&retries=1"
    assert resolve("entity_store", "rediss") is RedisEntityStore
    with dedupstore.open_entity_store(url, connect_timeout="1.5") as store:
        entity = store.load("p")
        entity.state = {"p": True}
        store.save(entity)
        clone = pickle.loads(pickle.dumps(store))
        try:
            assert isinstance(clone, RedisEntityStore)
            assert (clone.option("key_prefix"), clone.option("timeout")) == (prefix, 2.0)
            assert (clone.option("retries"), clone.option("connect_timeout")) == (1, 1.5)
            assert clone.load("p").state == {"p": True}
        finally:
            clone.close()


# ---------------------------------------------------------------------- size limit


def _blob_entity(eid: str, size: int) -> Entity:
    """An entity whose canonical JSON is exactly ``size`` bytes."""
    overhead = len(encode_entity(Entity(eid, {"blob": ""})).encode())
    entity = Entity(eid, {"blob": "é" * ((size - overhead) // 2) + "x" * ((size - overhead) % 2)})
    assert len(encode_entity(entity).encode()) == size
    return entity


def test_the_largest_entity_is_stored_one_byte_more_is_refused(
    store: RedisEntityStore, admin: redis.Redis
) -> None:
    limit = RedisEntityStore.max_entity_bytes
    assert limit == 4 * 1024 * 1024
    largest = _blob_entity("largest", limit)
    store.save(largest)
    assert store.load("largest").state == largest.state
    assert admin.hstrlen(entity_key(store.option("key_prefix"), "largest"), "b") == limit
    too_large = _blob_entity("too-large", limit + 1)
    with pytest.raises(EntityTooLarge):
        store.save(too_large)
    with pytest.raises(EntityTooLarge):
        store.save_many([Entity("small"), too_large])
    assert store.load_many(["too-large", "small"]) == {
        "too-large": Entity("too-large"),
        "small": Entity("small"),
    }, "nothing was written"


def test_a_batch_of_large_entities_is_split_by_bytes(own_redis_server: RedisServer) -> None:
    """Five entities of about 4 MiB: two script calls of at most 16 MiB, all saved."""
    store = RedisEntityStore(own_redis_server.url, key_prefix=_prefix())
    admin = _admin(own_redis_server.url)
    try:
        big = [_blob_entity(f"big-{n}", store.max_entity_bytes - 100 - n) for n in range(5)]
        for n, entity in enumerate(big):
            entity.outbox[f"m{n}"] = None
        before = _calls(admin, "evalsha")
        assert store.save_many(big) == set()
        assert _calls(admin, "evalsha") - before == 2
        loaded = store.load_many([e.id for e in big])
        assert all(loaded[e.id].state == e.state and loaded[e.id].version == 1 for e in big)
        assert sorted(e.id for e in store.pending_outboxes()) == sorted(e.id for e in big)
    finally:
        store.close()
        admin.close()


# ---------------------------------------------------------------------- round trips and scan


def test_one_round_trip_per_chunk(own_redis_server: RedisServer) -> None:
    """A save script carries up to max_save_batch (500) entities: one flush each."""
    store = RedisEntityStore(own_redis_server.url, key_prefix=_prefix())
    admin = _admin(own_redis_server.url)
    try:
        assert store.max_save_batch == 500
        ids = [f"rt-{n}" for n in range(2 * store.max_save_batch + 1)]
        loaded = store.load_many(ids)
        for entity in loaded.values():
            entity.state = {"id": entity.id}
        before = _calls(admin, "evalsha")
        assert store.save_many(list(loaded.values())) == set()
        assert _calls(admin, "evalsha") - before == 3
        for entity in loaded.values():
            entity.state = {"again": True}
        before = _calls(admin, "evalsha")
        assert store.save_many(list(loaded.values())) == set()
        assert _calls(admin, "evalsha") - before == 3
        assert all(e.version == 2 for e in store.load_many(ids).values())
    finally:
        store.close()
        admin.close()


def _ids_in_bucket(bucket: int, count: int) -> list[str]:
    ids: list[str] = []
    n = 0
    while len(ids) < count:
        candidate = f"crowd-{n}"
        if bucket_of(candidate) == bucket:
            ids.append(candidate)
        n += 1
    return ids


def test_scan_pages_through_a_big_bucket_and_skips_stale_ids(
    store: RedisEntityStore, admin: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A set larger than one SSCAN page (a hashtable set), read a page of bodies at a time."""
    bucket = 5
    ids = _ids_in_bucket(bucket, 260)
    loaded = store.load_many(ids)
    for eid in ids:
        loaded[eid].outbox["m"] = [_message(eid)]
    store.save_many(list(loaded.values()))
    prefix = store.option("key_prefix")
    assert admin.object("encoding", pending_key(prefix, bucket)) == b"hashtable"
    # an id whose entity is gone, and one whose entity is no longer pending
    admin.delete(entity_key(prefix, ids[0]))
    admin.hset(entity_key(prefix, ids[1]), "p", "0")
    pages: list[int] = []
    read_page = store._read_page

    def spy(page: list[str]) -> Iterator[tuple[str, str, Any]]:
        pages.append(len(page))
        return read_page(page)

    monkeypatch.setattr(store, "_read_page", spy)
    segments = 8
    seen = [e.id for e in store.pending_outboxes(bucket % segments, segments)]
    assert sorted(seen) == sorted(ids[2:]), "each pending id once"
    assert max(pages) <= store.max_load_batch and sum(pages) == len(ids)
    others = [
        e.id
        for s in range(segments)
        if s != bucket % segments
        for e in store.pending_outboxes(s, segments)
    ]
    assert not set(others) & set(ids)


# ---------------------------------------------------------------------- options and errors


@pytest.mark.parametrize(
    ("url_tail", "options", "match"),
    [
        ("/0", {"key_prefix": "no-colon"}, "key_prefix"),
        ("/0?key_prefix=x", {}, "key_prefix"),
        ("/notadb", {}, "database number"),
        ("/0", {"timeout": "-1"}, "timeout"),
        ("/0", {"retries": "many"}, "retries"),
        ("/0", {"wait_replicas": 1, "wait_timeout_ms": 9000}, "shorter than timeout"),
        ("/0", {"endpoint": "orders"}, "endpoint"),
        ("/0", {"client": object()}, "redis.Redis"),
        ("/0", {"ssl_ca_certs": "/tmp/ca.pem"}, "rediss"),
    ],
)
def test_bad_options_fail_before_any_io(url_tail: str, options: dict[str, Any], match: str) -> None:
    url = f"redis://{HOST}:{free_port()}{url_tail}"  # nothing listens there
    with pytest.raises(ConfigurationError, match=match) as info:
        dedupstore.open_entity_store(url, **options)
    assert "\n" not in str(info.value)


def test_foreign_keys_under_the_prefix_are_configuration_errors(
    store: RedisEntityStore, admin: redis.Redis
) -> None:
    prefix = store.option("key_prefix")
    admin.set(entity_key(prefix, "a-string"), "x")
    admin.hset(entity_key(prefix, "a-hash"), "field", "value")
    admin.hset(entity_key(prefix, "a-half"), "b", "{}")
    for eid in ("a-string", "a-half"):
        with pytest.raises(ConfigurationError, match="did not write"):
            store.load(eid)
    assert store.load("a-hash").version is None, "HMGET sees a hash without b and v as absent"
    for eid in ("a-string", "a-hash", "a-half"):
        entity = Entity(eid, {"n": 1})
        with pytest.raises(ConfigurationError, match="did not write"):
            store.save(entity)
        with pytest.raises(ConfigurationError, match="did not write"):
            store.save_many([Entity("fresh", {"n": 1}), entity])
    # a pending set of another type: the save refuses before writing anything
    admin.set(pending_key(prefix, bucket_of("pending-one")), "not a set")
    entity = Entity("pending-one", outbox={"m": None})
    with pytest.raises(ConfigurationError, match="did not write"):
        store.save_many([Entity("fresh", {"n": 1}), entity])
    assert admin.exists(entity_key(prefix, "fresh")) == 0, "a failed chunk writes nothing"
    admin.delete(pending_key(prefix, bucket_of("pending-one")))
    admin.set(buckets_key(prefix), "not a set")  # the index of another type: refused too
    with pytest.raises(ConfigurationError, match="did not write"):
        store.save_many([Entity("fresh", {"n": 1}), entity, Entity("p2", outbox={"m": None})])
    assert admin.exists(entity_key(prefix, "fresh")) == 0, "a failed chunk writes nothing"
    assert admin.type(entity_key(prefix, "a-string")) == b"string", "foreign keys are left alone"


def test_a_server_that_is_down(own_redis_server: RedisServer) -> None:
    with pytest.raises(StoreUnavailable) as info:
        RedisEntityStore(f"redis://:pw-secret@{HOST}:{free_port()}/0", connect_timeout=1)
    assert "pw-secret" not in str(info.value) and "\n" not in str(info.value)
    assert isinstance(info.value.__cause__, redis.ConnectionError)

    store = RedisEntityStore(own_redis_server.url, key_prefix=_prefix(), retries=1)
    try:
        entity = store.load("e")
        entity.outbox["m"] = None
        store.save(entity)
        own_redis_server.kill()
        for call in (
            lambda: store.load("e"),
            lambda: store.save(entity),
            lambda: list(store.pending_outboxes()),
            store.health_warnings,
        ):
            with pytest.raises(StoreUnavailable) as info:
                call()
            assert isinstance(info.value.__cause__, redis.ConnectionError), info.value.__cause__
        own_redis_server.restart()
        assert store.load("e").version == 1, "the failed save wrote nothing"
        store.save(entity)
        assert store.load("e").version == 2
    finally:
        store.close()


def test_health_warnings(own_redis_server: RedisServer) -> None:
    store = RedisEntityStore(own_redis_server.url, key_prefix=_prefix())
    admin = _admin(own_redis_server.url)
    try:
        assert store.health_warnings() == []
        admin.config_set("appendfsync", "everysec")
        (warning,) = store.health_warnings()
        assert "appendfsync" in warning
    finally:
        store.close()
        admin.close()


def test_wait_replicas_without_replicas_is_unknown_durability(
    redis_server: Server,
) -> None:
    prefix = _prefix()
    store = RedisEntityStore(
        redis_server.url, key_prefix=prefix, wait_replicas=1, wait_timeout_ms=50
    )
    try:
        entity = store.load("w")
        entity.state = {"w": 1}
        with pytest.raises(StoreUnavailable, match="durability is unknown"):
            store.save(entity)
        assert entity.version is None
        assert store.load("w").version == 1, "the entity is on the primary"
    finally:
        store.close()


# ---------------------------------------------------------------------- lost answers


@pytest.fixture
def proxy(redis_server: Server) -> Iterator[_ReplyDroppingProxy]:
    port = int(redis_server.url.rsplit(":", 1)[1].split("/")[0])
    p = _ReplyDroppingProxy(port)
    yield p
    p.close()


def test_a_lost_answer_is_not_a_conflict(redis_server: Server, proxy: _ReplyDroppingProxy) -> None:
    """The script ran, its answer was lost: the re-sent script finds its token."""
    prefix = _prefix()
    store = RedisEntityStore(
        f"redis://{HOST}:{proxy.port}/0", key_prefix=prefix, timeout=0.5, retries=2
    )
    other = RedisEntityStore(redis_server.url, key_prefix=prefix)
    try:
        entity = store.load("lost")
        entity.state = {"n": 1}
        proxy.drop_replies_on_open_connections()  # the next answer is lost; reconnects work
        store.save(entity)
        assert proxy.reply_dropped.is_set(), "the first attempt must have reached the server"
        assert entity.version == 1
        batch = [entity, Entity("lost-2", {"n": 2})]
        entity.state = {"n": 3}
        proxy.drop_replies_on_open_connections()
        assert store.save_many(batch) == set()
        assert [e.version for e in batch] == [2, 1]
        assert other.load("lost").state == {"n": 3} and other.load("lost").version == 2
    finally:
        store.close()
        other.close()


class _LosingConnection(RedisConnection):
    """Runs the script, then loses its answer; ``meddle`` runs in between. One per store."""

    losses = 1
    meddle: Callable[[], None] = staticmethod(lambda: None)

    @classmethod
    def key(cls, url: StoreURL, options: Options) -> Hashable:
        return object()

    def _send(self, commands: list[tuple[Any, ...]], sent: list[bool]) -> list[Any]:
        replies = super()._send(commands, sent)
        if commands[0][0] == "EVALSHA" and self.losses > 0:
            self.losses -= 1
            self.meddle()
            raise redis.ConnectionError("answer lost (simulated)")
        return replies


class _LosingAnswers(RedisEntityStore):
    """An entity store on a :class:`_LosingConnection` of its own (``_redis``)."""

    _redis = Connected(_LosingConnection)


def test_a_lost_answer_then_a_rival_save_is_unknown_never_a_conflict(
    redis_server: Server,
) -> None:
    prefix = _prefix()
    store = _LosingAnswers(redis_server.url, key_prefix=prefix)
    other = RedisEntityStore(redis_server.url, key_prefix=prefix)
    try:
        entity = store.load("raced")
        entity.state = {"count": 1}
        store.save(entity)  # answer lost, no rival: the token says it was ours
        assert entity.version == 1

        def rival_saves_on_top() -> None:
            rival = other.load("raced")
            assert rival.state == {"count": 2}, "the lost attempt wrote"
            rival.state = {"count": 3}
            other.save(rival)

        store._redis.losses, store._redis.meddle = 1, rival_saves_on_top
        entity.state = {"count": 2}
        with pytest.raises(StoreUnavailable, match="unknown"):
            store.save(entity)
        assert entity.version == 1
        assert other.load("raced").state == {"count": 3}, "the rival's save stands"
        # a lost answer whose re-send meets a real conflict: unknown as well
        stale = entity.copy()
        store._redis.losses, store._redis.meddle = 1, lambda: None
        with pytest.raises(StoreUnavailable):
            store.save(stale)
        # without a lost answer a conflict is a conflict
        with pytest.raises(ConcurrencyConflict):
            store.save(stale)
    finally:
        store.close()
        other.close()


def test_retries_run_out(redis_server: Server) -> None:
    store = _LosingAnswers(redis_server.url, key_prefix=_prefix(), retries=1)
    try:
        store._redis.losses = 2
        entity = Entity("tired", {"n": 1})
        with pytest.raises(StoreUnavailable) as info:
            store.save(entity)
        assert isinstance(info.value.__cause__, redis.ConnectionError)
        assert entity.version is None
        assert store.load("tired").version == 1, "the first attempt wrote it"
    finally:
        store.close()


def test_concurrent_savers_with_lost_answers(redis_server: Server) -> None:
    """Lost answers under contention: a save reported saved is in, a conflict is not."""
    prefix = _prefix()
    stores = [_LosingAnswers(redis_server.url, key_prefix=prefix) for _ in range(3)]
    outcomes: dict[str, str] = {}
    lock = threading.Lock()

    def work(index: int) -> None:
        store = stores[index]
        for n in range(20):
            store._redis.losses = int(n % 2 == 0)
            entity = store.load("contended")
            tag = f"{index}-{n}"
            entity.state = {"tags": [*entity.state.get("tags", []), tag]}
            try:
                store.save(entity)
                outcome = "saved"
            except ConcurrencyConflict:
                outcome = "conflict"
            except StoreUnavailable:
                outcome = "unknown"
            with lock:
                outcomes[tag] = outcome

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(stores))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    final = stores[0].load("contended")
    tags = final.state["tags"]
    assert len(tags) == len(set(tags)) == final.version
    saved = {tag for tag, outcome in outcomes.items() if outcome == "saved"}
    conflicts = {tag for tag, outcome in outcomes.items() if outcome == "conflict"}
    assert saved <= set(tags), "a save reported as saved is missing"
    assert not conflicts & set(tags), "a save reported as a conflict was written"
    assert saved and len(outcomes) == 60
    for s in stores:
        s.close()


def test_ready_client_is_used_and_not_closed(redis_server: Server) -> None:
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    store = RedisEntityStore(redis_server.url, key_prefix=_prefix(), client=client)
    try:
        entity = store.load("via-client")
        entity.outbox["m"] = [_message("m")]
        store.save(entity)
        assert store.load("via-client").version == 1
        assert [e.id for e in store.pending_outboxes()] == ["via-client"]
    finally:
        store.close()
    assert client.ping() is True
    client.close()
