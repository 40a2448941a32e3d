"""The entity store contract on PostgreSQL, and what is specific to PostgreSQL."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import random
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

import dedupstore
import dedupstore.backends.postgres.entities
from dedupstore.backends.postgres import DEFAULT_ENTITY_TABLE, DEFAULT_TABLE, PostgresEntityStore
from dedupstore.entities import Entity, EntityStore, OutgoingMessage, bucket_of, encode_entity
from dedupstore.errors import (
    ConcurrencyConflict,
    ConfigurationError,
    DedupStoreError,
    EntityTooLarge,
    StoreUnavailable,
)
from dedupstore.testing.contract import HOSTILE_IDS
from dedupstore.testing.entities import (
    EntityStoreContract,
    EntityStoreFactory,
    EntityStoreRestartContract,
)
from tests.outbox_backends import own_connection
from tests.proxy import TcpProxy
from tests.servers import PostgresServer, Server, _freeze_tree, free_port

pytestmark = pytest.mark.postgres

MiB = 1024 * 1024


def _table() -> str:
    return f"ent_{uuid.uuid4().hex}"


def _exec(url: str, statement: sql.Composed | str, *params: object) -> list[tuple[Any, ...]]:
    with psycopg.connect(url, autocommit=True) as conn:
        cursor = conn.execute(statement, list(params) or None)
        return cursor.fetchall() if cursor.description is not None else []


def _drop(url: str, table: str) -> None:
    _exec(url, sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(*table.split("."))))


@pytest.fixture
def fresh_table(postgres_server: Server) -> Iterator[str]:
    """A table name nobody uses, dropped after the test."""
    table = _table()
    yield table
    _drop(postgres_server.url, table)


@pytest.fixture
def factory(postgres_server: Server, fresh_table: str) -> EntityStoreFactory:
    """New clients of this test's fresh table (created by the first)."""
    url = f"{postgres_server.url}?table={fresh_table}&create=true"
    return lambda **options: PostgresEntityStore(url, **options)


class TestPostgresEntityStore(EntityStoreContract):
    @pytest.fixture
    def entity_store_factory(self, factory: EntityStoreFactory) -> EntityStoreFactory:
        return factory


class TestPostgresEntityStoreRestart(EntityStoreRestartContract):
    @pytest.fixture
    def restartable(
        self, own_postgres_server: PostgresServer
    ) -> tuple[EntityStoreFactory, Callable[[], None]]:
        server = own_postgres_server

        def factory(**options: Any) -> EntityStore:
            return PostgresEntityStore(
                server.url, **{"table": "entities", "create": True, "connect_timeout": 3, **options}
            )

        def restart() -> None:
            server.kill()  # a crash: what was acknowledged must survive it
            server.restart()

        return factory, restart


def _message(mid: str) -> OutgoingMessage:
    return OutgoingMessage(f"{mid}/out", "shipping", {"mid": mid}, {"h": "v"})


def _new(store: EntityStore, eid: str, **state: Any) -> Entity:
    entity = store.load(eid)
    entity.state = state
    return entity


class _Statements:
    """Counts the statements a store sends that mention its table (not the session set-up)."""

    def __init__(self, store: EntityStore, table: str) -> None:
        self.sent: list[bytes] = []
        connection = own_connection(store)
        original = connection.execute

        def execute(conn: Any, query: Any, params: Any = None, **kwargs: Any) -> Any:
            text = query if isinstance(query, bytes) else str(query).encode()
            if table.encode() in text:
                self.sent.append(text)
            return original(conn, query, params, **kwargs)

        connection.execute = execute

    def count(self, statement: bytes) -> int:
        return sum(1 for sent in self.sent if sent == statement)


# ---------------------------------------------------------------------- layout


@pytest.fixture
def fresh_schema(postgres_server: Server) -> Iterator[str]:
    """A schema nobody uses, dropped (with its tables) after the test."""
    schema = f"ents_{uuid.uuid4().hex[:12]}"
    yield schema
    _exec(
        postgres_server.url,
        sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)),
    )


