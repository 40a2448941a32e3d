"""The Redis backend: the shared contract plus Redis-specific behaviour."""

from __future__ import annotations

import contextlib
import itertools
import os
import pickle
import re
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Hashable, Iterator
from datetime import timedelta
from typing import Any

import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st
from redis.crc import key_slot

from dedupstore import DeduplicationStore, open_store
from dedupstore.backends.redis import (
    RedisDeduplicationStore,
    RedisEntityStore,
    RedisTokenStore,
    record_key,
    token_key,
)
from dedupstore.backends.redis import dispatcher as redis_dispatcher
from dedupstore.backends.redis import entities as redis_entities
from dedupstore.backends.redis import store as redis_store
from dedupstore.backends.redis._client import RedisConnection, _packed, escape
from dedupstore.backends.redis.consumer import RedisStreamsBroker
from dedupstore.backends.redis.dispatcher import RedisDispatcher
from dedupstore.client import Connected
from dedupstore.errors import (
    ConfigurationError,
    ConsistencyError,
    StoreUnavailable,
)
from dedupstore.options import Options
from dedupstore.testing import (
    DeduplicationStoreContract,
    FakeClock,
    MultiProcessContract,
    StoreFactory,
    TokenStoreContract,
    TokenStoreFactory,
)
from dedupstore.tokens import TokenCount, TokenStore
from dedupstore.urls import StoreURL
from tests.servers import HOST, RedisServer, Server, free_port

pytestmark = pytest.mark.redis


def _prefix() -> str:
    return f"test-{uuid.uuid4().hex}:"


def _admin(url: str, **kwargs: Any) -> redis.Redis:
    return redis.Redis.from_url(url, **kwargs)


def _wait_for(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Poll ``condition`` until it holds (an event we cannot be notified of)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


class TestRedisStore(DeduplicationStoreContract, MultiProcessContract):
    @pytest.fixture
    def store_factory(self, redis_server: Server) -> StoreFactory:
        url, prefix = redis_server.url, _prefix()

        def make(**options: Any) -> DeduplicationStore:
            return open_store(url, key_prefix=prefix, **options)

        return make


@pytest.fixture
def store_factory(redis_server: Server) -> StoreFactory:
    url, prefix = redis_server.url, _prefix()

    def make(**options: Any) -> DeduplicationStore:
        return open_store(url, **{"key_prefix": prefix, **options})

    return make


# ---------------------------------------------------------------------- key encoding

#: Parts that break naive encodings: separators, hash tags, globs, the escape itself.
_TRICKY_PARTS = (
    "a",
    "b",
    ":",
    "::",
    "a:b",
    "a%3Ab",
    "%3A",
    "%",
    "%25",
    "%253A",
    "{",
    "}",
    "{}",
    "{hash}",
    "%7Bhash%7D",
    "%7B",
    "%7D",
    "{a}:{b}",
    "*",
    "?",
    "[a]",
    "\\",
    "\\\\",
    "\\:",
    "a\\",
    "|",
    "a|b",
    "dedup:",
    "é",
    "🦄",
)


def test_key_encoding_is_injective() -> None:
    keys: dict[str, tuple[str, str, str]] = {}
    for prefix in ("", "dedup:", "dedup:x:", "a:"):
        for endpoint, mid in itertools.product(_TRICKY_PARTS, repeat=2):
            key = record_key(prefix, endpoint, mid)
            assert key not in keys, (keys.get(key), (prefix, endpoint, mid))
            keys[key] = (prefix, endpoint, mid)


@settings(max_examples=500, deadline=None)
@given(st.text(alphabet=st.sampled_from("%:{}a7BD3é"), max_size=12) | st.text(max_size=12))
def test_escape_is_the_percent_escaping_of_its_four_characters(part: str) -> None:
    # the stored key layout: each of % : { } as %XX, one character at a time
    expected = "".join(f"%{ord(c):02X}" if c in "%:{}" else c for c in part)
    assert escape(part) == expected


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.lists(st.text(max_size=40) | st.integers(), max_size=8).map(
            lambda args: ("EVALSHA", *args)
        ),
        min_size=1,
        max_size=3,
    )
)
def test_commands_are_packed_as_redis_py_packs_them(commands: list[tuple[object, ...]]) -> None:
    """The script calls are packed by hiredis directly: the bytes redis-py sends."""
    conn = redis.Connection()
    assert b"".join(_packed(conn, commands)) == b"".join(conn.pack_commands(commands))


def test_an_argument_that_cannot_be_packed_is_a_data_error() -> None:
    with pytest.raises(redis.DataError):
        _packed(redis.Connection(), [("EVALSHA", "sha", 1, object())])


def test_keys_have_no_hash_tag_and_spread_over_slots() -> None:
    for endpoint, mid in itertools.product(_TRICKY_PARTS, repeat=2):
        key = record_key("dedup:", endpoint, mid)
        assert "{" not in key and "}" not in key, key
    # a user id like "{hash}x" must not pin records to the slot of "hash"
    tagged = [record_key("dedup:", "orders", f"{{hash}}{n}") for n in range(200)]
    assert len({key_slot(k.encode()) for k in tagged}) > 150
    plain = [record_key("dedup:", "orders", f"msg-{n}") for n in range(200)]
    assert len({key_slot(k.encode()) for k in plain}) > 150, "one endpoint must not share a slot"


def test_tricky_endpoints_and_ids_never_collide(store_factory: StoreFactory) -> None:
    stores = {ep: store_factory(endpoint=ep) for ep in _TRICKY_PARTS}
    try:
        # each endpoint records a different subset of the ids
        expected = {
            ep: {m for j, m in enumerate(_TRICKY_PARTS) if (i + j) % 3 != 0}
            for i, ep in enumerate(_TRICKY_PARTS)
        }
        for ep, store in stores.items():
            assert store.add_many(expected[ep]) == expected[ep], ep
        for ep, store in stores.items():
            assert store.processed_among(_TRICKY_PARTS) == expected[ep], ep
            for mid in _TRICKY_PARTS:
                assert store.has_been_processed(mid) is (mid in expected[ep]), (ep, mid)
    finally:
        for store in stores.values():
            store.close()


