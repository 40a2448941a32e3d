"""SQLite-specific behaviour: error classes on real files, tables of another shape, warnings."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import pytest

from dedupstore import ConfigurationError, StoreClosed, StoreUnavailable, open_store

pytestmark = pytest.mark.sqlite


def test_a_table_dropped_while_open_is_a_configuration_error(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/d.db"
    store = open_store(url)
    store.add("before")
    with sqlite3.connect(tmp_path / "d.db") as other:
        other.execute('DROP TABLE "dedup_records"')
    for call in (lambda: store.add("x"), lambda: store.processed_among(["x"]), store.purge_expired):
        with pytest.raises(ConfigurationError, match="no such table"):
            call()
    store.close()


def test_a_lock_held_past_the_timeout_is_store_unavailable(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/d.db?timeout=0.2"
    store = open_store(url)
    holder = sqlite3.connect(tmp_path / "d.db", isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")  # another writer holds the write lock
    try:
        with pytest.raises(StoreUnavailable, match="locked") as info:
            store.add("blocked")
        assert info.value.unknown == {"blocked"}
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert store.add("blocked") is True, "the retry succeeds once the lock is free"
    store.close()


def test_a_directory_instead_of_a_file_is_a_configuration_error(tmp_path: Path) -> None:
    (tmp_path / "dir.db").mkdir()
    with pytest.raises(ConfigurationError):
        open_store(f"sqlite:///{tmp_path}/dir.db")


def test_without_create_a_missing_file_is_not_created(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="unable to open"):
        open_store(f"sqlite:///{tmp_path}/absent.db?create=false")
    assert not (tmp_path / "absent.db").exists()


def test_a_table_of_a_pre_release_shape_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as conn:
        conn.execute(
            "CREATE TABLE dedup_records (endpoint TEXT NOT NULL, id TEXT NOT NULL, "
            "expires_at REAL, PRIMARY KEY (endpoint, id)) WITHOUT ROWID"
        )
        conn.execute("INSERT INTO dedup_records VALUES ('default', 'old', NULL)")
    for create in ("false", "true"):
        with pytest.raises(ConfigurationError) as info:
            open_store(f"sqlite:///{path}?create={create}")
        message = str(info.value)
        assert 'table "dedup_records"' in message and "has no column writer" in message
        assert "not usable as a deduplication table" in message and "drop it" in message
    with sqlite3.connect(path) as conn:
        assert [row[1] for row in conn.execute("PRAGMA table_info(dedup_records)")] == [
            "endpoint",
            "id",
            "expires_at",
        ], "the table is left as it was"


def test_use_after_close_from_another_thread_is_store_closed(tmp_path: Path) -> None:
    store = open_store(f"sqlite:///{tmp_path}/d.db")
    store.close()
    errors: list[BaseException] = []

    def use() -> None:
        try:
            store.add("x")
        except BaseException as exc:  # noqa: BLE001 - inspected below
            errors.append(exc)

    thread = threading.Thread(target=use)
    thread.start()
    thread.join()
    assert len(errors) == 1 and isinstance(errors[0], StoreClosed)