def test_row_layout_beside_the_deduplication_table(
    postgres_server: Server, fresh_schema: str
) -> None:
    """One URL, two default tables: entities never mix with deduplication records."""
    _exec(postgres_server.url, sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(fresh_schema)))
    url = f"{postgres_server.url}?options={quote(f'-c search_path={fresh_schema}')}&create=true"
    with dedupstore.open_store(url) as dedup, dedupstore.open_entity_store(url) as entities:
        assert isinstance(entities, PostgresEntityStore)
        assert entities.option("table") == DEFAULT_ENTITY_TABLE != DEFAULT_TABLE
        dedup.add("m-1")
        entity = _new(entities, "order-1", n=1)
        entity.outbox["m-1"] = [_message("m-1")]
        entities.save(entity)
        entity.state = {"n": 2}
        entities.save(entity)
        quiet = _new(entities, "Order-1", n=0)  # byte-exact ids: another entity
        entities.save(quiet)
    table = sql.Identifier(fresh_schema, DEFAULT_ENTITY_TABLE)
    rows = _exec(
        postgres_server.url,
        sql.SQL("SELECT id, body, version, bucket, pending, listed FROM {} ORDER BY id").format(
            table
        ),
    )
    assert rows == [
        ("Order-1", encode_entity(quiet), 1, bucket_of("Order-1"), False, False),
        ("order-1", encode_entity(entity), 2, bucket_of("order-1"), True, True),
    ]
    assert rows[1][1] == (
        '{"outbox":{"m-1":{"out":[{"body":{"mid":"m-1"},"destination":"shipping",'
        '"headers":{"h":"v"},"id":"m-1/out"}]}},"state":{"n":2}}'
    )
    dedup_rows = _exec(
        postgres_server.url,
        sql.SQL("SELECT endpoint, id FROM {}").format(sql.Identifier(fresh_schema, DEFAULT_TABLE)),
    )
    assert dedup_rows == [("default", "m-1")]
    columns = _exec(
        postgres_server.url,
        "SELECT attname, format_type(atttypid, atttypmod), attnotnull, coalesce(collname, '') "
        "FROM pg_attribute LEFT JOIN pg_collation c ON c.oid = attcollation AND attcollation <> 0 "
        "WHERE attrelid = to_regclass(%s) AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
        f"{fresh_schema}.{DEFAULT_ENTITY_TABLE}",
    )
    assert columns == [
        ("id", "text", True, "C"),
        ("body", "text", True, "default"),
        ("version", "bigint", True, ""),
        ("bucket", "integer", True, ""),
        ("pending", "boolean", True, ""),
        ("listed", "boolean", True, ""),
    ]
    indexes = _exec(
        postgres_server.url,
        "SELECT indexdef FROM pg_indexes WHERE schemaname = %s AND tablename = %s ORDER BY 1",
        fresh_schema,
        DEFAULT_ENTITY_TABLE,
    )
    assert sorted(row[0].split(" USING ")[1] for row in indexes) == [
        "btree (id)",
        "btree (id) WHERE listed",
    ]
    options = _exec(
        postgres_server.url,
        "SELECT reloptions FROM pg_class WHERE oid = to_regclass(%s)",
        f"{fresh_schema}.{DEFAULT_ENTITY_TABLE}",
    )
    assert options == [(["fillfactor=80"],)]


def test_a_row_stays_listed_until_a_scan_finds_it_not_pending(
    postgres_server: Server, factory: EntityStoreFactory, fresh_table: str
) -> None:
    """A save never clears ``listed`` (so the index's columns do not change on the
    saves of a listed entity: heap-only updates); the scan clears it on a row it
    finds not pending, and a save of a pending outbox sets it again."""
    store = factory()

    def listed() -> list[tuple[str, bool, bool]]:
        return _exec(
            postgres_server.url,
            sql.SQL("SELECT id, pending, listed FROM {} ORDER BY id").format(
                sql.Identifier(fresh_table)
            ),
        )

    entity = _new(store, "e-1", n=1)
    entity.outbox["m-1"] = None
    store.save(entity)
    entity.outbox.clear()
    store.save(entity)
    assert listed() == [("e-1", False, True)]
    assert list(store.pending_outboxes()) == []
    assert listed() == [("e-1", False, False)], "the scan unlisted it"
    entity.outbox["m-2"] = None
    store.save(entity)
    assert listed() == [("e-1", True, True)]
    assert [e.id for e in store.pending_outboxes()] == ["e-1"]