def test_purge_expired_deletes_nothing_redis_expires_records_itself(
    redis_server: Server,
) -> None:
    base = _prefix()
    hour = timedelta(hours=1)
    # glob characters in the endpoint, an endpoint that is a prefix of another, and a
    # store whose key_prefix equals another store's prefix + endpoint + ':'
    specs = [(base, "a"), (base, "a*"), (base, "ab"), (base, "a:"), (f"{base}a:", "x")]
    stores = [
        RedisDeduplicationStore(redis_server.url, key_prefix=p, endpoint=e, retention=hour)
        for p, e in specs
    ]
    admin = _admin(redis_server.url)
    try:
        for n, store in enumerate(stores):
            store.add_many([f"id-{i}" for i in range(n + 1)] + ["x:y", "*"])
        keys = sorted(admin.scan_iter(match=base + "*"))
        assert len(keys) == sum(n + 1 + 2 for n in range(len(stores)))
        assert all(0 < admin.pttl(key) <= 3_600_000 for key in keys), "native expiry on each"
        assert [store.purge_expired() for store in stores] == [0] * len(stores)
        assert sorted(admin.scan_iter(match=base + "*")) == keys
    finally:
        admin.close()
        for store in stores:
            store.close()


def test_key_prefix_must_end_with_a_colon(redis_server: Server) -> None:
    with pytest.raises(ConfigurationError, match="key_prefix"):
        open_store(redis_server.url, key_prefix="dedup")
    store = open_store(redis_server.url, key_prefix="")
    store.close()


def test_records_use_the_documented_key_value_and_native_expiry(redis_server: Server) -> None:
    prefix = _prefix()
    keeper = RedisDeduplicationStore(redis_server.url, key_prefix=prefix, endpoint="e:{x}")
    expiring = RedisDeduplicationStore(
        redis_server.url, key_prefix=prefix, endpoint="e", retention=timedelta(hours=1)
    )
    admin = _admin(redis_server.url)
    try:
        keeper.add("m:{1}")
        expiring.add("m")
        kept = f"{prefix}e%3A%7Bx%7D:m%3A%7B1%7D"
        assert kept == record_key(prefix, "e:{x}", "m:{1}")
        assert admin.exists(kept) == 1
        assert admin.pttl(kept) == -1, "no retention, no expiry"
        assert 3_590_000 < admin.pttl(f"{prefix}e:m") <= 3_600_000, "PX = the retention"
        for key in (kept, f"{prefix}e:m"):
            value = admin.get(key)
            assert isinstance(value, bytes) and value.startswith(b"dsv1:") and len(value) > 10
        # a store without retention does not re-record a live record (nor touch its expiry)
        plain = RedisDeduplicationStore(redis_server.url, key_prefix=prefix, endpoint="e")
        assert plain.add("m") is False
        assert 0 < admin.pttl(f"{prefix}e:m") <= 3_600_000
        plain.close()
    finally:
        keeper.close()
        expiring.close()
        admin.close()


def test_native_expiry_is_judged_by_the_server(store_factory: StoreFactory) -> None:
    store = store_factory(endpoint="e", retention="1s")
    forever = store_factory(endpoint="e")
    admin = _admin(store.url)
    try:
        assert store.add("short-lived") is True
        assert store.add_many(["short-lived", "batch-lived"]) == {"batch-lived"}
        for mid in ("short-lived", "batch-lived"):
            assert 0 < admin.pttl(record_key(store.option("key_prefix"), "e", mid)) <= 1000
        assert forever.has_been_processed("short-lived") is True
        time.sleep(1.2)
        assert store.has_been_processed("short-lived") is False
        assert forever.processed_among(["short-lived", "batch-lived"]) == set()
        assert store.add("short-lived") is True, "an expired record is recorded again"
        assert forever.add_many(["batch-lived"]) == {"batch-lived"}
        assert admin.pttl(record_key(store.option("key_prefix"), "e", "batch-lived")) == -1
        assert store.purge_expired() == 0
    finally:
        store.close()
        forever.close()
        admin.close()


def test_skewed_client_clocks_do_not_matter(
    redis_server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """There is no client clock: a machine running 2 h ahead agrees with one on time."""
    prefix, hour = _prefix(), timedelta(hours=1)
    with pytest.raises(ConfigurationError, match="clock"):
        open_store(redis_server.url, key_prefix=prefix, clock=time.time)
    on_time = open_store(redis_server.url, key_prefix=prefix, retention=hour)
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 2 * 3600)
    ahead = open_store(redis_server.url, key_prefix=prefix, retention=hour)
    admin = _admin(redis_server.url)
    try:
        assert on_time.add("early") is True
        # a client clock 2 h ahead would judge this 1 h record expired and record it again
        assert ahead.has_been_processed("early") is True
        assert ahead.add("early") is False
        assert ahead.add_many(["early", "late"]) == {"late"}
        assert on_time.add("late") is False
        assert on_time.processed_among(["early", "late"]) == {"early", "late"}
        assert 0 < admin.pttl(record_key(prefix, "default", "late")) <= 3_600_000
    finally:
        on_time.close()
        ahead.close()
        admin.close()


def test_foreign_value_under_the_prefix_is_a_loud_error(store_factory: StoreFactory) -> None:
    store = store_factory(endpoint="e")
    admin = _admin(store.url)
    try:
        key = record_key(store.option("key_prefix"), "e", "intruder")
        admin.set(key, "not ours")
        with pytest.raises(ConfigurationError, match="did not write"):
            store.add("intruder")
        with pytest.raises(ConfigurationError, match="did not write"):
            store.add_many(["fresh", "intruder"])
        assert store.has_been_processed("fresh") is False, "a failed batch wrote nothing"
        with pytest.raises(ConfigurationError, match="did not write"):
            store.processed_among(["intruder"])
        with pytest.raises(ConfigurationError, match="did not write"):
            store.has_been_processed("intruder")
    finally:
        store.close()
        admin.close()


def test_the_one_key_add_writes_again_only_what_this_call_wrote(
    store_factory: StoreFactory,
) -> None:
    """The add script's path for one key (one SET NX when new): a new key is written with
    the expiry; a key holding a value of this call (an earlier attempt) is written again,
    with the expiry or without; another writer's record is left as it is."""
    store = store_factory(endpoint="e")
    admin = _admin(store.url)
    script = redis_store.ADD_SCRIPT
    try:
        key = record_key(store.option("key_prefix"), "e", "one")
        assert admin.eval(script, 1, key, "dsv1:new", "60000", "dsv1:new") == [1]
        assert admin.get(key) == b"dsv1:new" and 0 < admin.pttl(key) <= 60000
        admin.set(key, "dsv1:earlier")  # this call's earlier attempt, without expiry
        again = admin.eval(script, 1, key, "dsv1:now", "60000", "dsv1:now", "dsv1:earlier")
        assert again == [1]
        assert admin.get(key) == b"dsv1:now" and 0 < admin.pttl(key) <= 60000
        admin.set(key, "dsv1:other")
        assert admin.eval(script, 1, key, "dsv1:mine", "", "dsv1:mine") == []
        assert admin.get(key) == b"dsv1:other" and admin.pttl(key) == -1
        assert admin.eval(script, 1, key, "dsv1:x", "", "dsv1:x", "dsv1:other") == [1]
        assert admin.get(key) == b"dsv1:x" and admin.pttl(key) == -1
    finally:
        store.close()
        admin.close()


