"""The PostgreSQL backend: the shipped contract plus failures, configuration and schema."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import multiprocessing
import os
import pickle
import random
import re
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import psycopg
import psycopg.errors
import pytest
from psycopg import sql
from psycopg_pool import ConnectionPool

from dedupstore import DeduplicationStore, aio, open_store
from dedupstore.backends.postgres import (
    DEFAULT_TOKEN_TABLE,
    PostgresDeduplicationStore,
    PostgresTokenStore,
)
from dedupstore.errors import (
    ConfigurationError,
    DedupStoreError,
    StoreUnavailable,
)
from dedupstore.testing import (
    DeduplicationStoreContract,
    MultiProcessContract,
    StoreFactory,
    TokenStoreContract,
    TokenStoreFactory,
)
from dedupstore.tokens import TokenCount, TokenStore
from tests.outbox_backends import own_connection
from tests.proxy import TcpProxy
from tests.servers import PostgresServer, Server, _freeze_tree, free_port

pytestmark = pytest.mark.postgres


def _table() -> str:
    return f"dedup_{uuid.uuid4().hex}"


def _drop(url: str, *tables: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        for table in tables:
            conn.execute(
                sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(*table.split(".")))
            )


def _with_password(url: str, password: str) -> str:
    parts = urlsplit(url)
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:{password}@{host}"))


@pytest.fixture
def fresh_table(postgres_server: Server) -> Iterator[str]:
    """A table name nobody uses, dropped after the test."""
    table = _table()
    yield table
    _drop(postgres_server.url, table)


class TestPostgresStore(DeduplicationStoreContract, MultiProcessContract):
    @pytest.fixture
    def store_factory(self, postgres_server: Server) -> Iterator[StoreFactory]:
        table = _table()
        url = f"{postgres_server.url}?table={table}&create=true&pool_min_size=1"

        def make(**options: Any) -> DeduplicationStore:
            return open_store(url, **options)

        yield make
        _drop(postgres_server.url, table)


class TestPostgresTokenStore(TokenStoreContract):
    @pytest.fixture
    def token_store_factory(self, postgres_server: Server) -> Iterator[TokenStoreFactory]:
        table = f"tokens_{uuid.uuid4().hex}"
        url = f"{postgres_server.url}?table={table}&create=true&pool_min_size=1"

        def make(**options: Any) -> TokenStore:
            return PostgresTokenStore(url, **options)

        yield make
        _drop(postgres_server.url, table)


# ---------------------------------------------------------------------- failures


def _open_owned(server: PostgresServer, **options: Any) -> DeduplicationStore:
    return open_store(
        server.url, **{"table": "dedup", "create": True, "connect_timeout": 3, **options}
    )


def _assert_unavailable(call: Callable[[], object]) -> StoreUnavailable:
    with pytest.raises(StoreUnavailable) as info:
        call()
    assert isinstance(info.value.__cause__, psycopg.Error), repr(info.value.__cause__)
    assert len(str(info.value).splitlines()) == 1
    return info.value


def test_server_killed_mid_run_then_restarted(own_postgres_server: PostgresServer) -> None:
    server = own_postgres_server
    store = _open_owned(server)
    acknowledged: list[str] = []
    answers: list[object] = []
    failure: list[BaseException] = []
    enough = threading.Event()

    def writer() -> None:
        n = 0
        try:
            while True:
                n += 1
                mid = f"run-{n}"
                if n % 4:
                    answers.append(store.add(mid))
                    acknowledged.append(mid)
                else:
                    batch = [mid, f"{mid}-b", f"{mid}-c"]
                    answers.append(store.add_many(batch))
                    acknowledged.extend(batch)
                if len(acknowledged) >= 150:
                    enough.set()
        except BaseException as exc:  # noqa: BLE001 - inspected below
            failure.append(exc)
            enough.set()

    thread = threading.Thread(target=writer)
    thread.start()
    assert enough.wait(120)
    server.kill()
    thread.join(120)
    assert not thread.is_alive()
    assert len(failure) == 1 and isinstance(failure[0], StoreUnavailable), failure
    assert isinstance(failure[0].__cause__, psycopg.Error), repr(failure[0].__cause__)
    # every answer before the kill was "recorded now": nothing says "already processed"
    assert all(a is True or (isinstance(a, set) and len(a) == 3) for a in answers)

    _assert_unavailable(lambda: store.add("during-outage"))
    _assert_unavailable(lambda: store.add_many(["during-1", "during-2"]))
    _assert_unavailable(lambda: store.has_been_processed(acknowledged[0]))
    _assert_unavailable(lambda: store.processed_among(acknowledged))

    server.restart()
    assert store.processed_among(acknowledged) == set(acknowledged)
    assert store.add("after-restart") is True
    assert store.add(acknowledged[-1]) is False
    assert store.add_many(["after-1", acknowledged[0]]) == {"after-1"}
    store.close()


def test_restart_while_idle_is_invisible(own_postgres_server: PostgresServer) -> None:
    """Pooled connections the server closed are replaced, not reported as failures."""
    server = own_postgres_server
    store = _open_owned(server, pool_min_size=3, pool_max_size=3)
    ids = [f"idle-{i}" for i in range(30)]
    barrier = threading.Barrier(3)

    def use() -> None:  # three concurrent calls: three connections in the pool
        barrier.wait()
        store.add_many(ids)

    threads = [threading.Thread(target=use) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    server.kill()
    server.restart()
    for mid in ids:  # each call may draw a stale connection: none may fail
        assert store.has_been_processed(mid) is True
        assert store.add(mid) is False
    assert store.add("fresh") is True
    store.close()


def _age(url: str, table: str, seconds: float) -> None:
    """Move every record's expiry ``seconds`` into the past, as if that much time passed."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("UPDATE {} SET expires_at = expires_at - %s").format(
                sql.Identifier(*table.split("."))
            ),
            [seconds],
        )


def test_expired_records_survive_as_absent_after_restart(
    own_postgres_server: PostgresServer,
) -> None:
    store = _open_owned(own_postgres_server, retention="1h")
    assert store.add_many(["a", "b"]) == {"a", "b"}
    own_postgres_server.kill()
    own_postgres_server.restart()
    _age(own_postgres_server.url, "dedup", 7200)
    assert store.processed_among(["a", "b"]) == set()
    assert store.add_many(["a", "b", "c"]) == {"a", "b", "c"}
    assert store.purge_expired() == 0
    store.close()


# ---------------------------------------------------------------------- configuration


def test_wrong_password_is_a_one_line_configuration_error(
    postgres_server: Server, fresh_table: str
) -> None:
    url = _with_password(postgres_server.url, "not-the-Secret-pw")
    with pytest.raises(ConfigurationError) as info:
        open_store(url, table=fresh_table, create=True)
    message = str(info.value)
    assert len(message.splitlines()) == 1
    assert "password authentication failed" in message
    assert "not-the-Secret-pw" not in message
    assert "***" in message