def test_a_scan_never_unlists_a_row_saved_pending_meanwhile(
    factory: EntityStoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scan reads a row as not pending; before it unlists it, the entity is saved
    pending again (the save keeps ``listed``): the unlist re-checks the row and
    leaves it, and the next scan finds it."""
    store = factory()
    entity = _new(store, "racy", n=1)
    entity.outbox["m-1"] = None
    store.save(entity)
    entity.outbox.clear()
    store.save(entity)
    connection = store._pg  # type: ignore[attr-defined]
    write = connection.write

    def racing(client: Any, query: bytes, params: Any, **options: Any) -> Any:
        if query == store._sql_unlist:  # type: ignore[attr-defined]
            entity.outbox["m-2"] = None
            store.save(entity)
        return write(client, query, params, **options)

    monkeypatch.setattr(connection, "write", racing)
    assert list(store.pending_outboxes()) == [], "read before the save"
    monkeypatch.undo()
    assert [e.id for e in store.pending_outboxes()] == ["racy"]


def test_health_warnings_cover_the_entity_table(
    postgres_server: Server, factory: EntityStoreFactory, fresh_table: str
) -> None:
    """The entity store reports the same risks as the deduplication store (shared client)."""
    with factory() as store:
        assert store.health_warnings() == []
        _exec(
            postgres_server.url,
            sql.SQL("ALTER TABLE {} SET UNLOGGED").format(sql.Identifier(fresh_table)),
        )
        assert store.health_warnings() == [
            f'table "{fresh_table}" is UNLOGGED: PostgreSQL empties it after a crash'
        ]


def test_one_statement_per_chunk(factory: EntityStoreFactory, fresh_table: str) -> None:
    store = factory()
    statements = _Statements(store, fresh_table)
    # loads: max_load_batch (100) ids a statement; saves: max_save_batch (1,000) entities
    assert (store.max_load_batch, store.max_save_batch) == (100, 1000)
    ids = [f"chunk-{i}" for i in range(store.max_save_batch * 2 + 5)]
    loaded = store.load_many(ids)
    assert len(statements.sent) == 21 == statements.count(store._sql_load)  # type: ignore[attr-defined]
    statements.sent.clear()
    for eid in ids:
        loaded[eid].outbox["m"] = None
    assert store.save_many(list(loaded.values())) == set()
    assert len(statements.sent) == 3 == statements.count(store._sql_save)  # type: ignore[attr-defined]
    statements.sent.clear()
    assert {e.id for e in store.pending_outboxes()} == set(ids)
    assert len(statements.sent) == 5  # 2,005 rows: pages of 500
    store.close()


# ---------------------------------------------------------------------- size limit


def _sized(eid: str, size: int) -> Entity:
    """An entity whose canonical JSON is exactly ``size`` UTF-8 bytes (multi-byte text)."""
    entity = Entity(eid, {"blob": ""}, {"m": [_message("m")]})
    overhead = len(encode_entity(entity).encode())
    wide = 1000  # "é": two bytes, one character
    entity.state = {"blob": "é" * wide + "x" * (size - overhead - 2 * wide)}
    assert len(encode_entity(entity).encode()) == size
    return entity


def test_the_largest_entity_is_stored_and_one_byte_more_is_refused(
    factory: EntityStoreFactory, postgres_server: Server, fresh_table: str
) -> None:
    store = factory()
    limit = store.max_entity_bytes
    assert limit == 4 * MiB
    statements = _Statements(store, fresh_table)
    too_large = _sized("big", limit + 1)
    with pytest.raises(EntityTooLarge, match=str(limit)):
        store.save(too_large)
    with pytest.raises(EntityTooLarge):
        store.save_many([_sized("small", 3000), too_large])
    assert statements.sent == [], "refused before any I/O"
    largest = _sized("big", limit)
    store.save(largest)
    other = factory()
    loaded = other.load("big")
    other.close()
    assert loaded.state == largest.state and loaded.outbox == largest.outbox
    assert loaded.version == 1
    length = _exec(
        postgres_server.url,
        sql.SQL("SELECT octet_length(body) FROM {}").format(sql.Identifier(fresh_table)),
    )
    assert length == [(limit,)]
    store.close()


def test_large_entities_are_saved_and_scanned_in_bounded_statements(
    factory: EntityStoreFactory, fresh_table: str
) -> None:
    """Five entities of 4 MiB: two save statements, two scan pages (about 16 MiB each)."""
    store = factory()
    entities = [_sized(f"large-{i}", store.max_entity_bytes) for i in range(5)]
    statements = _Statements(store, fresh_table)
    assert store.save_many(entities) == set()
    assert statements.count(store._sql_save) == 2  # type: ignore[attr-defined]
    statements.sent.clear()
    scanned = list(store.pending_outboxes())
    assert [e.id for e in scanned] == [e.id for e in entities]
    assert all(e.state == entities[0].state for e in scanned)
    assert len(statements.sent) == 2
    store.close()


# ---------------------------------------------------------------------- scan


def test_the_scan_pages_by_id_and_sees_every_pending_entity_once(
    factory: EntityStoreFactory, fresh_table: str
) -> None:
    store = factory()
    ids = [f"page-{i:05d}" for i in range(1203)]
    loaded = store.load_many(ids)
    for n, eid in enumerate(ids):
        loaded[eid].outbox["m"] = [_message(eid)] if n % 3 else None
    quiet = [_new(store, f"quiet-{i}", q=i) for i in range(50)]
    store.save_many([*loaded.values(), *quiet])
    statements = _Statements(store, fresh_table)
    seen = [e.id for e in store.pending_outboxes()]
    assert seen == ids, "every pending entity once, in id order"
    assert len(statements.sent) == 3  # 500 + 500 + 203
    statements.sent.clear()
    by_segment = [[e.id for e in store.pending_outboxes(s, 4)] for s in range(4)]
    assert sorted(eid for members in by_segment for eid in members) == ids
    for segment, members in enumerate(by_segment):
        assert all(bucket_of(eid) % 4 == segment for eid in members)
    store.close()


@pytest.mark.parametrize(("rows", "budget"), [(7, 16 * MiB), (500, 700), (3, 1)])
def test_small_pages_of_hostile_ids(
    factory: EntityStoreFactory, monkeypatch: pytest.MonkeyPatch, rows: int, budget: int
) -> None:
    """Keyset pages by id (byte order, like Python's) cut by rows or by bytes: each id once."""
    monkeypatch.setattr(dedupstore.backends.postgres.entities, "_PAGE_ROWS", rows)
    monkeypatch.setattr(dedupstore.backends.postgres.entities, "_PAGE_BYTES", budget)
    store = factory()
    ids = sorted({*HOSTILE_IDS, *(f"r-{random.random()}" for _ in range(40))})
    loaded = store.load_many(ids)
    for eid in ids:
        loaded[eid].outbox[eid] = [_message(eid)]
    store.save_many(list(loaded.values()))
    statements = _Statements(store, store.option("table"))
    assert [e.id for e in store.pending_outboxes()] == ids
    assert len(statements.sent) >= len(ids) // rows
    for segments in (2, 5):
        seen = [e.id for s in range(segments) for e in store.pending_outboxes(s, segments)]
        assert sorted(seen) == ids
    store.close()


def test_a_scan_holds_no_transaction_between_pages(
    factory: EntityStoreFactory, fresh_table: str
) -> None:
    """Entities saved while a scan is half-way are seen as of their page; saves do not wait."""
    store, other = factory(), factory()
    ids = [f"live-{i:04d}" for i in range(700)]
    loaded = store.load_many(ids)
    for eid in ids:
        loaded[eid].outbox["m"] = [_message(eid)]
    store.save_many(list(loaded.values()))
    scan = store.pending_outboxes()
    first = [next(scan) for _ in range(10)]
    late = other.load(ids[-1])
    late.state = {"changed": True}
    other.save(late)
    emptied = other.load(ids[-2])
    emptied.outbox.clear()
    other.save(emptied)
    rest = list(scan)
    assert [e.id for e in first + rest] == ids[:-2] + ids[-1:]
    assert rest[-1].state == {"changed": True} and rest[-1].version == 2
    store.close()
    other.close()


# ---------------------------------------------------------------------- tokens


def test_a_version_no_row_can_hold_is_a_conflict(
    factory: EntityStoreFactory, postgres_server: Server, fresh_table: str
) -> None:
    store = factory()
    saved = store.save(_new(store, "v", n=1))
    assert saved.version == 1
    for foreign in ("1", 1.0, True, 0, -1, 2**63, None):
        entity = Entity("v", {"n": "foreign"}, {}, foreign)
        with pytest.raises(ConcurrencyConflict):
            store.save(entity)
    assert store.load("v").state == {"n": 1}
    # an entity removed by hand is not re-created by a save of its old version
    _exec(postgres_server.url, sql.SQL("DELETE FROM {}").format(sql.Identifier(fresh_table)))
    with pytest.raises(ConcurrencyConflict):
        store.save(Entity("v", {"n": 2}, {}, 1))
    assert store.load("v").version is None
    store.close()


def test_overlapping_batches_in_any_order_never_deadlock(factory: EntityStoreFactory) -> None:
    """Four clients save the same 300 entities in shuffled orders: one winner per version."""
    clients = [factory() for _ in range(4)]
    ids = [f"overlap-{i}" for i in range(300)]
    created = clients[0].load_many(ids)
    clients[0].save_many(list(created.values()))
    wins: list[set[str]] = [set() for _ in clients]
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(clients))

    def run(index: int) -> None:
        try:
            for round_ in range(3):
                loaded = clients[index].load_many(ids)
                batch = list(loaded.values())
                random.Random(index * 10 + round_).shuffle(batch)
                for entity in batch:
                    entity.state = {"by": index, "round": round_}
                barrier.wait()
                conflicts = clients[index].save_many(batch)
                wins[index] |= {f"{eid}#{loaded[eid].version}" for eid in set(ids) - conflicts}
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(clients))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    final = clients[0].load_many(ids)
    all_wins = [w for won in wins for w in won]
    assert len(all_wins) == len(set(all_wins)), "two savers won the same version"
    for eid in ids:
        assert final[eid].version == 1 + sum(w.startswith(f"{eid}#") for w in all_wins)
    for client in clients:
        client.close()