def test_a_key_of_another_type_is_a_configuration_error(store_factory: StoreFactory) -> None:
    """A hash at a record key: MGET sees nothing, but SET must not replace it."""
    store = store_factory(endpoint="e")
    admin = _admin(store.url)
    try:
        key = record_key(store.option("key_prefix"), "e", "hashed")
        admin.hset(key, "field", "value")
        for call in (
            lambda: store.add("hashed"),
            lambda: store.add_many(["fresh", "hashed"]),
            lambda: store.has_been_processed("hashed"),
        ):
            with pytest.raises(ConfigurationError, match="did not write") as info:
                call()
            assert "WRONGTYPE" in str(info.value) and "\n" not in str(info.value)
            assert isinstance(info.value.__cause__, redis.ResponseError)
        assert admin.type(key) == b"hash", "the foreign key is left alone"
        assert store.has_been_processed("fresh") is False, "a failed batch wrote nothing"
    finally:
        store.close()
        admin.close()


# ---------------------------------------------------------------------- round trips


def _calls(admin: redis.Redis, command: str) -> int:
    stats = admin.info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


def test_one_round_trip_per_chunk(own_redis_server: RedisServer) -> None:
    store = RedisDeduplicationStore(own_redis_server.url, key_prefix=_prefix())
    admin = _admin(own_redis_server.url)
    try:
        ids = [f"chunk-{i}" for i in range(2 * store.max_write_batch + 1)]
        before = _calls(admin, "evalsha")
        assert store.add_many(ids) == set(ids)
        assert _calls(admin, "evalsha") - before == 3
        before = _calls(admin, "mget")
        assert store.processed_among(ids * 2) == set(ids)
        chunks = -(-len(ids) * 2 // store.max_read_batch)
        assert _calls(admin, "mget") - before == chunks
    finally:
        store.close()
        admin.close()


# ---------------------------------------------------------------------- failures


def test_killed_server_raises_then_the_same_store_recovers(own_redis_server: RedisServer) -> None:
    store = open_store(own_redis_server.url, key_prefix=_prefix(), retries=1)
    try:
        acked = [f"acked-{i}" for i in range(50)]
        for mid in acked[:10]:
            assert store.add(mid) is True
        assert store.add_many(acked[10:]) == set(acked[10:])

        own_redis_server.kill()
        calls: list[Callable[[], object]] = [
            lambda: store.add("during-outage"),
            lambda: store.add_many(["during-outage", "other"]),
            lambda: store.has_been_processed(acked[0]),
            lambda: store.processed_among(acked),
            lambda: acked[0] in store,
            store.health_warnings,
        ]
        for call in calls:
            with pytest.raises(StoreUnavailable) as info:
                call()
            assert isinstance(info.value.__cause__, redis.ConnectionError), info.value.__cause__
            assert "\n" not in str(info.value)
        assert store.purge_expired() == 0, "no I/O: Redis expires records itself"
        with pytest.raises(StoreUnavailable) as info:
            store.add("during-outage")
        assert info.value.unknown == {"during-outage"} and not info.value.recorded

        own_redis_server.restart()
        assert store.processed_among(acked) == set(acked), "an acknowledged id was lost"
        assert all(store.has_been_processed(m) for m in acked)
        assert store.add(acked[0]) is False
        assert store.add("during-outage") is True
        assert store.add_many(["during-outage", "other"]) == {"other"}
    finally:
        store.close()


@pytest.mark.timeout(300)
def test_add_many_killed_half_way_then_retried_on_the_same_store(
    own_redis_server: RedisServer,
) -> None:
    """The issue's scenario: kill -9 in the middle of a big batch, restart, retry it.

    AOF with appendfsync always (RedisServer's default): every acknowledged chunk
    survives the crash. Each id must be reported exactly once across the failed call
    (``recorded``) and the retry; ``unknown`` ids are the chunks in flight.
    """
    ids = [f"bulk-{i}" for i in range(300_000)]
    prefix = _prefix()
    store = open_store(own_redis_server.url, key_prefix=prefix)
    watcher = _admin(own_redis_server.url)
    killed: list[Exception | None] = []

    def kill_half_way() -> None:
        try:
            _wait_for(lambda: watcher.dbsize() >= len(ids) // 2, "half of the chunks", 120)
            own_redis_server.kill()
            killed.append(None)
        except Exception as exc:  # noqa: BLE001 - the test thread reports it
            killed.append(exc)

    killer = threading.Thread(target=kill_half_way, daemon=True)
    killer.start()
    try:
        with pytest.raises(StoreUnavailable) as info:
            store.add_many(ids)
        killer.join(60)
        assert killed == [None], killed
        recorded, unknown = set(info.value.recorded), set(info.value.unknown)
        assert len(ids) // 2 <= len(recorded) < len(ids)
        assert 0 < len(unknown) <= store.chunk_concurrency * store.max_write_batch
        assert not recorded & unknown

        own_redis_server.restart()
        with open_store(own_redis_server.url, key_prefix=prefix) as other:
            assert other.processed_among(recorded) == recorded, "an acknowledged id was lost"
            untouched = set(ids) - recorded - unknown
            assert not other.processed_among(untouched), "the call wrote an id it never sent"

        retried = store.add_many(ids)
        assert retried | recorded == set(ids), "an id is never reported as recorded"
        assert not retried & recorded, "an id is reported twice"
    finally:
        watcher.close()
        store.close()


class _ReplyDroppingProxy:
    """A TCP proxy to Redis that can swallow the server's replies.

    Requests always reach the server (so writes happen); only the answers are lost,
    which makes the client time out exactly as after a network failure.
    """

    def __init__(self, target_port: int) -> None:
        self._target = (HOST, target_port)
        self._listener = socket.create_server((HOST, 0))
        self.port: int = self._listener.getsockname()[1]
        self.drop_new_connections = False
        self.reply_dropped = threading.Event()
        self._links: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def drop_replies_on_open_connections(self, drop: bool = True) -> None:
        with self._lock:
            for link in self._links:
                link["drop"] = drop

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self._target)
            link = {"drop": self.drop_new_connections, "sockets": (client, server)}
            with self._lock:
                self._links.append(link)
            threading.Thread(target=self._pump, args=(client, server, None), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, link), daemon=True).start()

    def _pump(
        self, source: socket.socket, sink: socket.socket, link: dict[str, Any] | None
    ) -> None:
        try:
            while data := source.recv(65536):
                if link is not None and link["drop"]:
                    self.reply_dropped.set()
                    continue
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        with self._lock:
            for link in self._links:
                for sock in link["sockets"]:
                    sock.close()


