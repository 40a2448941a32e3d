"""The Redis backend: the shared contract plus Redis-specific behaviour."""

from __future__ import annotations

import contextlib
import itertools
import os
import pickle
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
import redis
from redis.crc import key_slot

from backends.redis import RedisDeduplicationStore, record_key
from dedupstore import DeduplicationStore, open_store
from dedupstore.errors import ConfigurationError, ConsistencyError, StoreUnavailable
from dedupstore.testing import (
    DeduplicationStoreContract,
    FakeClock,
    MultiProcessContract,
    StoreFactory,
)
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


def test_purge_touches_only_its_own_endpoint_and_prefix(redis_server: Server) -> None:
    clock = FakeClock()
    base = _prefix()
    hour = timedelta(hours=1)
    # glob characters in the endpoint, an endpoint that is a prefix of another, and a
    # store whose key_prefix equals another store's prefix + endpoint + ':'
    specs = [(base, "a"), (base, "a*"), (base, "ab"), (base, "a:"), (f"{base}a:", "x")]
    stores = [
        RedisDeduplicationStore(
            redis_server.url, key_prefix=p, endpoint=e, retention=hour, clock=clock
        )
        for p, e in specs
    ]
    try:
        for n, store in enumerate(stores):
            store.add_many([f"id-{i}" for i in range(n + 1)] + ["x:y", "*"])
        clock.advance(timedelta(hours=2))
        assert stores[1].purge_expired() == 2 + 2
        for n, store in enumerate(stores):
            if n != 1:
                assert store.purge_expired() == n + 1 + 2, specs[n]
        admin = _admin(redis_server.url)
        assert list(admin.scan_iter(match=base + "*")) == []
        admin.close()
    finally:
        for store in stores:
            store.close()


def test_key_prefix_must_end_with_a_colon(redis_server: Server) -> None:
    with pytest.raises(ConfigurationError, match="key_prefix"):
        open_store(redis_server.url, key_prefix="dedup")
    store = open_store(redis_server.url, key_prefix="")
    store.close()


def test_records_use_the_documented_key_and_a_native_ttl_beyond_the_expiry(
    redis_server: Server,
) -> None:
    prefix = _prefix()
    clock = FakeClock()
    keeper = RedisDeduplicationStore(redis_server.url, key_prefix=prefix, endpoint="e:{x}")
    expiring = RedisDeduplicationStore(
        redis_server.url, key_prefix=prefix, endpoint="e", retention=timedelta(hours=1), clock=clock
    )
    admin = _admin(redis_server.url)
    try:
        keeper.add("m:{1}")
        expiring.add("m")
        assert admin.exists(f"{prefix}e%3A%7Bx%7D:m%3A%7B1%7D") == 1
        assert admin.pttl(f"{prefix}e%3A%7Bx%7D:m%3A%7B1%7D") == -1, "no retention, no TTL"
        ttl = admin.pttl(f"{prefix}e:m")
        assert 3_600_000 < ttl <= 3_600_000 + 60_000
        value = admin.get(f"{prefix}e:m")
        assert isinstance(value, bytes)
        token, _, expiry = value.decode().partition("|")
        assert token and float(expiry) == pytest.approx(clock.now + 3600)
        # re-recording without retention removes the native TTL
        clock.advance(timedelta(hours=2))
        plain = RedisDeduplicationStore(
            redis_server.url, key_prefix=prefix, endpoint="e", clock=clock
        )
        assert plain.add("m") is True
        assert admin.pttl(f"{prefix}e:m") == -1
        plain.close()
    finally:
        keeper.close()
        expiring.close()
        admin.close()