# ---------------------------------------------------------------------- failures


def _shut_down(conn: Any) -> None:
    """Shut the socket of ``conn`` down: the connection dies under its next use."""
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
        sock.shutdown(socket.SHUT_RDWR)


def _losing_answers(
    store: EntityStore, statement: bytes, lose: Callable[[int], bool], *, broken: bool = False
) -> None:
    """Make ``store`` run ``statement`` for real, then raise as if the answer was lost.

    ``broken``: the connection really dies after the statement (psycopg marks it
    broken), as when the server or the network fails before the answer arrives.
    """
    connection = own_connection(store)
    original = connection.execute
    count = 0

    def execute(conn: Any, query: Any, params: Any = None, **kwargs: Any) -> Any:
        nonlocal count
        rows = original(conn, query, params, **kwargs)
        if query == statement:
            count += 1
            if lose(count):
                if broken:
                    _shut_down(conn)
                    original(conn, "SELECT 1")  # raises: the connection is broken
                raise psycopg.OperationalError("server closed the connection unexpectedly")
        return rows

    connection.execute = execute


@pytest.mark.parametrize("broken", [False, True], ids=["error", "broken-connection"])
def test_lost_answer_of_a_save_is_an_error_never_a_wrong_answer(
    factory: EntityStoreFactory, broken: bool
) -> None:
    """A save is never re-sent: a re-send would conflict with its own first send."""
    store, other = factory(), factory()
    entity = store.save(_new(store, "lost", n=1))
    _losing_answers(store, store._sql_save, lambda n: n == 1, broken=broken)  # type: ignore[attr-defined]
    entity.state = {"n": 2}
    with pytest.raises(StoreUnavailable) as info:
        store.save(entity)
    assert isinstance(info.value.__cause__, psycopg.OperationalError)
    assert len(str(info.value).splitlines()) == 1
    assert entity.version == 1, "an unknown outcome leaves the version as loaded"
    applied = other.load("lost")
    assert applied.state == {"n": 2} and applied.version == 2  # it was applied, once
    with pytest.raises(ConcurrencyConflict):  # the retry is not applied a second time
        store.save(entity)
    assert store.load("lost").version == 2
    store.close()
    other.close()