@pytest.fixture
def proxy(redis_server: Server) -> Iterator[_ReplyDroppingProxy]:
    port = int(redis_server.url.rsplit(":", 1)[1].split("/")[0])
    p = _ReplyDroppingProxy(port)
    yield p
    p.close()


def test_retried_write_after_a_lost_reply_still_reports_true(
    redis_server: Server, proxy: _ReplyDroppingProxy
) -> None:
    """redis-py retries the script after a timeout; the token keeps the True."""
    prefix = _prefix()
    url = f"redis://{HOST}:{proxy.port}/0"
    store = open_store(url, key_prefix=prefix, timeout=0.5, retries=2)
    other = open_store(redis_server.url, key_prefix=prefix)
    try:
        proxy.drop_replies_on_open_connections()  # the next reply is lost; reconnects work
        assert store.add("lost-reply") is True
        assert proxy.reply_dropped.is_set(), "the first attempt must have reached the server"
        proxy.drop_replies_on_open_connections()
        assert store.add_many(["lost-1", "lost-2", "lost-reply"]) == {"lost-1", "lost-2"}
        assert other.add("lost-reply") is False
        assert other.processed_among(["lost-1", "lost-2"]) == {"lost-1", "lost-2"}
    finally:
        store.close()
        other.close()


def test_caller_retry_after_unavailable_reports_true_once(
    redis_server: Server, proxy: _ReplyDroppingProxy
) -> None:
    """A write whose outcome is unknown raises; retrying it on the same object gives True."""
    prefix = _prefix()
    url = f"redis://{HOST}:{proxy.port}/0"
    store = open_store(url, key_prefix=prefix, timeout=0.5, retries=1)
    other = open_store(redis_server.url, key_prefix=prefix)
    try:
        proxy.drop_new_connections = True
        proxy.drop_replies_on_open_connections()
        with pytest.raises(StoreUnavailable) as info:
            store.add_many(["unknown-1", "unknown-2"])
        assert isinstance(info.value.__cause__, redis.TimeoutError)
        assert info.value.unknown == {"unknown-1", "unknown-2"} and not info.value.recorded
        assert proxy.reply_dropped.wait(30)
        _wait_for(lambda: other.has_been_processed("unknown-1"), "the lost write to land")
        proxy.drop_new_connections = False
        proxy.drop_replies_on_open_connections(False)
        assert other.add("unknown-2") is False, "another client is not the writer"
        assert store.add("unknown-1") is True, "the failed call wrote it: the retry owns it"
        assert store.add_many(["unknown-1", "unknown-2"]) == {"unknown-2"}
        assert store.add("unknown-2") is False
    finally:
        store.close()
        other.close()


# ---------------------------------------------------------------------- replication


def test_wait_replicas_without_replicas_raises_unknown_durability(
    redis_server: Server,
) -> None:
    prefix = _prefix()
    store = open_store(redis_server.url, key_prefix=prefix, wait_replicas=1, wait_timeout_ms=50)
    other = open_store(redis_server.url, key_prefix=prefix)
    try:
        with pytest.raises(StoreUnavailable, match="durability is unknown"):
            store.add("waited")
        with pytest.raises(StoreUnavailable, match="0 of 1 replicas"):
            store.add_many(["waited-1", "waited-2"])
        # the records are written on the primary nevertheless
        assert other.processed_among(["waited", "waited-1", "waited-2"]) == {
            "waited",
            "waited-1",
            "waited-2",
        }
        assert other.add("waited") is False
        assert store.has_been_processed("waited") is True
    finally:
        store.close()
        other.close()


class _ReplicaServer(RedisServer):
    """A Redis replica of ``primary_port`` (AOF off: it only acknowledges)."""

    def __init__(self, primary_port: int) -> None:
        super().__init__(appendonly=False)
        self.primary_port = primary_port

    def _command(self) -> list[str]:
        return [*super()._command(), "--replicaof", HOST, str(self.primary_port)]


@pytest.fixture
def replica(own_redis_server: RedisServer) -> Iterator[_ReplicaServer]:
    primary = _admin(own_redis_server.url)
    primary.config_set("repl-diskless-sync-delay", 0)  # serve the replica at once
    primary.close()
    with _ReplicaServer(own_redis_server.port) as server:
        admin = _admin(server.url)
        _wait_for(
            lambda: admin.info("replication").get("master_link_status") == "up",
            "the replica to connect",
        )
        admin.close()
        yield server


def test_wait_replicas_with_a_stalled_replica_and_the_retry(
    own_redis_server: RedisServer, replica: _ReplicaServer
) -> None:
    prefix = _prefix()
    store = open_store(
        own_redis_server.url, key_prefix=prefix, wait_replicas=1, wait_timeout_ms=1000
    )
    other = open_store(own_redis_server.url, key_prefix=prefix)
    try:
        with _admin(own_redis_server.url) as admin:
            admin.script_flush()  # the pipelined script must reload
        assert store.add("replicated") is True
        assert replica.pid is not None
        os.kill(replica.pid, signal.SIGSTOP)
        try:
            with pytest.raises(StoreUnavailable, match="durability is unknown"):
                store.add("stalled")
        finally:
            os.kill(replica.pid, signal.SIGCONT)
        assert other.add("stalled") is False, "the record is on the primary"
        assert store.add("stalled") is True, "the retry of the unconfirmed add owns it"
        assert store.add("stalled") is False
        assert store.health_warnings() == []
        assert any("replica" in w for w in other.health_warnings())
    finally:
        store.close()
        other.close()


def test_writes_to_a_demoted_primary_raise(
    own_redis_server: RedisServer, replica: _ReplicaServer
) -> None:
    store = open_store(own_redis_server.url, key_prefix=_prefix())
    try:
        assert store.add("before-switchover") is True
        with _admin(replica.url) as new_primary, _admin(own_redis_server.url) as old_primary:
            new_primary.replicaof("NO", "ONE")
            old_primary.replicaof(HOST, str(replica.port))
        with pytest.raises(StoreUnavailable, match="read only replica") as info:
            store.add("after-switchover")
        assert isinstance(info.value.__cause__, redis.ReadOnlyError)
    finally:
        store.close()