def test_a_refused_open_tries_to_log_in_once(
    postgres_server: Server, fresh_table: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pool starts only once the open's own check passed: a server refusing the
    credentials (counted toward an account lockout, say) sees one attempt, not the
    pool's background ones too."""
    from dedupstore.backends.postgres import _client

    started: list[object] = []
    real_open = _client._OwnPool.open

    def recording_open(pool: Any, *args: Any, **kwargs: Any) -> None:
        started.append(pool)
        real_open(pool, *args, **kwargs)

    monkeypatch.setattr(_client._OwnPool, "open", recording_open)
    alone = {"connect_timeout": 3 + uuid.uuid4().int % 10**6 / 10**7}  # a pool of its own
    with pytest.raises(ConfigurationError, match="password authentication failed"):
        open_store(_with_password(postgres_server.url, "not-the-pw"), table=fresh_table, **alone)
    assert started == []
    with open_store(postgres_server.url, table=fresh_table, create=True, **alone) as store:
        assert len(started) == 1  # started by the open that passed
        assert store.add("after") is True


def test_wrong_password_option_is_masked(postgres_server: Server, fresh_table: str) -> None:
    url = _with_password(postgres_server.url, "").replace(":@", "@")
    with pytest.raises(ConfigurationError) as info:
        open_store(url, table=fresh_table, password="Hunter2-option")
    assert "Hunter2-option" not in str(info.value)
    assert len(str(info.value).splitlines()) == 1


def test_password_option_works(postgres_server: Server, fresh_table: str) -> None:
    parts = urlsplit(postgres_server.url)
    url = urlunsplit(parts._replace(netloc=f"{parts.username}@{parts.hostname}:{parts.port}"))
    with open_store(url, table=fresh_table, create=True, password=parts.password) as store:
        assert store.add("via-password-option") is True
        assert parts.password is not None
        assert f":{parts.password}" not in repr(store)
        assert "password='***'" in repr(store)


def test_unknown_port_is_a_one_line_store_unavailable() -> None:
    url = f"postgresql://dedup:Secret-pw@127.0.0.1:{free_port()}/dedup"
    with pytest.raises(StoreUnavailable) as info:
        open_store(url, connect_timeout=3)
    message = str(info.value)
    assert len(message.splitlines()) == 1
    assert "Secret-pw" not in message
    assert isinstance(info.value.__cause__, psycopg.OperationalError)


def test_unknown_host_is_a_one_line_store_unavailable() -> None:
    with pytest.raises(StoreUnavailable) as info:
        open_store("postgresql://dedup:Secret-pw@no-such-host.invalid/dedup", connect_timeout=3)
    assert len(str(info.value).splitlines()) == 1
    assert "Secret-pw" not in str(info.value)


def test_missing_table_names_it_and_the_fix(postgres_server: Server, fresh_table: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        open_store(postgres_server.url, table=fresh_table)
    message = str(info.value)
    assert len(message.splitlines()) == 1
    assert fresh_table in message
    assert "create_schema(url)" in message and "create=true" in message
    password = urlsplit(postgres_server.url).password
    assert password and f":{password}@" not in message


def test_create_schema_method_then_open(postgres_server: Server, fresh_table: str) -> None:
    url = f"{postgres_server.url}?table={fresh_table}"
    PostgresDeduplicationStore.create_schema(url)
    PostgresDeduplicationStore.create_schema(url)  # idempotent
    with open_store(url) as store:
        assert store.add("x") is True
    with psycopg.connect(postgres_server.url) as conn:
        rows = conn.execute(
            "SELECT attname, collname FROM pg_attribute JOIN pg_collation c "
            "ON c.oid = attcollation WHERE attrelid = to_regclass(%s)",
            [fresh_table],
        ).fetchall()
    assert dict(rows) == {"endpoint": "C", "id": "C", "writer": "default"}


def test_create_schema_concurrently(postgres_server: Server, fresh_table: str) -> None:
    url = f"{postgres_server.url}?table={fresh_table}&pool_min_size=0"
    errors: list[BaseException] = []
    barrier = threading.Barrier(6)

    def run() -> None:
        try:
            barrier.wait()
            PostgresDeduplicationStore.create_schema(url)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_schema_qualified_table_with_odd_name(postgres_server: Server) -> None:
    schema = f"Dedup Schema {uuid.uuid4().hex[:8]}"
    table = f'{schema}.Records "quoted" 🦄'
    try:
        with open_store(postgres_server.url, table=table, create=True) as store:
            assert store.add("q") is True
        with open_store(postgres_server.url, table=table) as store:
            assert store.add("q") is False
        with pytest.raises(ConfigurationError, match="does not exist"):
            open_store(postgres_server.url, table=table.lower())  # names are case-sensitive
    finally:
        with psycopg.connect(postgres_server.url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


@pytest.mark.parametrize("table", ["", "a.b.c", ".x", "x.", "x" * 64, "a\x00b", "s." + "é" * 32])
def test_bad_table_names(postgres_server: Server, table: str) -> None:
    with pytest.raises(ConfigurationError):
        open_store(postgres_server.url, table=table, create=True)


def test_table_of_the_wrong_shape(postgres_server: Server, fresh_table: str) -> None:
    with psycopg.connect(postgres_server.url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE TABLE {} (id text)").format(sql.Identifier(fresh_table)))
    with pytest.raises(ConfigurationError, match="not usable") as info:
        open_store(postgres_server.url, table=fresh_table)
    assert len(str(info.value).splitlines()) == 1


@pytest.mark.parametrize(
    ("query", "fragment"),
    [
        ("tabel=x", "tabel"),
        ("pool_min_size=many", "pool_min_size"),
        ("pool_min_size=5&pool_max_size=2", "pool"),
        ("connect_timeout=0", "connect_timeout"),
        ("create_schema=true", "unknown option 'create_schema'"),
        ("create=maybe", "create"),
        ("timeout=0", "timeout"),
        ("timeout=forever", "timeout"),
        ("retention=soon", "retention"),
        ("clock=time", "clock"),
        ("sslmode=bogus", "sslmode"),
        ("keepalives_idle=soon", "keepalives_idle"),
    ],
)
def test_bad_url_options(postgres_server: Server, query: str, fragment: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        open_store(f"{postgres_server.url}?{query}")
    assert fragment in str(info.value)
    assert len(str(info.value).splitlines()) == 1


def test_libpq_parameters_pass_through(postgres_server: Server, fresh_table: str) -> None:
    name = f"dedup-test-{uuid.uuid4().hex[:8]}"
    url = (
        f"{postgres_server.url}?table={fresh_table}&create=true&application_name={name}"
        "&pool_max_size=2&connect_timeout=5"
    )
    with open_store(url) as store:
        store.add("x")
        with psycopg.connect(postgres_server.url) as conn:
            count = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", [name]
            ).fetchone()
        assert count is not None and count[0] >= 1
        clone = pickle.loads(pickle.dumps(store))
        assert clone.has_been_processed("x")
        clone.close()


def test_url_and_keyword_options_combine(postgres_server: Server, fresh_table: str) -> None:
    url = f"{postgres_server.url}?endpoint=orders&create=true"
    with open_store(url, table=fresh_table) as store:
        assert store.endpoint == "orders"
        assert store.add("o-1") is True
        clone = pickle.loads(pickle.dumps(store))
        assert clone.endpoint == "orders" and clone.add("o-1") is False
        clone.close()
    with open_store(f"{url}&table={fresh_table}", table=fresh_table) as same:
        assert same.add("o-1") is False  # the same value twice is fine


def test_url_and_keyword_conflict_is_refused(postgres_server: Server, fresh_table: str) -> None:
    url = f"{postgres_server.url}?table=not_this_one&create=true"
    with pytest.raises(ConfigurationError, match="both in the URL and as a keyword"):
        open_store(url, table=fresh_table)
    with psycopg.connect(postgres_server.url) as conn:
        row = conn.execute("SELECT to_regclass('not_this_one') IS NULL").fetchone()
    assert row == (True,)


def test_constructor_reads_url_options_like_open_store(
    postgres_server: Server, fresh_table: str
) -> None:
    url = f"{postgres_server.url}?table={fresh_table}&create=true&endpoint=direct"
    with PostgresDeduplicationStore(url) as store:
        assert store.endpoint == "direct"
        assert store.add("direct") is True
    with open_store(url) as store:
        assert store.add("direct") is False


def test_string_options_convert(postgres_server: Server, fresh_table: str) -> None:
    url = (
        f"{postgres_server.url}?table={fresh_table}&create=true&timeout=5"
        "&connect_timeout=3s&pool_min_size=0&pool_max_size=2"
    )
    with open_store(url) as store:
        assert store.option("timeout") == 5.0
        assert store.option("connect_timeout") == 3.0
        assert store.option("create") is True
        assert store.option("pool_min_size") == 0 and store.option("pool_max_size") == 2
        assert store.add("converted") is True
    with open_store(
        postgres_server.url, table=fresh_table, create="false", timeout="2.5", pool_max_size="3"
    ) as store:
        assert store.option("create") is False and store.option("timeout") == 2.5
        assert store.option("pool_max_size") == 3
        assert store.add("converted") is False


def test_a_name_never_released_is_an_unknown_option(postgres_server: Server) -> None:
    with pytest.raises(
        ConfigurationError, match=r"unknown option 'create_schema' .*known options: .*\bcreate\b"
    ):
        open_store(postgres_server.url, create_schema=True)


def test_clock_option_is_refused(postgres_server: Server, fresh_table: str) -> None:
    """The server's clock judges expiry: a client clock would be silently ignored."""
    assert PostgresDeduplicationStore.expiry_clock == "server"
    with pytest.raises(ConfigurationError, match="clock"):
        open_store(postgres_server.url, table=fresh_table, create=True, clock=time.time)


def test_secrets_absent_from_repr_and_pickle_of_errors(
    postgres_server: Server, fresh_table: str
) -> None:
    password = urlsplit(postgres_server.url).password
    assert password
    with open_store(postgres_server.url, table=fresh_table, create=True) as store:
        assert f":{password}@" not in repr(store)
        assert f":{password}@" not in str(store)
        assert f":{password}@" not in store.url
        assert "***" in repr(store)


@pytest.mark.parametrize(
    "password",
    ["Top%zzSecret", "Top%41Secret%zz"],  # the second decodes to another text than it reads
)
def test_bad_url_does_not_echo_the_password(password: str) -> None:
    url = f"postgresql://dedup:{password}@127.0.0.1/dedup"
    for check in (open_store, PostgresDeduplicationStore.check_options):
        with pytest.raises(ConfigurationError) as info:
            check(url)
        assert "Top" not in str(info.value) and "Secret" not in str(info.value)


# ---------------------------------------------------------------------- behaviour


def test_keys_are_byte_exact(postgres_server: Server, fresh_table: str) -> None:
    variants = ["Straße", "STRASSE", "strasse", "straße", "straße ", "Å", "Å", "ﬁ", "fi"]
    with open_store(postgres_server.url, table=fresh_table, create=True) as store:
        assert store.add_many(variants) == set(variants)
        assert store.processed_among(variants) == set(variants)
        assert store.processed_among(["STRAßE", "strasse  "]) == set()


def test_one_statement_per_chunk(
    postgres_server: Server, fresh_table: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store(postgres_server.url, table=fresh_table, create=True)
    statements: list[object] = []
    original = psycopg.Connection.execute

    def counting(self: psycopg.Connection[Any], query: Any, *args: Any, **kwargs: Any) -> Any:
        if fresh_table.encode() in (query if isinstance(query, bytes) else str(query).encode()):
            statements.append(query)  # not the session set-up of new pooled connections
        return original(self, query, *args, **kwargs)

    monkeypatch.setattr(psycopg.Connection, "execute", counting)
    ids = [f"chunk-{i}" for i in range(store.max_write_batch * 2 + 1)]
    assert store.add_many(ids) == set(ids)
    assert len(statements) == 3
    statements.clear()
    assert store.processed_among(ids) == set(ids)
    assert len(statements) == -(-len(ids) // store.max_read_batch)
    store.close()


def test_overlapping_large_batches_never_deadlock(
    postgres_server: Server, fresh_table: str
) -> None:
    url = f"{postgres_server.url}?table={fresh_table}&create=true"
    ids = [f"overlap-{i}" for i in range(5000)]
    stores = [open_store(url) for _ in range(4)]
    results: list[set[str]] = [set() for _ in stores]
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(stores))

    def run(index: int) -> None:
        order = ids[:]
        random.Random(index).shuffle(order)
        try:
            barrier.wait()
            results[index] = stores[index].add_many(order)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert sum(len(r) for r in results) == len(ids)
    assert set().union(*results) == set(ids)
    for s in stores:
        s.close()


class _UnsafePostgresServer(PostgresServer):
    """A cluster configured to lose data on a crash (later ``-c`` options win)."""

    def _command(self) -> list[str]:
        unsafe = ["fsync=off", "full_page_writes=off", "synchronous_commit=off"]
        return [*super()._command(), *(arg for opt in unsafe for arg in ("-c", opt))]


def test_health_warnings_on_a_safe_server(postgres_server: Server, fresh_table: str) -> None:
    with open_store(postgres_server.url, table=fresh_table, create=True) as store:
        assert store.health_warnings() == []


def test_health_warnings_on_an_unsafe_server() -> None:
    with _UnsafePostgresServer() as server:
        store = _open_owned(server)
        warnings = store.health_warnings()
        assert len(warnings) == 3, warnings
        assert any(w.startswith("fsync is off") for w in warnings)
        assert any(w.startswith("full_page_writes is off") for w in warnings)
        assert any(w.startswith("synchronous_commit is off on the PostgreSQL") for w in warnings)
        # the store's own sessions still commit durably
        pool = store._pg.pool  # type: ignore[attr-defined]
        with pool.connection() as conn:
            assert conn.execute("SHOW synchronous_commit").fetchone() == ("on",)
        with psycopg.connect(server.url, autocommit=True) as conn:
            conn.execute("ALTER TABLE dedup SET UNLOGGED")
        assert any("UNLOGGED" in w for w in store.health_warnings())
        store.close()


@pytest.fixture
def given_pool(postgres_server: Server) -> Iterator[ConnectionPool[psycopg.Connection[Any]]]:
    """A pool of the user's (autocommit), closed after the test."""
    with ConnectionPool(
        postgres_server.url, min_size=1, max_size=2, kwargs={"autocommit": True}, open=True
    ) as pool:
        yield pool


def test_given_pool_is_used_and_not_closed(
    postgres_server: Server, fresh_table: str, given_pool: ConnectionPool[Any]
) -> None:
    pool = given_pool
    store = open_store(postgres_server.url, table=fresh_table, create=True, client=pool)
    assert store.add("pooled") is True
    clone = pickle.loads(pickle.dumps(store))  # reconnects by configuration
    assert clone.has_been_processed("pooled")
    clone.close()
    store.close()
    assert not pool.closed
    with pool.connection() as conn:
        conn.execute("SELECT 1")


def test_given_pool_must_make_autocommit_connections(
    postgres_server: Server, fresh_table: str
) -> None:
    pool: ConnectionPool[psycopg.Connection[Any]] = ConnectionPool(
        postgres_server.url, min_size=1, max_size=1, open=True
    )
    try:
        with pytest.raises(ConfigurationError, match="autocommit"):
            open_store(postgres_server.url, table=fresh_table, create=True, client=pool)
        assert not pool.closed
    finally:
        pool.close()


def _forked_child(store: DeduplicationStore) -> None:
    assert store.add("from-child") is True
    assert store.has_been_processed("from-parent")


def _child_with_a_pool_of_its_own(store: DeduplicationStore, parents: int) -> None:
    assert id(store._pg.pool) != parents  # type: ignore[attr-defined]
    _forked_child(store)


@pytest.mark.parametrize("given", [False, True], ids=["own pool", "given pool"])
def test_store_survives_fork(
    postgres_server: Server, fresh_table: str, request: pytest.FixtureRequest, given: bool
) -> None:
    """A child uses a pool of its own (the parent's sockets are the parent's), a given
    pool included, and leaves the parent's working (a given one open)."""
    pool = request.getfixturevalue("given_pool") if given else None
    options = {"client": pool} if given else {}
    store = open_store(postgres_server.url, table=fresh_table, create=True, **options)
    assert store.add("from-parent") is True
    parents = store._pg.pool  # type: ignore[attr-defined]
    assert pool is None or parents is pool
    child = multiprocessing.get_context("fork").Process(
        target=_child_with_a_pool_of_its_own, args=(store, id(parents))
    )
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert store.has_been_processed("from-child")
    assert store.add("parent-again") is True
    store.close()
    assert pool is None or not pool.closed


def test_postgres_scheme_alias(postgres_server: Server, fresh_table: str) -> None:
    url = postgres_server.url.replace("postgresql://", "postgres://", 1)
    with open_store(url, table=fresh_table, create=True) as store:
        assert isinstance(store, PostgresDeduplicationStore)
        assert store.add("alias") is True


# ---------------------------------------------------------------------- server clock


def test_expiry_is_judged_by_the_server_clock(
    postgres_server: Server, fresh_table: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two clients whose clocks disagree by a day still agree on what is live."""
    store = open_store(postgres_server.url, table=fresh_table, create=True, retention="1h")
    monkeypatch.setattr(time, "time", lambda: 4_000_000_000.0)  # a client clock far ahead
    skewed = open_store(postgres_server.url, table=fresh_table, retention="1h")
    assert skewed.add("s-1") is True
    assert store.has_been_processed("s-1") and skewed.has_been_processed("s-1")
    assert store.add("s-1") is False
    assert skewed.purge_expired() == 0
    with psycopg.connect(postgres_server.url) as conn:
        row = conn.execute(
            sql.SQL("SELECT expires_at - extract(epoch FROM now())::float8 FROM {}").format(
                sql.Identifier(fresh_table)
            )
        ).fetchone()
    assert row is not None and 3000 < row[0] <= 3600
    _age(postgres_server.url, fresh_table, 3601)
    assert not skewed.has_been_processed("s-1") and store.processed_among(["s-1"]) == set()
    assert store.purge_expired() == 1
    assert skewed.add("s-1") is True
    store.close()
    skewed.close()


# ---------------------------------------------------------------------- error classes


def _exec(url: str, statement: sql.Composed | str, *params: object) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(statement, list(params) or None)


def _assert_configuration(call: Callable[[], object], *fragments: str) -> ConfigurationError:
    with pytest.raises(DedupStoreError) as info:
        call()
    error = info.value
    assert isinstance(error, ConfigurationError), repr(error)
    message = str(error)
    # a URL in the message never shows its password (the test servers' is 'dedup')
    assert not re.search(r"://[^/\s:@]*:(?!\*\*\*@)[^@\s]*@", message), message
    assert len(message.splitlines()) == 1
    for fragment in fragments:
        assert fragment in message, message
    return error


def test_table_dropped_while_open_is_a_configuration_error(
    postgres_server: Server, fresh_table: str
) -> None:
    store = open_store(postgres_server.url, table=fresh_table, create=True)
    assert store.add("before") is True
    _drop(postgres_server.url, fresh_table)
    fix = "create=true"
    _assert_configuration(lambda: store.add("after"), fresh_table, "does not exist", fix)
    _assert_configuration(lambda: store.add_many(["a", "b"]), fresh_table, fix)
    _assert_configuration(lambda: store.has_been_processed("before"), fresh_table, fix)
    _assert_configuration(lambda: store.processed_among(["before"]), fresh_table, fix)
    _assert_configuration(store.purge_expired, fresh_table, fix)
    PostgresDeduplicationStore.create_schema(postgres_server.url, table=fresh_table)
    assert store.add("after") is True  # the same object works once the table is back
    store.close()


@pytest.fixture
def second_role(postgres_server: Server) -> Iterator[tuple[str, str]]:
    """A login role without privileges: (URL connecting as it, role name)."""
    role, password = f"r_{uuid.uuid4().hex[:12]}", "Role-Pw-" + uuid.uuid4().hex[:8]
    _exec(
        postgres_server.url,
        sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
            sql.Identifier(role), sql.Literal(password)
        ),
    )
    parts = urlsplit(postgres_server.url)
    url = urlunsplit(
        parts._replace(netloc=f"{role}:{quote(password)}@{parts.hostname}:{parts.port}")
    )
    yield url, role
    _exec(postgres_server.url, sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
    _exec(postgres_server.url, sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_refused_permissions_are_configuration_errors(
    postgres_server: Server, fresh_table: str, second_role: tuple[str, str]
) -> None:
    url, role = second_role
    PostgresDeduplicationStore.create_schema(postgres_server.url, table=fresh_table)
    table, grantee = sql.Identifier(fresh_table), sql.Identifier(role)
    error = _assert_configuration(
        lambda: open_store(url, table=fresh_table), "permission denied", "GRANT", fresh_table
    )
    assert "Role-Pw-" not in str(error)
    _exec(
        postgres_server.url,
        sql.SQL("GRANT SELECT, INSERT, UPDATE, DELETE ON {} TO {}").format(table, grantee),
    )
    store = open_store(url, table=fresh_table)
    assert store.add("granted") is True
    _exec(postgres_server.url, sql.SQL("REVOKE INSERT ON {} FROM {}").format(table, grantee))
    _assert_configuration(lambda: store.add("revoked"), "permission denied", "GRANT")
    _assert_configuration(lambda: store.add_many(["r-1", "r-2"]), "permission denied")
    assert store.has_been_processed("granted") is True  # reading is still allowed
    _exec(postgres_server.url, sql.SQL("REVOKE SELECT ON {} FROM {}").format(table, grantee))
    _assert_configuration(lambda: store.has_been_processed("granted"), "permission denied")
    store.close()


def test_wrong_password_of_another_role(
    postgres_server: Server, fresh_table: str, second_role: tuple[str, str]
) -> None:
    url, _ = second_role
    bad = _with_password(url, "Wrong-Role-pw")
    error = _assert_configuration(
        lambda: open_store(bad, table=fresh_table), "password authentication failed"
    )
    assert "Wrong-Role-pw" not in str(error)


@pytest.mark.timeout(120)
def test_password_changed_while_open_is_a_configuration_error(
    postgres_server: Server, fresh_table: str, second_role: tuple[str, str]
) -> None:
    """New pooled connections refused: the pool's wait ends in a ConfigurationError."""
    url, role = second_role
    PostgresDeduplicationStore.create_schema(postgres_server.url, table=fresh_table)
    _exec(
        postgres_server.url,
        sql.SQL("GRANT SELECT, INSERT, UPDATE, DELETE ON {} TO {}").format(
            sql.Identifier(fresh_table), sql.Identifier(role)
        ),
    )
    store = open_store(url, table=fresh_table, connect_timeout=2, pool_min_size=0)
    assert store.add("before") is True
    _exec(
        postgres_server.url,
        sql.SQL("ALTER ROLE {} PASSWORD 'changed-Elsewhere'").format(sql.Identifier(role)),
    )
    _exec(
        postgres_server.url,
        # The timeout makes the server wait until the session is gone, so its socket
        # already reads as closed when the pool checks it (no race with the exit).
        "SELECT pg_terminate_backend(pid, 10000) FROM pg_stat_activity WHERE usename = %s",
        role,
    )
    error = _assert_configuration(lambda: store.add("after"), "password authentication failed")
    assert "Role-Pw-" not in str(error)
    store.close()


def test_missing_database_is_a_configuration_error(postgres_server: Server) -> None:
    parts = urlsplit(postgres_server.url)
    url = urlunsplit(parts._replace(path="/no_such_database"))
    _assert_configuration(lambda: open_store(url), "does not exist")


def test_table_without_writer_column(postgres_server: Server, fresh_table: str) -> None:
    """A table of a pre-release shape is refused, with or without create, and left as is."""
    _exec(
        postgres_server.url,
        sql.SQL(
            'CREATE TABLE {} (endpoint text COLLATE "C" NOT NULL, id text COLLATE "C" NOT NULL, '
            "expires_at double precision, PRIMARY KEY (endpoint, id))"
        ).format(sql.Identifier(fresh_table)),
    )
    _exec(
        postgres_server.url,
        sql.SQL("INSERT INTO {} VALUES ('default', 'old', NULL)").format(
            sql.Identifier(fresh_table)
        ),
    )
    for create in (False, True):
        _assert_configuration(
            functools.partial(open_store, postgres_server.url, table=fresh_table, create=create),
            f'table "{fresh_table}" is not usable as a deduplication table',
            "has no column writer",
            "drop it or name another table",
        )
    with psycopg.connect(postgres_server.url) as conn:
        query = sql.SQL("SELECT * FROM {}").format(sql.Identifier(fresh_table))
        assert conn.execute(query).fetchall() == [("default", "old", None)], "left as it was"


def test_statement_timeout_is_store_unavailable(postgres_server: Server, fresh_table: str) -> None:
    """A statement stuck behind a lock is cancelled by the server after ``timeout``."""
    store = open_store(postgres_server.url, table=fresh_table, create=True, timeout=1)
    with psycopg.connect(postgres_server.url) as blocker:
        blocker.execute(
            sql.SQL("INSERT INTO {} (endpoint, id) VALUES ('default', 'locked')").format(
                sql.Identifier(fresh_table)
            )
        )  # uncommitted: the row stays locked
        with pytest.raises(StoreUnavailable, match="statement timeout") as info:
            store.add("locked")
        assert isinstance(info.value.__cause__, psycopg.errors.QueryCanceled)
        assert info.value.unknown == {"locked"}
        blocker.rollback()
    assert store.add("locked") is True
    store.close()


def test_read_only_server_is_store_unavailable(postgres_server: Server, fresh_table: str) -> None:
    """Sessions that became read-only (failover to a replica): retry later."""
    PostgresDeduplicationStore.create_schema(postgres_server.url, table=fresh_table)
    url = f"{postgres_server.url}?options={quote('-c default_transaction_read_only=on')}"
    with pytest.raises(StoreUnavailable) as info:
        open_store(url, table=fresh_table)
    assert isinstance(info.value.__cause__, psycopg.errors.ReadOnlySqlTransaction)


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (psycopg.OperationalError("server closed the connection unexpectedly"), StoreUnavailable),
        (
            psycopg.errors.QueryCanceled("canceling statement due to statement timeout"),
            StoreUnavailable,
        ),
        (psycopg.errors.AdminShutdown("terminating connection"), StoreUnavailable),
        (psycopg.errors.CannotConnectNow("the database system is starting up"), StoreUnavailable),
        (psycopg.errors.DeadlockDetected("deadlock detected"), StoreUnavailable),
        (psycopg.errors.SerializationFailure("could not serialize"), StoreUnavailable),
        (psycopg.errors.ReadOnlySqlTransaction("read-only transaction"), StoreUnavailable),
        (psycopg.errors.TooManyConnections("too many clients"), StoreUnavailable),
        (psycopg.InterfaceError("the connection is lost"), StoreUnavailable),
        (psycopg.errors.UndefinedTable("relation does not exist"), ConfigurationError),
        (psycopg.errors.UndefinedColumn('column "writer" does not exist'), ConfigurationError),
        (psycopg.errors.InsufficientPrivilege("permission denied"), ConfigurationError),
        (psycopg.errors.InvalidPassword("password authentication failed"), ConfigurationError),
        (psycopg.errors.InvalidAuthorizationSpecification("no role"), ConfigurationError),
        (psycopg.errors.InvalidCatalogName('database "x" does not exist'), ConfigurationError),
        (psycopg.errors.NotNullViolation("null value in column"), ConfigurationError),
        (psycopg.DataError("invalid input"), ConfigurationError),
        (
            psycopg.OperationalError('connection is bad: invalid sslmode value: "x"'),
            ConfigurationError,
        ),
        (psycopg.OperationalError("FATAL: no pg_hba.conf entry for host"), ConfigurationError),
    ],
)
def test_error_classification(
    postgres_server: Server, fresh_table: str, error: Exception, kind: type[Exception]
) -> None:
    store = open_store(postgres_server.url, table=fresh_table, create=True)
    with pytest.raises(DedupStoreError) as info, store.translating_errors("add"):
        raise error
    store.close()
    assert type(info.value) is kind, info.value
    assert info.value.__cause__ is error
    assert len(str(info.value).splitlines()) == 1


# ---------------------------------------------------------------------- bounded failures


@contextlib.contextmanager
def _frozen(server: PostgresServer) -> Iterator[None]:
    """Every process of the server stopped (SIGSTOP): TCP is accepted, nothing answers."""
    postmaster = int((server.data_dir / "postmaster.pid").read_text().split()[0])
    frozen = _freeze_tree(postmaster)
    try:
        yield
    finally:
        # runuser (as root) stops itself when its child stops: resume it too
        for pid in {*frozen, *([server.pid] if server.pid else [])}:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


@pytest.mark.timeout(120)
def test_frozen_server_times_out(own_postgres_server: PostgresServer) -> None:
    store = _open_owned(own_postgres_server, timeout=2, connect_timeout=2, pool_max_size=4)
    assert store.add_many([f"warm-{i}" for i in range(4000)])  # two connections in the pool
    with _frozen(own_postgres_server):
        for call in (
            lambda: store.add("frozen"),
            lambda: store.has_been_processed("warm-1"),
            lambda: store.add_many([f"frozen-{i}" for i in range(5000)]),
            lambda: store.processed_among(["warm-1", "warm-2"]),
        ):
            error = _assert_unavailable(call)
            assert "timed out" in str(error), error
    assert store.has_been_processed("warm-1") is True
    assert store.add("frozen") is True
    assert store.add_many([f"frozen-{i}" for i in range(5000)]) == {
        f"frozen-{i}" for i in range(5000)
    }
    store.close()


def _losing_answers(
    store: DeduplicationStore, statement: bytes, lose: Callable[[int], bool]
) -> None:
    """Make ``store`` run ``statement`` for real, then raise as if the answer was lost."""
    connection = own_connection(store)
    original = connection.execute
    count = 0
    lock = threading.Lock()

    def execute(conn: Any, query: Any, params: Any = None, **kwargs: Any) -> Any:
        nonlocal count
        rows = original(conn, query, params, **kwargs)
        if query == statement:
            with lock:
                count += 1
                number = count
            if lose(number):
                raise psycopg.OperationalError("server closed the connection unexpectedly")
        return rows

    connection.execute = execute


def test_lost_answer_of_add_is_recorded_by_the_retry(
    postgres_server: Server, fresh_table: str
) -> None:
    store = open_store(postgres_server.url, table=fresh_table, create=True)
    other = open_store(postgres_server.url, table=fresh_table)
    _losing_answers(store, store.sql_add_one, lambda n: n <= 2)  # type: ignore[attr-defined]
    for mid in ("lost-1", "lost-2"):
        with pytest.raises(StoreUnavailable) as info:
            store.add(mid)
        assert info.value.unknown == {mid}
        assert isinstance(info.value.__cause__, psycopg.OperationalError)
    assert store.add("lost-1") is True  # the retry on the same object: recorded by it
    assert store.add("lost-1") is False  # exactly once
    assert other.add("lost-2") is False  # another object: somebody recorded it
    assert store.add("lost-2") is True  # ... this object's earlier call
    assert store.add("lost-2") is False
    store.close()
    other.close()


def test_lost_answer_in_add_many_part_way(postgres_server: Server, fresh_table: str) -> None:
    store = open_store(postgres_server.url, table=fresh_table, create=True)
    other = open_store(postgres_server.url, table=fresh_table)
    ids = [f"part-{i:05d}" for i in range(store.max_write_batch * 5)]
    random.Random(7).shuffle(ids)
    _losing_answers(store, store._sql_add_many, lambda n: n == 3)  # type: ignore[attr-defined]
    with pytest.raises(StoreUnavailable) as info:
        store.add_many(ids)
    recorded, unknown = info.value.recorded, info.value.unknown
    assert recorded and unknown and not recorded & unknown
    assert store.processed_among(recorded) == recorded
    retry = store.add_many(ids)
    assert not retry & recorded
    assert retry | recorded == set(ids)
    assert unknown <= retry  # the lost chunk was written, and is reported by the retry
    assert other.add_many(ids) == set()
    store.close()
    other.close()


@pytest.mark.timeout(240)
def test_server_killed_during_a_large_add_many(own_postgres_server: PostgresServer) -> None:
    server = own_postgres_server
    store = _open_owned(server, connect_timeout=2)
    ids = [f"big-{i:06d}" for i in range(40_000)]
    started, killed = threading.Event(), threading.Event()
    original = store._add_new
    calls = 0
    lock = threading.Lock()

    def add_new(request: Any) -> set[str]:
        nonlocal calls
        with lock:
            calls += 1
            number = calls
        if number == 5:  # half-way through the first ten chunks: kill the server now
            started.set()
            killed.wait(60)
        return original(request)

    def killer() -> None:
        if started.wait(120):
            server.kill()
        killed.set()

    store._add_new = add_new  # type: ignore[method-assign]
    thread = threading.Thread(target=killer)
    thread.start()
    try:
        with pytest.raises(StoreUnavailable) as info:
            store.add_many(ids)
    finally:
        started.set()
        thread.join(120)
    recorded, unknown = info.value.recorded, info.value.unknown
    assert len(recorded) >= 3 * store.max_write_batch
    assert unknown and not recorded & unknown
    assert recorded | unknown < set(ids)  # later chunks were never sent
    server.restart()
    assert store.processed_among(recorded) == recorded
    retry = store.add_many(ids)
    assert not retry & recorded
    assert retry | recorded == set(ids)
    assert store.processed_among(ids) == set(ids)
    store.close()


# ---------------------------------------------------------------------- connections reset


@pytest.fixture
def proxy(postgres_server: Server) -> Iterator[TcpProxy]:
    """A TCP proxy to the session's server, to reset the store's connections."""
    with TcpProxy.for_url(postgres_server.url) as proxy:
        yield proxy


_POOL = 3  # connections the store keeps open: every one of them is reset

#: operation -> (the call, its right answer); "seen" is recorded, "absent" is not.
_OPERATIONS: dict[str, tuple[Callable[[DeduplicationStore], object], object]] = {
    "add": (lambda store: store.add("new-1"), True),
    "add_many": (lambda store: store.add_many(["seen", "new-1", "new-2"]), {"new-1", "new-2"}),
    "has_been_processed": (lambda store: store.has_been_processed("seen"), True),
    "processed_among": (lambda store: store.processed_among(["seen", "absent"]), {"seen"}),
}


def _open_through(proxy: TcpProxy, url: str, table: str) -> DeduplicationStore:
    """A store on ``table`` through ``proxy``, its pool full (``_POOL`` open connections)."""
    store = open_store(
        proxy.url(url),
        table=table,
        create=True,
        pool_min_size=_POOL,
        pool_max_size=_POOL + 2,
        connect_timeout=1,
        timeout=5,
    )
    assert store.add_many(["seen"]) == {"seen"}  # a successful call first
    _wait_for_idle_pool(store)
    return store


def _wait_for_idle_pool(store: DeduplicationStore) -> None:
    """Until the pool holds ``_POOL`` idle connections and opens no other one.

    A connection still opening when the network dies hangs until libpq's
    ``connect_timeout`` and holds up the pool's growth meanwhile.
    """
    pool = store._pg.pool  # type: ignore[attr-defined]
    while True:
        stats = pool.get_stats()
        if stats["pool_available"] >= _POOL and stats["pool_size"] == stats["pool_available"]:
            return
        time.sleep(0.01)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("silent", [True, False], ids=["silent-reset", "reset"])
@pytest.mark.parametrize("operation", sorted(_OPERATIONS))
def test_first_call_after_connections_were_reset(
    proxy: TcpProxy, postgres_server: Server, fresh_table: str, operation: str, silent: bool
) -> None:
    """Every pooled connection dies while idle: the next call still answers, and rightly.

    ``silent``: the client learns it only when it sends (the server's host rebooted,
    a NAT or proxy dropped the connection); else it gets the RST at once.
    """
    store = _open_through(proxy, postgres_server.url, fresh_table)
    call, answer = _OPERATIONS[operation]
    with proxy.down("refuse", silent=silent):  # a short outage, while nobody calls
        pass
    assert call(store) == answer
    store.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["refuse", "reset", "hang"])
@pytest.mark.parametrize("operation", sorted(_OPERATIONS))
def test_a_call_during_an_outage_fails_then_the_first_call_after_succeeds(
    proxy: TcpProxy, postgres_server: Server, fresh_table: str, operation: str, mode: str
) -> None:
    store = _open_through(proxy, postgres_server.url, fresh_table)
    call, answer = _OPERATIONS[operation]
    with proxy.down(mode, silent=True):  # type: ignore[arg-type]
        # every connection is dead and no new one answers: an error, within the timeouts
        _assert_unavailable(lambda: call(store))
    assert call(store) == answer
    store.close()


#: connect_timeout of the reconnection test's stores: psycopg_pool retries a failed connection
#: in the background (after about 1 s, then with a backoff) and gives up after
#: ``reconnect_timeout``, which the stores set to ``connect_timeout / 2``.
RECONNECT_CONNECT_TIMEOUT = 4.0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("face", ["sync", "async"])
def test_a_call_waiting_when_the_server_comes_back_is_served(
    proxy: TcpProxy, postgres_server: Server, fresh_table: str, face: str
) -> None:
    """A call waits for a connection while every attempt fails, until the pool's background
    reconnection gives up (its last attempts fail as the server comes back); then the server
    answers again, with over a second of the call's wait left. The call is served within its
    wait: it is not left waiting with no attempt under way until its timeout (it was:
    ``StoreUnavailable`` from a ``PoolTimeout``). On both faces' pools."""
    url = proxy.url(postgres_server.url)
    options = {"table": fresh_table, "create": True, "timeout": 2}
    options["connect_timeout"] = RECONNECT_CONNECT_TIMEOUT

    def outage(began: float) -> None:
        proxy.fail_attempts(began + RECONNECT_CONNECT_TIMEOUT / 2 + 0.1)

    def begin_outage() -> None:
        proxy.reset()
        proxy.outage("hang")

    if face == "sync":
        store = open_store(url, **options)
        try:
            assert store.add("seen") is True
            begin_outage()
            with concurrent.futures.ThreadPoolExecutor(1) as executor:
                waiting = executor.submit(store.add, "new")
                outage(time.monotonic())
                assert waiting.result(30) is True
        finally:
            store.close()
        return

    async def main() -> None:
        store = await aio.open_store(url, **options)
        try:
            assert await store.add("seen") is True
            begin_outage()
            waiting = asyncio.create_task(store.add("new"))
            await asyncio.to_thread(outage, time.monotonic())
            assert await waiting is True
        finally:
            await store.close()

    asyncio.run(main())


def _breaking_answers(
    store: DeduplicationStore | TokenStore, statement: bytes, lose: Callable[[int], bool]
) -> None:
    """Make ``store`` run ``statement`` for real, then lose the answer with the connection."""
    connection = own_connection(store)
    original = connection.execute
    count = 0
    lock = threading.Lock()

    def execute(conn: Any, query: Any, params: Any = None, **kwargs: Any) -> Any:
        nonlocal count
        rows = original(conn, query, params, **kwargs)
        if query == statement:
            with lock:
                count += 1
                number = count
            if lose(number):
                with socket.socket(fileno=os.dup(conn.fileno())) as sock:
                    sock.shutdown(socket.SHUT_RDWR)  # the connection dies after the statement
                original(conn, "SELECT 1")  # raises: the connection is broken
                raise AssertionError("the connection should be broken")
        return rows

    connection.execute = execute


def test_a_socket_closed_before_libpq_noticed_is_resent_too(
    postgres_server: Server, fresh_table: str
) -> None:
    """psycopg's wait can raise "connection socket closed" (the poll saw the socket hang
    up) while libpq still reports the connection OK, so it is not ``broken``: a
    statement the store may re-send is re-sent all the same, and reports its own ids."""
    store = open_store(postgres_server.url, table=fresh_table, create=True)
    connection = own_connection(store)
    original = connection.execute
    lost = [False]

    def execute(conn: Any, query: Any, params: Any = None, **kwargs: Any) -> Any:
        rows = original(conn, query, params, **kwargs)
        if query == store._sql_add_many and not lost[0]:  # type: ignore[attr-defined]
            lost[0] = True
            with socket.socket(fileno=os.dup(conn.fileno())) as sock:
                sock.shutdown(socket.SHUT_RDWR)  # dead, but libpq has not looked yet
            assert not conn.broken
            raise psycopg.OperationalError("connection socket closed")
        return rows

    connection.execute = execute
    ids = [f"id-{i}" for i in range(5)]
    assert store.add_many(ids) == set(ids)  # ran, answer lost, re-sent: still ours
    assert lost[0] and store.add_many(ids) == set()
    store.close()


def test_add_applied_then_connection_lost_is_reported_as_recorded(
    postgres_server: Server, fresh_table: str
) -> None:
    """A write re-sent after its answer was lost still reports what this call recorded."""
    store = open_store(postgres_server.url, table=fresh_table, create=True)
    other = open_store(postgres_server.url, table=fresh_table)
    assert other.add("theirs") is True
    _breaking_answers(store, store.sql_add_one, lambda n: n == 1)  # type: ignore[attr-defined]
    assert store.add("mine") is True  # applied, answer lost, re-sent: still "recorded now"
    _breaking_answers(store, store._sql_add_many, lambda n: n == 1)  # type: ignore[attr-defined]
    ids = [f"many-{i}" for i in range(10)]
    assert store.add_many([*ids, "theirs"]) == set(ids)
    assert store.add_many([*ids, "mine"]) == set()  # exactly once
    assert other.add_many([*ids, "mine"]) == set()
    store.close()
    other.close()


# ---------------------------------------------------------------------- token store


def test_token_table_layout(postgres_server: Server) -> None:
    """The default table (created in the first schema of the search path): its columns and key,
    and the rows of tokens (an existing token left as it was)."""
    schema = f"tokens_{uuid.uuid4().hex[:12]}"
    _exec(postgres_server.url, sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    url = f"{postgres_server.url}?options=-csearch_path%3D{schema}"
    try:
        PostgresTokenStore.create_schema(url)
        PostgresTokenStore.create_schema(url)  # idempotent
        with PostgresTokenStore(url, clock=lambda: 1234.5) as tokens:
            assert tokens.option("table") == DEFAULT_TOKEN_TABLE == "dedup_tokens"
            tokens.create({"t-2": "billing", "t-1": "billing"})
            tokens.create({"t-1": "shipping", "t-3": "Straße"})
            assert tokens.present_among(["t-1", "t-2", "t-3", "T-1"]) == {"t-1", "t-2", "t-3"}
            assert tokens.outstanding() == {
                "billing": TokenCount(2, 1234.5),
                "Straße": TokenCount(1, 1234.5),
            }
        name = f"{schema}.{DEFAULT_TOKEN_TABLE}"
        with psycopg.connect(postgres_server.url) as conn:
            columns = conn.execute(
                "SELECT attname, format_type(atttypid, atttypmod), attnotnull, collname "
                "FROM pg_attribute LEFT JOIN pg_collation c ON c.oid = attcollation "
                "WHERE attrelid = to_regclass(%s) AND attnum > 0 ORDER BY attnum",
                [name],
            ).fetchall()
            keys = conn.execute(
                "SELECT contype, pg_get_constraintdef(oid) FROM pg_constraint "
                "WHERE conrelid = to_regclass(%s)",
                [name],
            ).fetchall()
            query = sql.SQL("SELECT id, endpoint, created FROM {} ORDER BY id")
            rows = conn.execute(query.format(sql.Identifier(schema, DEFAULT_TOKEN_TABLE)))
            stored = rows.fetchall()
        assert columns == [
            ("id", "text", True, "C"),
            ("endpoint", "text", True, "C"),
            ("created", "double precision", True, None),
        ]
        assert keys == [("p", "PRIMARY KEY (id)")]
        assert stored == [
            ("t-1", "billing", 1234.5),
            ("t-2", "billing", 1234.5),
            ("t-3", "Straße", 1234.5),
        ]
    finally:
        _exec(
            postgres_server.url,
            sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)),
        )


def test_missing_token_table_names_it_and_the_fix(
    postgres_server: Server, fresh_table: str
) -> None:
    _assert_configuration(
        lambda: PostgresTokenStore(postgres_server.url, table=fresh_table),
        fresh_table,
        "does not exist",
        "PostgresTokenStore.create_schema(url)",
        "create=true",
    )


@pytest.mark.parametrize(
    ("columns", "fragments"),
    [
        (
            'id text COLLATE "C" PRIMARY KEY, endpoint text NOT NULL',
            ("has no column created", "(needed: id, endpoint, created)", "drop it"),
        ),
        ("ident text PRIMARY KEY, created float8", ("has no column id, endpoint",)),
        ("id text, endpoint text NOT NULL, created float8 NOT NULL", ("ON CONFLICT",)),
        ("id int PRIMARY KEY, endpoint text NOT NULL, created float8 NOT NULL", ("integer",)),
    ],
    ids=["no created", "no id nor endpoint", "id not unique", "id not text"],
)
def test_token_table_of_another_shape_is_refused(
    postgres_server: Server, fresh_table: str, columns: str, fragments: tuple[str, ...]
) -> None:
    """Refused with or without create, naming the table, and left as it was."""
    table = sql.Identifier(fresh_table)
    _exec(postgres_server.url, sql.SQL(f"CREATE TABLE {{}} ({columns})").format(table))
    for create in (False, True):
        _assert_configuration(
            functools.partial(
                PostgresTokenStore, postgres_server.url, table=fresh_table, create=create
            ),
            f'table "{fresh_table}" is not usable as a token table',
            *fragments,
        )
    with psycopg.connect(postgres_server.url) as conn:
        count = conn.execute(
            "SELECT count(*) FROM pg_attribute WHERE attrelid = to_regclass(%s) AND attnum > 0",
            [fresh_table],
        ).fetchone()
    assert count == (len(columns.split(",")),), "left as it was"


def test_token_table_privileges(
    postgres_server: Server, fresh_table: str, second_role: tuple[str, str]
) -> None:
    """SELECT, INSERT and DELETE are needed (checked at open), UPDATE is not."""
    url, role = second_role
    PostgresTokenStore.create_schema(postgres_server.url, table=fresh_table)
    table, grantee = sql.Identifier(fresh_table), sql.Identifier(role)
    needed = f'GRANT SELECT, INSERT, DELETE ON "{fresh_table}"'
    for granted in ("SELECT", "INSERT", "DELETE"):
        _assert_configuration(
            lambda: PostgresTokenStore(url, table=fresh_table), "permission denied", needed
        )
        grant = sql.SQL("GRANT {} ON {} TO {}").format(sql.SQL(granted), table, grantee)
        _exec(postgres_server.url, grant)
    with PostgresTokenStore(url, table=fresh_table) as tokens:
        tokens.create({"granted": "e"})
        assert tokens.present("granted")
        _exec(postgres_server.url, sql.SQL("REVOKE DELETE ON {} FROM {}").format(table, grantee))
        _assert_configuration(lambda: tokens.delete(["granted"]), "permission denied", needed)
        _exec(postgres_server.url, sql.SQL("REVOKE INSERT ON {} FROM {}").format(table, grantee))
        _assert_configuration(lambda: tokens.create({"later": "e"}), "permission denied", needed)
        assert tokens.present_among(["granted", "later"]) == {"granted"}  # reads still allowed
        _exec(postgres_server.url, sql.SQL("REVOKE SELECT ON {} FROM {}").format(table, grantee))
        _assert_configuration(lambda: tokens.present("granted"), "permission denied", needed)
        _assert_configuration(tokens.outstanding, "permission denied", needed)


def test_token_calls_take_one_statement_per_chunk(
    postgres_server: Server, fresh_table: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens = PostgresTokenStore(
        postgres_server.url, table=fresh_table, create=True, clock=lambda: 42.0
    )
    statements: list[object] = []
    original = psycopg.Connection.execute

    def counting(self: psycopg.Connection[Any], query: Any, *args: Any, **kwargs: Any) -> Any:
        if fresh_table.encode() in (query if isinstance(query, bytes) else str(query).encode()):
            statements.append(query)  # not the session set-up of new pooled connections
        return original(self, query, *args, **kwargs)

    monkeypatch.setattr(psycopg.Connection, "execute", counting)
    ids = [f"chunk-{i}" for i in range(tokens.max_batch * 2 + 1)]
    tokens.create(dict.fromkeys(ids, "e"))
    assert len(statements) == 3
    statements.clear()
    assert tokens.present_among(ids) == set(ids)
    assert len(statements) == 3
    statements.clear()
    assert tokens.outstanding() == {"e": TokenCount(len(ids), 42.0)}
    assert len(statements) == 1
    statements.clear()
    tokens.delete(ids)
    assert len(statements) == 3
    assert tokens.present_among(ids) == set()
    tokens.close()


def test_token_writes_are_resent_when_the_connection_breaks(
    postgres_server: Server, fresh_table: str
) -> None:
    """A create or delete applied, then its connection lost, is re-sent and returns."""
    tokens = PostgresTokenStore(postgres_server.url, table=fresh_table, create=True)
    ids = [f"resent-{i}" for i in range(5)]
    _breaking_answers(tokens, tokens._sql_insert, lambda n: n == 1)
    tokens.create(dict.fromkeys(ids, "e"))
    _breaking_answers(tokens, tokens._sql_delete, lambda n: n == 1)
    tokens.delete(ids[1:])
    assert tokens.present_among(ids) == {ids[0]}
    tokens.close()


def test_token_store_shares_the_connection_of_the_other_stores(
    postgres_server: Server, fresh_table: str
) -> None:
    url = f"{postgres_server.url}?create=true"
    token_table = f"{fresh_table}_tokens"
    try:
        with (
            open_store(url, table=fresh_table) as store,
            PostgresTokenStore(url, table=token_table) as tokens,
        ):
            assert tokens.connection is store.connection
            assert store.add("same-id") is True
            tokens.create({"same-id": "e"})
            assert store.processed_among(["same-id"]) == {"same-id"}
            assert tokens.present_among(["same-id"]) == {"same-id"}
    finally:
        _drop(postgres_server.url, token_table)