def test_lost_answer_part_way_through_save_many(factory: EntityStoreFactory) -> None:
    store = factory()
    chunk = store.max_save_batch
    ids = [f"part-{i:04d}" for i in range(chunk * 3)]
    loaded = store.load_many(ids)
    _losing_answers(store, store._sql_save, lambda n: n == 2)  # type: ignore[attr-defined]
    with pytest.raises(StoreUnavailable):
        store.save_many([loaded[eid] for eid in ids])
    first, second, third = (ids[i * chunk : (i + 1) * chunk] for i in range(3))
    assert all(loaded[eid].version == 1 for eid in first), "the chunk before: saved"
    assert all(loaded[eid].version is None for eid in second + third)
    after = store.load_many(ids)
    assert all(after[eid].version == 1 for eid in first + second)  # the lost one was applied
    assert all(after[eid].version is None for eid in third), "later chunks were never sent"
    assert store.save_many([loaded[eid] for eid in second + third]) == set(second)
    store.close()


def test_a_read_is_retried_on_a_broken_connection(factory: EntityStoreFactory) -> None:
    store = factory()
    store.save(_new(store, "r", n=1))
    connection = own_connection(store)
    original = connection.execute
    broken: list[bytes] = []

    def execute(conn: Any, query: Any, params: Any = None, **kwargs: Any) -> Any:
        reads = (store._sql_load, store._sql_scan)  # type: ignore[attr-defined]
        if query in reads and query not in broken:  # the first of each
            broken.append(query)
            _shut_down(conn)  # the connection dies under the read
        return original(conn, query, params, **kwargs)

    connection.execute = execute
    assert store.load("r").state == {"n": 1}
    assert [e.id for e in store.pending_outboxes()] == []
    assert len(broken) == 2
    store.close()


def test_server_down_is_store_unavailable() -> None:
    url = f"postgresql://dedup:Secret-pw@127.0.0.1:{free_port()}/dedup"
    with pytest.raises(StoreUnavailable) as info:
        PostgresEntityStore(url, connect_timeout=2)
    assert len(str(info.value).splitlines()) == 1
    assert "Secret-pw" not in str(info.value)
    assert isinstance(info.value.__cause__, psycopg.OperationalError)


@pytest.mark.timeout(180)
def test_server_killed_then_restarted(own_postgres_server: PostgresServer) -> None:
    server = own_postgres_server
    store = PostgresEntityStore(server.url, table="ents", create=True, connect_timeout=2)
    entity = _new(store, "k", n=1)
    entity.outbox["m"] = [_message("m")]
    store.save(entity)
    server.kill()
    for call in (
        lambda: store.load("k"),
        lambda: store.save(entity),
        lambda: list(store.pending_outboxes()),
    ):
        with pytest.raises(StoreUnavailable) as info:
            call()
        assert isinstance(info.value.__cause__, psycopg.Error), repr(info.value.__cause__)
        assert len(str(info.value).splitlines()) == 1
    assert entity.version == 1
    server.restart()
    assert store.load("k").version == 1
    entity.state = {"n": 2}
    assert store.save(entity).version == 2
    store.close()