def test_a_replica_is_refused(replica: _ReplicaServer) -> None:
    with pytest.raises(ConsistencyError, match="replica"):
        open_store(replica.url, key_prefix=_prefix())


class _ClusterNode(RedisServer):
    def _command(self) -> list[str]:
        # the default bus port (port + 10000) may be taken or beyond 65535
        bus = ["--cluster-port", str(free_port())]
        return [*super()._command(), "--cluster-enabled", "yes", *bus]


def test_redis_cluster_is_refused() -> None:
    with _ClusterNode() as node, pytest.raises(ConfigurationError, match="Cluster"):
        open_store(node.url)


# ---------------------------------------------------------------------- configuration


def test_health_warnings(own_redis_server: RedisServer) -> None:
    store = open_store(own_redis_server.url, key_prefix=_prefix())
    admin = _admin(own_redis_server.url)
    try:
        assert store.health_warnings() == []
        admin.config_set("appendfsync", "everysec")
        (warning,) = store.health_warnings()
        assert "appendfsync" in warning
        admin.config_set("appendfsync", "always")
        admin.config_set("maxmemory-policy", "volatile-lru")
        (warning,) = store.health_warnings()
        assert "evict" in warning
        admin.config_set("maxmemory-policy", "noeviction")
        admin.acl_setuser(
            "limited", enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all", "-config"]
        )
        limited = open_store(
            own_redis_server.url, key_prefix=_prefix(), username="limited", password="pw"
        )
        (warning,) = limited.health_warnings()
        assert "could not check" in warning
        limited.close()
    finally:
        store.close()
        admin.close()


def test_health_warning_without_append_only_file() -> None:
    with RedisServer(appendonly=False) as server:
        store = open_store(server.url)
        (warning,) = store.health_warnings()
        assert "append-only" in warning
        store.close()


def test_wrong_password_is_a_one_line_configuration_error(own_redis_server: RedisServer) -> None:
    admin = _admin(own_redis_server.url)
    admin.config_set("requirepass", "s3cret-pass")
    admin.close()
    host = f"{HOST}:{own_redis_server.port}"
    for url, options in [
        (f"redis://{host}/0", {}),
        (f"redis://:wrong-pass@{host}/0", {}),
        (f"redis://{host}/0", {"password": "wrong-pass"}),
    ]:
        with pytest.raises(ConfigurationError) as info:
            open_store(url, **options)
        message = str(info.value)
        assert "\n" not in message and "wrong-pass" not in message, message
        assert "log in" in message
        assert isinstance(info.value.__cause__, redis.AuthenticationError)
    good = open_store(f"redis://:s3cret-pass@{host}/0", key_prefix=_prefix())
    assert good.add("authenticated") is True
    assert "s3cret-pass" not in repr(good)
    good.close()
    by_option = open_store(f"redis://{host}/0", password="s3cret-pass", key_prefix=_prefix())
    assert "s3cret-pass" not in repr(by_option) and "***" in repr(by_option)
    assert "s3cret-pass" not in repr(pickle.loads(pickle.dumps(by_option)))
    by_option.close()


