"""The PostgreSQL backend: the shipped contract plus failures, configuration and schema."""

from __future__ import annotations

import multiprocessing
import pickle
import random
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from psycopg import sql
from psycopg_pool import ConnectionPool

from backends.postgres import PostgresDeduplicationStore
from dedupstore import DeduplicationStore, open_store
from dedupstore.errors import ConfigurationError, StoreUnavailable
from dedupstore.testing import DeduplicationStoreContract, MultiProcessContract, StoreFactory
from tests.servers import PostgresServer, Server, free_port

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
        url = f"{postgres_server.url}?table={table}&create_schema=true&pool_min_size=1"

        def make(**options: Any) -> DeduplicationStore:
            return open_store(url, **options)

        yield make
        _drop(postgres_server.url, table)


# ---------------------------------------------------------------------- failures


def _open_owned(server: PostgresServer, **options: Any) -> DeduplicationStore:
    return open_store(server.url, table="dedup", create_schema=True, connect_timeout=3, **options)


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


def test_expired_records_survive_as_absent_after_restart(
    own_postgres_server: PostgresServer,
) -> None:
    from dedupstore.testing import FakeClock

    clock = FakeClock(start=4_000_000_000.0)  # far in the future: the server clock is unused
    store = _open_owned(own_postgres_server, retention="1h", clock=clock)
    assert store.add_many(["a", "b"]) == {"a", "b"}
    own_postgres_server.kill()
    own_postgres_server.restart()
    clock.advance(7200)
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
        open_store(url, table=fresh_table, create_schema=True)
    message = str(info.value)
    assert len(message.splitlines()) == 1
    assert "password authentication failed" in message
    assert "not-the-Secret-pw" not in message
    assert "***" in message


def test_wrong_password_option_is_masked(postgres_server: Server, fresh_table: str) -> None:
    url = _with_password(postgres_server.url, "").replace(":@", "@")
    with pytest.raises(ConfigurationError) as info:
        open_store(url, table=fresh_table, password="Hunter2-option")
    assert "Hunter2-option" not in str(info.value)
    assert len(str(info.value).splitlines()) == 1


def test_password_option_works(postgres_server: Server, fresh_table: str) -> None:
    parts = urlsplit(postgres_server.url)
    url = urlunsplit(parts._replace(netloc=f"{parts.username}@{parts.hostname}:{parts.port}"))
    with open_store(url, table=fresh_table, create_schema=True, password=parts.password) as store:
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
    assert "create_schema(url)" in message and "create_schema=true" in message
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
    assert dict(rows) == {"endpoint": "C", "id": "C"}


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
        with open_store(postgres_server.url, table=table, create_schema=True) as store:
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
        open_store(postgres_server.url, table=table, create_schema=True)


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
        ("create_schema=maybe", "create_schema"),
        ("retention=soon", "retention"),
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
        f"{postgres_server.url}?table={fresh_table}&create_schema=true&application_name={name}"
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


def test_keywords_override_url_options(postgres_server: Server, fresh_table: str) -> None:
    url = f"{postgres_server.url}?table=not_this_one&endpoint=orders&create_schema=true"
    with open_store(url, table=fresh_table) as store:
        assert "not_this_one" not in repr(store)
        assert store.endpoint == "orders"
        assert store.add("o-1") is True
        clone = pickle.loads(pickle.dumps(store))
        assert clone.endpoint == "orders" and clone.add("o-1") is False
        clone.close()
    with psycopg.connect(postgres_server.url) as conn:
        row = conn.execute("SELECT to_regclass('not_this_one') IS NULL").fetchone()
    assert row == (True,)


def test_constructor_refuses_url_options_it_would_ignore(
    postgres_server: Server, fresh_table: str
) -> None:
    url = f"{postgres_server.url}?table={fresh_table}&create_schema=true"
    with pytest.raises(ConfigurationError, match="from_url"):
        PostgresDeduplicationStore(url)
    with PostgresDeduplicationStore(url, table=fresh_table, create_schema=True) as store:
        assert store.add("direct") is True


def test_secrets_absent_from_repr_and_pickle_of_errors(
    postgres_server: Server, fresh_table: str
) -> None:
    password = urlsplit(postgres_server.url).password
    assert password
    with open_store(postgres_server.url, table=fresh_table, create_schema=True) as store:
        assert f":{password}@" not in repr(store)
        assert f":{password}@" not in str(store)
        assert f":{password}@" not in store.url
        assert "***" in repr(store)


def test_bad_url_does_not_echo_the_password() -> None:
    with pytest.raises(ConfigurationError) as info:
        open_store("postgresql://dedup:Top%zzSecret@127.0.0.1/dedup")
    assert "Top" not in str(info.value) and "Secret" not in str(info.value)


# ---------------------------------------------------------------------- behaviour


def test_keys_are_byte_exact(postgres_server: Server, fresh_table: str) -> None:
    variants = ["Straße", "STRASSE", "strasse", "straße", "straße ", "Å", "Å", "ﬁ", "fi"]
    with open_store(postgres_server.url, table=fresh_table, create_schema=True) as store:
        assert store.add_many(variants) == set(variants)
        assert store.processed_among(variants) == set(variants)
        assert store.processed_among(["STRAßE", "strasse  "]) == set()


def test_one_statement_per_chunk(
    postgres_server: Server, fresh_table: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store(postgres_server.url, table=fresh_table, create_schema=True)
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
    url = f"{postgres_server.url}?table={fresh_table}&create_schema=true"
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
    with open_store(postgres_server.url, table=fresh_table, create_schema=True) as store:
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
        pool = store._pool  # type: ignore[attr-defined]
        with pool.connection() as conn:
            assert conn.execute("SHOW synchronous_commit").fetchone() == ("on",)
        with psycopg.connect(server.url, autocommit=True) as conn:
            conn.execute("ALTER TABLE dedup SET UNLOGGED")
        assert any("UNLOGGED" in w for w in store.health_warnings())
        store.close()


def test_given_pool_is_used_and_not_closed(postgres_server: Server, fresh_table: str) -> None:
    pool: ConnectionPool[psycopg.Connection[Any]] = ConnectionPool(
        postgres_server.url, min_size=1, max_size=2, kwargs={"autocommit": True}, open=True
    )
    try:
        store = open_store(postgres_server.url, table=fresh_table, create_schema=True, client=pool)
        assert store.add("pooled") is True
        clone = pickle.loads(pickle.dumps(store))  # reconnects by configuration
        assert clone.has_been_processed("pooled")
        clone.close()
        store.close()
        assert not pool.closed
        with pool.connection() as conn:
            conn.execute("SELECT 1")
    finally:
        pool.close()


def _forked_child(store: DeduplicationStore) -> None:
    assert store.add("from-child") is True
    assert store.has_been_processed("from-parent")


def test_store_survives_fork(postgres_server: Server, fresh_table: str) -> None:
    store = open_store(postgres_server.url, table=fresh_table, create_schema=True)
    assert store.add("from-parent") is True
    child = multiprocessing.get_context("fork").Process(target=_forked_child, args=(store,))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert store.has_been_processed("from-child")
    assert store.add("parent-again") is True
    store.close()


def test_postgres_scheme_alias(postgres_server: Server, fresh_table: str) -> None:
    url = postgres_server.url.replace("postgresql://", "postgres://", 1)
    with open_store(url, table=fresh_table, create_schema=True) as store:
        assert isinstance(store, PostgresDeduplicationStore)
        assert store.add("alias") is True