@contextlib.contextmanager
def _frozen(server: PostgresServer) -> Iterator[None]:
    """Every process of the server stopped (SIGSTOP): TCP is accepted, nothing answers."""
    postmaster = int((server.data_dir / "postmaster.pid").read_text().split()[0])
    frozen = _freeze_tree(postmaster)
    try:
        yield
    finally:
        for pid in {*frozen, *([server.pid] if server.pid else [])}:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


@pytest.mark.timeout(120)
def test_frozen_server_times_out(own_postgres_server: PostgresServer) -> None:
    store = PostgresEntityStore(
        own_postgres_server.url, table="ents", create=True, timeout=1, connect_timeout=2
    )
    entity = store.save(_new(store, "f", n=1))
    with _frozen(own_postgres_server):
        for call in (
            lambda: store.load("f"),
            lambda: store.save(entity),
            lambda: list(store.pending_outboxes()),
        ):
            with pytest.raises(StoreUnavailable, match="timed out"):
                call()
    assert entity.version == 1, "the save's outcome is unknown: the version is left as loaded"
    reloaded = store.load("f")  # the server may have run the save once it resumed
    before = reloaded.version
    assert before in (1, 2)
    assert store.save(reloaded).version == before + 1
    store.close()


def test_statement_timeout_on_a_locked_row(
    factory: EntityStoreFactory, postgres_server: Server, fresh_table: str
) -> None:
    store = factory(timeout=1)
    entity = store.save(_new(store, "locked", n=1))
    with psycopg.connect(postgres_server.url) as blocker:
        blocker.execute(
            sql.SQL("UPDATE {} SET version = version WHERE id = 'locked'").format(
                sql.Identifier(fresh_table)
            )
        )  # uncommitted: the row stays locked
        with pytest.raises(StoreUnavailable, match="statement timeout") as info:
            store.save(entity)
        assert isinstance(info.value.__cause__, psycopg.errors.QueryCanceled)
        assert store.load("locked").version == 1  # reads do not wait for the lock
        blocker.rollback()
    assert store.save(entity).version == 2
    store.close()


# ---------------------------------------------------------------------- configuration


def _assert_configuration(call: Callable[[], object], *fragments: str) -> ConfigurationError:
    with pytest.raises(DedupStoreError) as info:
        call()
    error = info.value
    assert isinstance(error, ConfigurationError), repr(error)
    message = str(error)
    assert len(message.splitlines()) == 1
    for fragment in fragments:
        assert fragment in message, message
    return error


def test_missing_table_without_create(postgres_server: Server, fresh_table: str) -> None:
    _assert_configuration(
        lambda: PostgresEntityStore(postgres_server.url, table=fresh_table),
        fresh_table,
        "does not exist",
        "PostgresEntityStore.create_schema(url)",
        "create=true",
    )
    PostgresEntityStore.create_schema(f"{postgres_server.url}?table={fresh_table}")
    PostgresEntityStore.create_schema(postgres_server.url, table=fresh_table)  # idempotent
    with PostgresEntityStore(postgres_server.url, table=fresh_table) as store:
        assert store.save(_new(store, "x", n=1)).version == 1


def test_table_dropped_while_open(factory: EntityStoreFactory, postgres_server: Server) -> None:
    store = factory()
    entity = store.save(_new(store, "d", n=1))
    _drop(postgres_server.url, store.option("table"))
    for call in (
        lambda: store.load("d"),
        lambda: store.save(entity),
        lambda: list(store.pending_outboxes()),
    ):
        _assert_configuration(call, store.option("table"), "does not exist", "create=true")
    store.close()


def test_a_table_of_another_shape_is_refused(postgres_server: Server, fresh_table: str) -> None:
    dedupstore.open_store(postgres_server.url, table=fresh_table, create=True).close()
    _assert_configuration(
        lambda: PostgresEntityStore(postgres_server.url, table=fresh_table),
        "not usable as an entity table",
    )
    _assert_configuration(  # create does not touch an existing table
        lambda: PostgresEntityStore(postgres_server.url, table=fresh_table, create=True),
        "not usable as an entity table",
    )
    _drop(postgres_server.url, fresh_table)
    _exec(
        postgres_server.url,
        sql.SQL(
            "CREATE TABLE {} (id text, body jsonb, version bigint, bucket int, pending bool)"
        ).format(sql.Identifier(fresh_table)),
    )
    _assert_configuration(  # no unique id, a jsonb body
        lambda: PostgresEntityStore(postgres_server.url, table=fresh_table),
        "not usable as an entity table",
    )


