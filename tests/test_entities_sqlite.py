"""The entity store contract on SQLite files, and what is specific to SQLite."""

from __future__ import annotations

import gc
import os
import sqlite3
import threading
from pathlib import Path

import pytest

import dedupstore
from dedupstore.backends.sqlite import SqliteEntityStore
from dedupstore.entities import bucket_of
from dedupstore.errors import ConfigurationError, StoreUnavailable
from dedupstore.testing.entities import EntityStoreContract, EntityStoreFactory

pytestmark = pytest.mark.sqlite


class TestSqliteEntityStore(EntityStoreContract):
    @pytest.fixture
    def entity_store_factory(self, tmp_path: Path) -> EntityStoreFactory:
        url = f"sqlite:///{tmp_path}/entities.db"
        return lambda **options: SqliteEntityStore(url, **options)


def test_row_layout_and_shared_file(tmp_path: Path) -> None:
    """Entities live in their own table beside the deduplication records."""
    url = f"sqlite:///{tmp_path}/both.db"
    with dedupstore.open_store(url) as dedup, dedupstore.open_entity_store(url) as entities:
        dedup.add("m-1")
        entity = entities.load("order-1")
        entity.state = {"n": 1}
        entity.outbox["m-1"] = None
        entities.save(entity)
        entity.state = {"n": 2}
        entities.save(entity)
    conn = sqlite3.connect(tmp_path / "both.db")
    rows = conn.execute("SELECT id, body, version, bucket, pending FROM dedup_entities").fetchall()
    assert rows == [
        ("order-1", '{"outbox":{"m-1":null},"state":{"n":2}}', 2, bucket_of("order-1"), 1)
    ]
    assert conn.execute("SELECT id FROM dedup_records").fetchall() == [("m-1",)]
    conn.close()


def test_the_consumer_is_a_top_level_key_of_the_row(tmp_path: Path) -> None:
    """The consumer that wrote an entity is stored with it, and read back."""
    from dedupstore.outbox import InMemoryDispatcher, Message, OutboxProcessor

    url = f"sqlite:///{tmp_path}/both.db"
    with (
        dedupstore.open_store(url, endpoint="orders") as dedup,
        dedupstore.open_entity_store(url) as entities,
    ):
        processor = OutboxProcessor(entities, dedup, InMemoryDispatcher(), cleanup="deferred")
        processor.process(Message("m-1", "order-1", 2), lambda state, m: ({"n": m.body}, []))
        loaded = entities.load("order-1")
        assert loaded.consumer == "orders" and loaded.outbox == {"m-1": None}
        processor.process(Message("m-1", "order-1", 2), lambda state, m: ({"n": m.body}, []))
        from dedupstore.outbox import sweep

        assert sweep(entities, dedup).ids_moved == 1
        emptied = entities.load("order-1")
        assert emptied.consumer == "orders" and emptied._loaded is not None, "the fast path"
    conn = sqlite3.connect(tmp_path / "both.db")
    rows = conn.execute("SELECT id, body FROM dedup_entities").fetchall()
    assert rows == [("order-1", '{"consumer":"orders","outbox":{},"state":{"n":2}}')]
    conn.close()


def test_missing_table_without_create(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/x.db"
    SqliteEntityStore(url).close()
    with pytest.raises(ConfigurationError, match="does not exist"):
        SqliteEntityStore(url, table="other", create=False)
    with pytest.raises(ConfigurationError, match="unable to open"):
        SqliteEntityStore(f"sqlite:///{tmp_path}/missing.db", create=False)


def test_a_foreign_table_is_refused(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/x.db"
    dedupstore.open_store(url).close()
    with pytest.raises(
        ConfigurationError, match="not usable as an entity table: it has no column body"
    ):
        SqliteEntityStore(url, table="dedup_records")


def test_a_locked_file_is_unavailable_within_the_timeout(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/x.db"
    store = SqliteEntityStore(url, timeout=0.2)
    blocker = sqlite3.connect(tmp_path / "x.db", isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    entity = store.load("e")
    entity.state = {"n": 1}
    with pytest.raises(StoreUnavailable):
        store.save(entity)
    blocker.execute("ROLLBACK")
    store.save(entity)
    assert store.load("e").state == {"n": 1}
    store.close()


def test_bad_options_are_refused_before_any_file_is_made(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="table"):
        SqliteEntityStore(f"sqlite:///{tmp_path}/x.db", table="bad name")
    assert not (tmp_path / "x.db").exists()


def test_default_configuration_opens_the_embedded_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    for var in ("DEDUPSTORE_URL", "DEDUPSTORE_ENTITIES_URL", "DEDUPSTORE_ENV", "DEDUPSTORE_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    with dedupstore.open_entity_store() as entities:
        assert isinstance(entities, SqliteEntityStore)
        assert entities.url.endswith(".dedupstore/dedup.db")


def test_short_lived_threads_leak_no_connections(tmp_path: Path) -> None:
    """Each thread has its own connection; it closes when the thread is gone.

    A few may linger until the interpreter reuses their slots, so the check is that
    the count does not grow with the number of threads (it grew by 3 descriptors a
    thread before: file, WAL and shared memory).
    """
    store = SqliteEntityStore(f"sqlite:///{tmp_path}/x.db")

    def churn() -> int:
        for _ in range(1000):
            thread = threading.Thread(target=store.load, args=("e",))
            thread.start()
            thread.join()
        gc.collect()
        return len(os.listdir("/proc/self/fd"))

    first = churn()
    assert churn() <= first + 10, "connections of ended threads leak"
    assert churn() <= first + 10, "connections of ended threads leak"
    store.close()