def test_foreign_value_under_the_prefix_is_a_loud_error(store_factory: StoreFactory) -> None:
    store = store_factory(endpoint="e")
    admin = _admin(store.url)
    try:
        key = f"{store._options['key_prefix']}e:intruder"
        admin.set(key, "not ours")
        with pytest.raises(ConfigurationError, match="did not write"):
            store.add("intruder")
        with pytest.raises(ConfigurationError, match="did not write"):
            store.add_many(["fresh", "intruder"])
        assert store.has_been_processed("fresh") is False, "a failed batch wrote nothing"
        with pytest.raises(ConfigurationError, match="did not write"):
            store.processed_among(["intruder"])
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
            store.purge_expired,
        ]
        for call in calls:
            with pytest.raises(StoreUnavailable) as info:
                call()
            assert isinstance(info.value.__cause__, redis.ConnectionError), info.value.__cause__
            assert "\n" not in str(info.value)

        own_redis_server.restart()
        assert store.processed_among(acked) == set(acked), "an acknowledged id was lost"
        assert all(store.has_been_processed(m) for m in acked)
        assert store.add(acked[0]) is False
        assert store.add("during-outage") is True
        assert store.add_many(["during-outage", "other"]) == {"other"}
    finally:
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
    store = open_store(url, key_prefix=prefix, socket_timeout=0.5, retries=2)
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
    store = open_store(url, key_prefix=prefix, socket_timeout=0.5, retries=1)
    other = open_store(redis_server.url, key_prefix=prefix)
    try:
        proxy.drop_new_connections = True
        proxy.drop_replies_on_open_connections()
        with pytest.raises(StoreUnavailable) as info:
            store.add_many(["unknown-1", "unknown-2"])
        assert isinstance(info.value.__cause__, redis.TimeoutError)
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
    good = open_store(f"redis://:s3cret-pass@{host}/0", key_prefix=_prefix())
    assert good.add("authenticated") is True
    assert "s3cret-pass" not in repr(good)
    good.close()
    by_option = open_store(f"redis://{host}/0", password="s3cret-pass", key_prefix=_prefix())
    assert "s3cret-pass" not in repr(by_option) and "***" in repr(by_option)
    assert "s3cret-pass" not in repr(pickle.loads(pickle.dumps(by_option)))
    by_option.close()


@pytest.mark.parametrize("host", ["no-such-host.invalid:6379", "unused-port"])
def test_unreachable_server_is_a_one_line_store_unavailable(host: str) -> None:
    if host == "unused-port":
        host = f"{HOST}:{free_port()}"
    with pytest.raises(StoreUnavailable) as info:
        open_store(f"redis://:pw-secret@{host}/0", socket_connect_timeout=2)
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
        ("/0?wait_replicas=1&wait_timeout_ms=9000", {}, "socket_timeout"),
        ("/0?socket_timeout=-1", {}, "socket_timeout"),
        ("/0", {"retries": "x"}, "retries"),
        ("/0", {"ssl_ca_certs": "/tmp/ca.pem"}, "rediss"),
    ],
)
def test_bad_configuration(
    redis_server: Server, url_tail: str, options: dict[str, Any], match: str
) -> None:
    url = redis_server.url.rsplit("/", 1)[0] + url_tail
    with pytest.raises(ConfigurationError, match=match) as info:
        open_store(url, **options)
    assert "\n" not in str(info.value)


def test_url_options_are_typed_and_pickled(redis_server: Server) -> None:
    prefix = _prefix()
    url = f"{redis_server.url}?key_prefix={prefix}&retries=0&socket_timeout=3&max_connections=4"
    store = open_store(url, endpoint="typed", retention="1d")
    clone = pickle.loads(pickle.dumps(store))
    try:
        assert clone._options["retries"] == 0
        assert clone._options["socket_timeout"] == 3.0
        assert "retries=0" in repr(clone) and "username" not in repr(clone)
        blocking = open_store(redis_server.url, key_prefix=prefix, socket_timeout="none")
        assert pickle.loads(pickle.dumps(blocking))._options["socket_timeout"] is None
        blocking.close()
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
        assert store.processed_among(["via-client", "nope"]) == {"via-client"}
        assert "client=" not in repr(store) or "***" in repr(store)
        clone = pickle.loads(pickle.dumps(store))
        assert clone.has_been_processed("via-client")
        clone.close()
    finally:
        store.close()
    assert client.ping() is True, "close() must leave a caller's client alone"
    client.close()