def test_an_entity_table_of_an_earlier_build_is_refused(
    postgres_server: Server, fresh_table: str
) -> None:
    """Tables of development builds are not upgraded: the one without ``listed`` is
    refused at open, naming the column (nothing was released)."""
    _exec(
        postgres_server.url,
        sql.SQL(
            'CREATE TABLE {} (id text COLLATE "C" PRIMARY KEY, body text NOT NULL, '
            "version bigint NOT NULL, bucket integer NOT NULL, pending boolean NOT NULL)"
        ).format(sql.Identifier(fresh_table)),
    )
    _assert_configuration(
        lambda: PostgresEntityStore(postgres_server.url, table=fresh_table),
        "listed",
    )


def test_schema_qualified_table_with_odd_name(postgres_server: Server) -> None:
    schema = f"Entity Schema {uuid.uuid4().hex[:8]}"
    table = f'{schema}.Entities "quoted" 🦄'
    try:
        with PostgresEntityStore(postgres_server.url, table=table, create=True) as store:
            store.save(_new(store, "q", n=1))
        with dedupstore.open_entity_store(postgres_server.url, table=table) as store:
            assert store.load("q").state == {"n": 1}
        _assert_configuration(
            lambda: PostgresEntityStore(postgres_server.url, table=table.lower()),
            "does not exist",
        )
    finally:
        _exec(
            postgres_server.url,
            sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)),
        )


UNREACHABLE = f"postgresql://dedup:pw@127.0.0.1:{free_port()}/dedup"


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        ({"table": ""}, "table"),
        ({"table": "a.b.c"}, "table"),
        ({"table": "x" * 64}, "table"),
        ({"create": "maybe"}, "create"),
        ({"timeout": 0}, "timeout"),
        ({"connect_timeout": "soon"}, "connect_timeout"),
        ({"pool_min_size": 5, "pool_max_size": 2}, "pool"),
        ({"endpoint": "orders"}, "unknown option 'endpoint'"),
        ({"retention": "1d"}, "unknown option 'retention'"),
        ({"client": object()}, "client"),
        ({"sslmode": "bogus"}, "sslmode"),
    ],
)
def test_bad_options_are_refused_before_any_io(options: dict[str, Any], fragment: str) -> None:
    """The URL leads nowhere: a ConfigurationError (not StoreUnavailable) means no I/O."""
    with pytest.raises(ConfigurationError) as info:
        PostgresEntityStore(UNREACHABLE, **{"connect_timeout": 1, **options})
    assert fragment in str(info.value)
    assert len(str(info.value).splitlines()) == 1
    query = "&".join(f"{k}={quote(str(v))}" for k, v in options.items() if k != "client")
    if query:
        with pytest.raises(ConfigurationError):
            dedupstore.open_entity_store(f"{UNREACHABLE}?{query}", connect_timeout=1)


def test_options_from_the_url_and_keywords(postgres_server: Server, fresh_table: str) -> None:
    url = f"{postgres_server.url}?table={fresh_table}&create=true&timeout=5&application_name=ents"
    with dedupstore.open_entity_store(url, pool_min_size=0, pool_max_size="2") as store:
        assert isinstance(store, PostgresEntityStore)
        assert store.option("timeout") == 5.0 and store.option("create") is True
        assert store.option("pool_min_size") == 0 and store.option("pool_max_size") == 2
        store.save(_new(store, "o", n=1))
        assert "dedup:dedup@" not in repr(store) and "***" in repr(store)
        clone = pickle.loads(pickle.dumps(store))
        assert isinstance(clone, PostgresEntityStore)
        assert clone.option("pool_max_size") == 2 and clone.load("o").state == {"n": 1}
        clone.close()
    alias = postgres_server.url.replace("postgresql://", "postgres://", 1)
    with dedupstore.open_entity_store(alias, table=fresh_table) as store:
        assert isinstance(store, PostgresEntityStore)
        assert store.load("o").version == 1


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