def test_acl_user_without_evalsha_is_a_configuration_error(own_redis_server: RedisServer) -> None:
    admin = _admin(own_redis_server.url)
    url = own_redis_server.url
    try:
        admin.acl_setuser(
            "no-eval", enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all", "-evalsha"]
        )
        with pytest.raises(ConfigurationError, match="may not run") as info:
            open_store(url, username="no-eval", password="pw")
        assert isinstance(info.value.__cause__, redis.exceptions.NoPermissionError)
        # the permission is revoked while a store is open: the write path says the same
        admin.acl_setuser("worker", enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all"])
        store = open_store(url, username="worker", password="pw", key_prefix=_prefix())
        try:
            assert store.add("allowed") is True
            # (enabled: redis-py's acl_setuser turns the user off unless told, and a new
            # connection of a disabled user cannot log in)
            admin.acl_setuser("worker", enabled=True, commands=["-evalsha"])
            for call in (lambda: store.add("refused"), lambda: store.add_many(["a", "b"])):
                with pytest.raises(ConfigurationError, match="may not run") as info:
                    call()
                assert "grant" in str(info.value) and "+evalsha" in str(info.value), "the fix"
                assert not info.value.recorded
            assert store.has_been_processed("allowed") is True, "reads are still allowed"
            assert store.processed_among(["refused", "a", "b"]) == set(), "nothing was written"
        finally:
            store.close()
    finally:
        admin.close()


def test_out_of_memory_is_store_unavailable_with_a_hint(own_redis_server: RedisServer) -> None:
    store = open_store(own_redis_server.url, key_prefix=_prefix())
    admin = _admin(own_redis_server.url)
    try:
        assert store.add("before") is True
        admin.config_set("maxmemory", 1)  # below what the server already uses
        with pytest.raises(StoreUnavailable, match="maxmemory") as info:
            store.add_many(["oom-1", "oom-2"])
        assert isinstance(info.value.__cause__, redis.exceptions.OutOfMemoryError)
        assert info.value.unknown == {"oom-1", "oom-2"}
        admin.config_set("maxmemory", 0)
        assert store.add_many(["oom-1", "oom-2"]) == {"oom-1", "oom-2"}
    finally:
        store.close()
        admin.close()


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A TCP server on 127.0.0.1 that accepts connections and never answers."""
    listener = socket.create_server((HOST, 0))
    listener.settimeout(0.1)
    accepted: list[socket.socket] = []
    done = threading.Event()

    def accept() -> None:
        while not done.is_set():
            with contextlib.suppress(TimeoutError):
                accepted.append(listener.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield listener.getsockname()[1]
    done.set()
    thread.join()
    listener.close()
    for sock in accepted:
        sock.close()


@pytest.mark.timeout(60)
def test_a_server_that_never_answers_times_out(silent_port: int) -> None:
    with pytest.raises(StoreUnavailable, match=r"(?i)timeout") as info:
        open_store(f"redis://{HOST}:{silent_port}/0", timeout=1, retries=0)
    assert isinstance(info.value.__cause__, redis.TimeoutError)


@pytest.mark.timeout(60)
def test_a_stalled_server_times_out_then_the_retry_owns_the_write(
    own_redis_server: RedisServer,
) -> None:
    prefix = _prefix()
    store = open_store(own_redis_server.url, key_prefix=prefix, timeout="1", retries="0")
    other = open_store(own_redis_server.url, key_prefix=prefix)
    assert own_redis_server.pid is not None
    try:
        assert store.add("before") is True
        os.kill(own_redis_server.pid, signal.SIGSTOP)
        try:
            with pytest.raises(StoreUnavailable, match=r"(?i)timeout") as info:
                store.add("stalled")
            assert info.value.unknown == {"stalled"}
        finally:
            os.kill(own_redis_server.pid, signal.SIGCONT)
        assert store.add("stalled") is True, "written by the failed call or by this one"
        assert other.add("stalled") is False
    finally:
        store.close()
        other.close()


@pytest.mark.parametrize("host", ["no-such-host.invalid:6379", "unused-port"])
def test_unreachable_server_is_a_one_line_store_unavailable(host: str) -> None:
    if host == "unused-port":
        host = f"{HOST}:{free_port()}"
    with pytest.raises(StoreUnavailable) as info:
        open_store(f"redis://:pw-secret@{host}/0", connect_timeout=2)
    message = str(info.value)
    assert "\n" not in message and "pw-secret" not in message, message
    assert isinstance(info.value.__cause__, redis.ConnectionError)


@pytest.mark.parametrize(
    ("url_tail", "options", "match"),
    [
        ("/0?bogus=1", {}, "bogus"),
        ("/notadb", {}, "database number"),
        ("/0", {"key_prefix": "nocolon"}, "key_prefix"),
        ("/0", {"wait_replicas": -1}, "wait_replicas"),
        ("/0", {"wait_replicas": 1, "wait_timeout_ms": 0}, "wait_timeout_ms"),
        ("/0?wait_replicas=1&wait_timeout_ms=9000", {}, "shorter than timeout"),
        ("/0?timeout=-1", {}, "timeout"),
        ("/0", {"timeout": "none"}, "timeout"),
        ("/0?socket_timeout=1", {}, "unknown option 'socket_timeout'"),
        ("/0", {"socket_connect_timeout": 1}, "unknown option 'socket_connect_timeout'"),
        ("/0", {"clock": time.time}, "clock"),
        ("/0", {"retries": "x"}, "retries"),
        ("/0", {"max_connections": 0}, "max_connections"),
        ("/0", {"ssl_ca_certs": "/tmp/ca.pem"}, "rediss"),
        ("/0", {"ssl_cert_reqs": "sometimes"}, "ssl_cert_reqs"),
        ("/0", {"client": object()}, "redis.Redis"),
    ],
)
def test_bad_configuration(
    redis_server: Server, url_tail: str, options: dict[str, Any], match: str
) -> None:
    url = redis_server.url.rsplit("/", 1)[0] + url_tail
    with pytest.raises(ConfigurationError, match=match) as info:
        open_store(url, **options)
    assert "\n" not in str(info.value)


def test_url_and_keyword_options_are_converted_and_pickled(redis_server: Server) -> None:
    prefix = _prefix()
    url = f"{redis_server.url}?key_prefix={prefix}&retries=0&timeout=3&max_connections=4"
    store = open_store(url, endpoint="typed", retention="1d", connect_timeout="2.5")
    clone = pickle.loads(pickle.dumps(store))
    try:
        assert clone.option("retries") == 0
        assert clone.option("timeout") == 3.0
        assert clone.option("max_connections") == 4
        assert clone.option("connect_timeout") == 2.5
        assert "connect_timeout=2.5" in repr(clone) and "username" not in repr(clone)
        pool = clone._redis.client.connection_pool  # type: ignore[attr-defined]
        assert pool.connection_kwargs["socket_timeout"] == 3.0
        assert pool.connection_kwargs["socket_connect_timeout"] == 2.5
        assert pool.max_connections == 4
        by_keyword = open_store(
            redis_server.url, key_prefix=prefix, timeout="250ms", retries="2", wait_replicas="0"
        )
        assert (by_keyword.option("timeout"), by_keyword.option("retries")) == (0.25, 2)
        by_keyword.close()
        assert clone.retention == timedelta(days=1)
        assert store.add("shared") is True
        assert clone.add("shared") is False
    finally:
        store.close()
        clone.close()


def test_ready_client_is_used_and_not_closed(redis_server: Server) -> None:
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    prefix = _prefix()
    store = RedisDeduplicationStore(redis_server.url, key_prefix=prefix, client=client)
    try:
        assert store.add("via-client") is True
        assert store.add_many(["via-client", "second"]) == {"second"}
        assert store.processed_among(["via-client", "nope"]) == {"via-client"}
        assert store.has_been_processed("via-client") is True
        assert "client=" not in repr(store) or "***" in repr(store)
        clone = pickle.loads(pickle.dumps(store))
        assert clone.has_been_processed("via-client")
        clone.close()
    finally:
        store.close()
    assert client.ping() is True, "close() must leave a caller's client alone"
    client.close()


def test_the_kept_connection_goes_back_to_a_given_client_pool(redis_server: Server) -> None:
    """The script calls run on a connection the store keeps checked out of the pool;
    ``close()`` gives it back to a caller's pool (and leaves that pool connected)."""
    client = redis.Redis.from_url(redis_server.url)
    pool: Any = client.connection_pool
    store = RedisDeduplicationStore(redis_server.url, key_prefix=_prefix(), client=client)
    try:
        assert store.add_many(["k1", "k2"]) == {"k1", "k2"}
        assert store.add("k3") is True
        assert len(pool._in_use_connections) == 1, "one connection kept for the scripts"
    finally:
        store.close()
    assert len(pool._in_use_connections) == 0
    assert client.ping() is True
    client.close()


def test_a_kept_connection_the_server_closed_is_reconnected(own_redis_server: RedisServer) -> None:
    store = open_store(own_redis_server.url, key_prefix=_prefix(), retries=1)
    admin = _admin(own_redis_server.url)
    try:
        assert store.add("before") is True
        killed = admin.client_kill_filter(_type="normal", skipme=True)
        assert killed >= 1
        assert store.add("after") is True, "the retry reconnects the kept connection"
        assert store.add("before") is False and store.add("after") is False
    finally:
        store.close()
        admin.close()


def test_threads_share_a_store_beside_its_kept_connection(redis_server: Server) -> None:
    """One thread at a time uses the kept connection; the others take pooled ones."""
    store = open_store(redis_server.url, key_prefix=_prefix())
    ids = [[f"t{t}-{n}" for n in range(40)] for t in range(6)]
    answers: list[bool] = []

    def work(mine: list[str]) -> None:
        answers.extend(store.add(i) for i in mine)

    try:
        threads = [threading.Thread(target=work, args=(mine,)) for mine in ids]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert answers == [True] * 240
        every = [i for mine in ids for i in mine]
        assert store.processed_among(every) == set(every)
    finally:
        store.close()


# ---------------------------------------------------------------------- ACL hints


def _script_commands(script: str) -> set[str]:
    return {f"+{name.lower()}" for name in re.findall(r"redis\.call\('(\w+)'", script)}


@pytest.mark.parametrize(
    ("cls", "script"),
    [
        (RedisDeduplicationStore, redis_store.ADD_SCRIPT),
        (RedisEntityStore, redis_entities._JOINT_SCRIPT),  # the save script and the add's
        (RedisDispatcher, redis_dispatcher._DISPATCH_SCRIPT),
    ],
    ids=["store", "entities", "dispatcher"],
)
def test_the_grant_hint_names_every_command_a_script_runs(cls: Any, script: str) -> None:
    """What an ACL refusal tells the operator to grant (``_commands``) covers the client's
    script, the joined one included; and a script's client says what an unconfirmed
    write means (``_unconfirmed``)."""
    named = set(cls.commands.replace(",", " ").split())
    assert _script_commands(script) - named == set()
    assert {"+evalsha", "+script|load", "+ping", "+info"} <= named
    assert isinstance(cls.unconfirmed, str) and cls.unconfirmed


def test_the_broker_names_its_commands() -> None:
    assert "+xreadgroup" in RedisStreamsBroker.commands.split()


# ---------------------------------------------------------------------- token store


class TestRedisTokenStore(TokenStoreContract):
    @pytest.fixture
    def token_store_factory(self, redis_server: Server) -> TokenStoreFactory:
        url, prefix = redis_server.url, _prefix()

        def make(**options: Any) -> TokenStore:
            return RedisTokenStore(url, key_prefix=prefix, **options)

        return make


def test_tokens_use_the_documented_key_and_value_and_never_expire(redis_server: Server) -> None:
    prefix = _prefix()
    tokens = RedisTokenStore(redis_server.url, key_prefix=prefix, clock=FakeClock(1_000_000.5))
    admin = _admin(redis_server.url)
    try:
        assert RedisTokenStore.declared_options["key_prefix"].default == "dedup_tokens:"
        tokens.create({"t:{1}": "billing:{eu}", "%3A": "e"})
        key = f"{prefix}t%3A%7B1%7D"
        assert key == token_key(prefix, "t:{1}")
        assert admin.get(key) == b'dst1:{"endpoint":"billing:{eu}","created":1000000.5}'
        assert admin.pttl(key) == -1, "a token never expires"
        assert admin.exists(f"{prefix}%253A") == 1
        assert sorted(admin.scan_iter(match=prefix + "*")) == sorted(
            [key.encode(), f"{prefix}%253A".encode()]
        )
        assert tokens.outstanding() == {
            "billing:{eu}": TokenCount(1, 1_000_000.5),
            "e": TokenCount(1, 1_000_000.5),
        }
    finally:
        tokens.close()
        admin.close()


def test_token_keys_have_no_hash_tag_and_spread_over_slots() -> None:
    for part in _TRICKY_PARTS:
        key = token_key("dedup_tokens:", part)
        assert "{" not in key and "}" not in key, key
    tagged = [token_key("dedup_tokens:", f"{{hash}}{n}") for n in range(200)]
    assert len({key_slot(k.encode()) for k in tagged}) > 150


def test_token_outstanding_scans_only_its_own_prefix(redis_server: Server) -> None:
    """A glob character in a prefix matches only itself: neither a deduplication store's
    records nor another token store's tokens are counted."""
    base, clock = _prefix(), FakeClock(7.0)
    globbed = RedisTokenStore(redis_server.url, key_prefix=f"{base}t*:", clock=clock)
    plain = RedisTokenStore(redis_server.url, key_prefix=f"{base}tx:", clock=clock)
    records = RedisDeduplicationStore(redis_server.url, key_prefix=f"{base}t:", endpoint="e")
    try:
        globbed.create({"one": "e"})
        plain.create({"two": "e", "three": "e"})
        assert records.add_many(["r1", "r2"]) == {"r1", "r2"}
        assert globbed.outstanding() == {"e": TokenCount(1, 7.0)}
        assert plain.outstanding() == {"e": TokenCount(2, 7.0)}
        assert records.count() == 2
    finally:
        for client in (globbed, plain, records):
            client.close()


def test_a_foreign_key_under_the_token_prefix_is_a_loud_error(redis_server: Server) -> None:
    """A value dedupstore did not write, or a key of another type (which ``MGET`` reads as
    nil), is a ConfigurationError: a silent "absent" would drop a message."""
    prefix = _prefix()
    tokens = RedisTokenStore(redis_server.url, key_prefix=prefix)
    admin = _admin(redis_server.url)
    try:
        tokens.create({"mine": "e"})
        admin.hset(token_key(prefix, "hashed"), "field", "value")
        with pytest.raises(ConfigurationError, match="another type") as info:
            tokens.present("hashed")
        assert "\n" not in str(info.value)
        with pytest.raises(ConfigurationError, match="another type"):
            tokens.present_among(["mine", "hashed", "absent"])
        assert tokens.present_among(["mine", "absent"]) == {"mine"}
        counts = tokens.outstanding()
        assert list(counts) == ["e"] and counts["e"].outstanding == 1, "the hash is not counted"
        admin.set(token_key(prefix, "intruder"), "not ours")
        with pytest.raises(ConfigurationError, match="did not write"):
            tokens.present("intruder")
        with pytest.raises(ConfigurationError, match="did not write"):
            tokens.outstanding()
        admin.set(token_key(prefix, "intruder"), "dst1:[1, 2]")
        with pytest.raises(ConfigurationError, match="did not write"):
            tokens.outstanding()
    finally:
        tokens.close()
        admin.close()


def test_a_token_store_refuses_a_server_that_may_evict_keys(own_redis_server: RedisServer) -> None:
    """INFO memory, not CONFIG GET: refused even for a user who may not run CONFIG."""
    url = own_redis_server.url
    admin = _admin(url)
    try:
        admin.acl_setuser(
            "no-config", enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all", "-config"]
        )
        admin.config_set("maxmemory-policy", "allkeys-lru")
        for options in ({}, {"username": "no-config", "password": "pw"}):
            with pytest.raises(ConfigurationError, match="allkeys-lru") as info:
                RedisTokenStore(url, key_prefix=_prefix(), **options)
            message = str(info.value)
            assert "maxmemory-policy noeviction" in message and "\n" not in message, message
        # a deduplication store only warns: an evicted record means a duplicate, not a loss
        with open_store(url, key_prefix=_prefix()) as store:
            assert any("evict" in w for w in store.health_warnings())
        admin.config_set("maxmemory-policy", "noeviction")
        with RedisTokenStore(url, key_prefix=_prefix(), username="no-config", password="pw") as t:
            t.create({"after": "e"})
            assert t.present("after")
        with RedisTokenStore(url, key_prefix=_prefix()) as t:
            assert t.health_warnings() == []
            admin.config_set("maxmemory-policy", "volatile-lru")  # changed while open
            (warning,) = t.health_warnings()
            assert "volatile-lru" in warning and "noeviction" in warning
    finally:
        admin.config_set("maxmemory-policy", "noeviction")
        admin.close()


def test_a_token_store_refuses_a_replica(replica: _ReplicaServer) -> None:
    """Reads must be strongly consistent: never served by a replica."""
    with pytest.raises(ConsistencyError, match="replica"):
        RedisTokenStore(replica.url, key_prefix=_prefix())


def test_token_calls_cost_one_request_per_chunk(own_redis_server: RedisServer) -> None:
    tokens = RedisTokenStore(own_redis_server.url, key_prefix=_prefix())
    admin = _admin(own_redis_server.url)
    try:
        ids = [f"chunk-{i}" for i in range(2 * tokens.max_batch + 1)]
        chunks = 3
        before = {c: _calls(admin, c) for c in ("set", "mget", "exists", "exec", "del", "evalsha")}
        tokens.create(dict.fromkeys(ids, "e"))
        assert tokens.present_among(ids) == set(ids)
        tokens.delete(ids)
        after = {c: _calls(admin, c) - before[c] for c in before}
        assert after == {
            "set": len(ids),  # one SET NX per token, one packet per chunk
            "mget": chunks,
            "exists": chunks,
            "exec": chunks,
            "del": chunks,
            "evalsha": 0,
        }
        assert tokens.present_among(ids) == set()
    finally:
        tokens.close()
        admin.close()


def test_token_writes_wait_for_replicas_when_asked(redis_server: Server) -> None:
    prefix = _prefix()
    waiting = RedisTokenStore(
        redis_server.url, key_prefix=prefix, wait_replicas=1, wait_timeout_ms=50
    )
    other = RedisTokenStore(redis_server.url, key_prefix=prefix)
    try:
        with pytest.raises(StoreUnavailable, match="0 of 1 replicas") as info:
            waiting.create({"waited": "e"})
        assert "durability is unknown" in str(info.value)
        assert info.value.unknown == {"waited"}
        assert other.present("waited"), "the token is on the primary"
        with pytest.raises(StoreUnavailable, match="durability is unknown"):
            waiting.delete(["waited"])
        assert not other.present("waited")
    finally:
        waiting.close()
        other.close()


def test_killed_server_raises_then_the_token_store_recovers(own_redis_server: RedisServer) -> None:
    """AOF with appendfsync always: every acknowledged token survives a kill -9."""
    prefix = _prefix()
    tokens = RedisTokenStore(own_redis_server.url, key_prefix=prefix, retries=1)
    try:
        acked = [f"acked-{i}" for i in range(50)]
        tokens.create(dict.fromkeys(acked, "e"))
        tokens.delete(acked[:10])
        own_redis_server.kill()
        for call in (
            lambda: tokens.create({"during-outage": "e"}),
            lambda: tokens.present_among(acked),
            lambda: tokens.delete(acked),
            tokens.outstanding,
        ):
            with pytest.raises(StoreUnavailable) as info:
                call()
            assert isinstance(info.value.__cause__, redis.ConnectionError), info.value.__cause__
        own_redis_server.restart()
        assert tokens.present_among(acked) == set(acked[10:]), "an acknowledged write was lost"
        assert tokens.present("during-outage") is False
        assert tokens.outstanding()["e"].outstanding == 40
    finally:
        tokens.close()


def test_token_acl_refusal_names_the_commands_to_grant(own_redis_server: RedisServer) -> None:
    admin = _admin(own_redis_server.url)
    try:
        admin.acl_setuser(
            "no-set", enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all", "-set"]
        )
        tokens = RedisTokenStore(
            own_redis_server.url, key_prefix=_prefix(), username="no-set", password="pw"
        )
        try:
            with pytest.raises(ConfigurationError, match="may not run") as info:
                tokens.create({"refused": "e"})
            assert "+set" in str(info.value).split()
            assert tokens.present("refused") is False
        finally:
            tokens.close()
    finally:
        admin.close()


def test_token_store_on_a_ready_client_decoding_responses(redis_server: Server) -> None:
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    tokens = RedisTokenStore(
        redis_server.url, key_prefix=_prefix(), client=client, clock=FakeClock(5.25)
    )
    try:
        tokens.create({"a": "é", "b": "é"})
        assert tokens.present_among(["a", "b", "c"]) == {"a", "b"}
        assert tokens.outstanding() == {"é": TokenCount(2, 5.25)}
    finally:
        tokens.close()
    assert client.ping() is True
    client.close()


class _LosingTokenConnection(RedisConnection):
    """Sends the writes, then loses the answers of the next ``losses`` ones. One per store."""

    losses = 0

    @classmethod
    def key(cls, url: StoreURL, options: Options) -> Hashable:
        return object()

    def _send(self, commands: list[tuple[Any, ...]], sent: list[bool]) -> list[Any]:
        replies = super()._send(commands, sent)
        if self.losses > 0:
            self.losses -= 1
            raise redis.ConnectionError("answer lost (simulated)")
        return replies


class _LosingTokenStore(RedisTokenStore):
    _redis = Connected(_LosingTokenConnection)


def test_token_writes_whose_answer_was_lost_are_resent_harmlessly(redis_server: Server) -> None:
    prefix, clock = _prefix(), FakeClock(100.0)
    tokens = _LosingTokenStore(redis_server.url, key_prefix=prefix, clock=clock)
    once = _LosingTokenStore(redis_server.url, key_prefix=prefix, retries=0)
    try:
        tokens._redis.losses = 1
        tokens.create({"a": "e", "b": "e"})  # written, answer lost, SET NX again: no change
        assert tokens.present_among(["a", "b"]) == {"a", "b"}
        assert tokens.outstanding() == {"e": TokenCount(2, 100.0)}
        tokens._redis.losses = 1
        tokens.delete(["a"])  # deleted, answer lost, DEL again
        assert tokens.present_among(["a", "b"]) == {"b"}
        once._redis.losses = 1
        with pytest.raises(StoreUnavailable) as info:
            once.create({"c": "e"})
        assert info.value.unknown == {"c"} and not info.value.recorded
        once.create({"c": "e"})  # the caller's retry completes it
        assert tokens.present_among(["a", "b", "c"]) == {"b", "c"}
    finally:
        tokens.close()
        once.close()