def test_refused_privileges_and_password(
    postgres_server: Server, fresh_table: str, second_role: tuple[str, str]
) -> None:
    url, role = second_role
    PostgresEntityStore.create_schema(postgres_server.url, table=fresh_table)
    table, grantee = sql.Identifier(fresh_table), sql.Identifier(role)
    error = _assert_configuration(
        lambda: PostgresEntityStore(url, table=fresh_table),
        "permission denied",
        "GRANT SELECT, INSERT, UPDATE ON",
    )
    assert "Role-Pw-" not in str(error)
    _exec(
        postgres_server.url,
        sql.SQL("GRANT SELECT, INSERT, UPDATE ON {} TO {}").format(table, grantee),
    )
    store = PostgresEntityStore(url, table=fresh_table)
    entity = store.save(_new(store, "p", n=1))
    _exec(postgres_server.url, sql.SQL("REVOKE UPDATE ON {} FROM {}").format(table, grantee))
    _assert_configuration(lambda: store.save(entity), "permission denied")
    assert store.load("p").version == 1
    store.close()
    parts = urlsplit(url)
    bad = urlunsplit(parts._replace(netloc=f"{role}:Wrong-pw@{parts.hostname}:{parts.port}"))
    error = _assert_configuration(
        lambda: PostgresEntityStore(bad, table=fresh_table), "password authentication failed"
    )
    assert "Wrong-pw" not in str(error)


# ---------------------------------------------------------------------- processes


def _forked_child(store: EntityStore) -> None:
    entity = store.load("parent")
    assert entity.state == {"by": "parent"}
    entity.state = {"by": "child"}
    store.save(entity)


def test_store_survives_fork(factory: EntityStoreFactory) -> None:
    store = factory()
    store.save(_new(store, "parent", by="parent"))
    child = multiprocessing.get_context("fork").Process(target=_forked_child, args=(store,))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert store.load("parent").state == {"by": "child"}
    store.close()


# ---------------------------------------------------------------------- connections reset


@pytest.fixture
def proxy(postgres_server: Server) -> Iterator[TcpProxy]:
    """A TCP proxy to the session's server, to reset the store's connections."""
    with TcpProxy.for_url(postgres_server.url) as proxy:
        yield proxy


_POOL = 3  # connections the store keeps open: every one of them is reset


def _open_through(proxy: TcpProxy, url: str, table: str) -> PostgresEntityStore:
    """A store on ``table`` through ``proxy`` holding entity "seen" (pending), its pool full."""
    store = PostgresEntityStore(
        proxy.url(url),
        table=table,
        create=True,
        pool_min_size=_POOL,
        pool_max_size=_POOL + 2,
        connect_timeout=1,
        timeout=5,
    )
    seen = _new(store, "seen", n=1)
    seen.outbox["m"] = [_message("m")]
    store.save(seen)  # a successful call first
    pool = store._pg.pool  # type: ignore[attr-defined]
    while True:  # no connection still opening: it would hang when the network dies
        stats = pool.get_stats()
        if stats["pool_available"] >= _POOL and stats["pool_size"] == stats["pool_available"]:
            return store
        time.sleep(0.01)


def _load_many(store: EntityStore) -> Callable[[], object]:
    def call() -> object:
        found = store.load_many(["seen", "absent"])
        return {eid: (e.state, e.version) for eid, e in found.items()}

    return call


def _save_many(store: EntityStore) -> Callable[[], object]:
    seen, new = store.load("seen"), store.load("new")  # loaded before the connections die
    seen.state, new.state = {"n": 2}, {"n": 1}

    def call() -> object:
        conflicts = store.save_many([seen, new])
        return conflicts, seen.version, new.version, store.load("seen").state

    return call


def _scan(store: EntityStore) -> Callable[[], object]:
    return lambda: [(e.id, e.version) for e in store.pending_outboxes()]


#: operation -> (prepare it: returns the call, the call's right answer).
_OPERATIONS: dict[str, tuple[Callable[[EntityStore], Callable[[], object]], object]] = {
    "load_many": (_load_many, {"seen": ({"n": 1}, 1), "absent": ({}, None)}),
    "save_many": (_save_many, (set(), 2, 1, {"n": 2})),
    "scan": (_scan, [("seen", 1)]),
}


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
    prepare, answer = _OPERATIONS[operation]
    call = prepare(store)
    with proxy.down("refuse", silent=silent):  # a short outage, while nobody calls
        pass
    assert call() == answer
    store.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["refuse", "reset", "hang"])
@pytest.mark.parametrize("operation", sorted(_OPERATIONS))
def test_a_call_during_an_outage_fails_then_the_first_call_after_succeeds(
    proxy: TcpProxy, postgres_server: Server, fresh_table: str, operation: str, mode: str
) -> None:
    store = _open_through(proxy, postgres_server.url, fresh_table)
    prepare, answer = _OPERATIONS[operation]
    call = prepare(store)
    with proxy.down(mode, silent=True):  # type: ignore[arg-type]
        # every connection is dead and no new one answers: an error, within the timeouts
        with pytest.raises(StoreUnavailable) as info:
            call()
        assert isinstance(info.value.__cause__, psycopg.Error), repr(info.value.__cause__)
        assert len(str(info.value).splitlines()) == 1
    # the same call again (a failed save left the versions as loaded): the right answer
    assert call() == answer
    store.close()
