"""``sqlite:///path.db``: the embedded default store.

``sqlite:///relative/path.db`` is relative to the current directory and
``sqlite:////absolute/path.db`` absolute (SQLAlchemy's convention). The database
runs in WAL mode with ``synchronous=FULL``: a record is on disk when ``add``
returns, and several threads and processes may use one file at once (each write
takes SQLite's write lock; ``INSERT ... ON CONFLICT`` decides the first writer).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sqlite3
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import quote, unquote

from filelock import FileLock

from dedupstore.errors import ConfigurationError, StoreUnavailable
from dedupstore.store import Clock, DeduplicationStore
from dedupstore.urls import parse_bool, split_url

__all__ = ["SqliteDeduplicationStore", "sqlite_path_from_url"]

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")
_SYNCHRONOUS = ("OFF", "NORMAL", "FULL", "EXTRA")


def sqlite_path_from_url(url: str) -> Path:
    """Return the database file of a ``sqlite:///...`` URL."""
    parts = split_url(url)
    if parts.scheme != "sqlite":
        raise ConfigurationError(f"not a sqlite:// URL: {url!r}")
    if parts.netloc:
        raise ConfigurationError(
            f"a sqlite URL has no host: use 'sqlite:///relative.db' or 'sqlite:////abs.db', "
            f"got {url!r}"
        )
    path = unquote(parts.path[1:])
    if not path or path == ":memory:":
        raise ConfigurationError(
            f"a sqlite URL must name a database file (an in-memory database cannot be "
            f"shared between connections), got {url!r}"
        )
    return Path(path)


class SqliteDeduplicationStore(DeduplicationStore):
    """Deduplication store in one SQLite file; safe across threads and processes."""

    schemes: ClassVar[tuple[str, ...]] = ("sqlite",)
    max_write_batch: ClassVar[int] = 5000
    max_read_batch: ClassVar[int] = 5000
    url_options: ClassVar[dict[str, Any]] = {
        "table": str,
        "timeout": float,
        "synchronous": str,
        "create_schema": parse_bool,
    }

    def __init__(
        self,
        url: str,
        *,
        endpoint: str = "default",
        retention: timedelta | None = None,
        clock: Clock | None = None,
        table: str = "dedup_records",
        timeout: float = 30.0,
        synchronous: str = "FULL",
        create_schema: bool = True,
    ) -> None:
        """Open (and by default create) the database file named by ``url``.

        ``timeout`` is how long a write waits for another writer's lock before
        ``StoreUnavailable``. Raises ``ConfigurationError`` for a bad URL or table
        name and ``StoreUnavailable`` when the file cannot be opened.
        """
        if not _IDENTIFIER.fullmatch(table):
            raise ConfigurationError(f"table must be a plain SQL identifier, got {table!r}")
        if synchronous.upper() not in _SYNCHRONOUS:
            raise ConfigurationError(f"synchronous must be one of {_SYNCHRONOUS}")
        # A relative path is resolved now, so a pickled store (a Spark task in another
        # working directory) reopens the same file.
        self._path = sqlite_path_from_url(url).absolute()
        super().__init__(
            f"sqlite:///{quote(str(self._path))}",
            endpoint=endpoint,
            retention=retention,
            clock=clock,
            options={
                "table": table,
                "timeout": timeout,
                "synchronous": synchronous,
                "create_schema": create_schema,
            },
        )
        self._unavailable_errors = (sqlite3.DatabaseError, OSError)
        self._timeout = timeout
        self._synchronous = synchronous.upper()
        self._local = threading.local()
        self._connections: list[sqlite3.Connection] = []
        self._connections_lock = threading.Lock()
        t = f'"{table}"'
        self._sql_add_many = (
            f"INSERT INTO {t} (endpoint, id, expires_at) "
            "SELECT ?1, value, ?2 FROM json_each(?3) WHERE true "
            "ON CONFLICT (endpoint, id) DO UPDATE SET expires_at = excluded.expires_at "
            f"WHERE {t}.expires_at IS NOT NULL AND {t}.expires_at <= ?4 RETURNING id"
        )
        self._sql_add_one = (
            f"INSERT INTO {t} (endpoint, id, expires_at) VALUES (?1, ?3, ?2) "
            "ON CONFLICT (endpoint, id) DO UPDATE SET expires_at = excluded.expires_at "
            f"WHERE {t}.expires_at IS NOT NULL AND {t}.expires_at <= ?4 RETURNING id"
        )
        self._sql_find = (
            f"SELECT id FROM {t} WHERE endpoint = ?1 "
            "AND id IN (SELECT value FROM json_each(?2)) "
            "AND (expires_at IS NULL OR expires_at > ?3)"
        )
        self._sql_has = (
            f"SELECT 1 FROM {t} WHERE endpoint = ?1 AND id = ?2 "
            "AND (expires_at IS NULL OR expires_at > ?3)"
        )
        self._sql_purge = (
            f"DELETE FROM {t} WHERE endpoint = ? AND expires_at IS NOT NULL AND expires_at <= ?"
        )
        with self._translating_errors("open the database"):
            if create_schema:
                self._bootstrap(t)
            else:
                self._connection().execute(f"SELECT 1 FROM {t} LIMIT 1").fetchall()

    def _bootstrap(self, quoted_table: str) -> None:
        """Create the directory, switch to WAL and create the table (idempotent)."""
        if self._path.parent != Path():
            self._path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(f"{self._path}.lock", timeout=self._timeout):
            conn = self._connection()
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise StoreUnavailable(f"{self._path}: cannot switch to WAL (got {mode!r})")
            conn.execute(
                f"CREATE TABLE IF NOT EXISTS {quoted_table} ("
                "endpoint TEXT NOT NULL, id TEXT NOT NULL, expires_at REAL, "
                "PRIMARY KEY (endpoint, id)) WITHOUT ROWID"
            )

    def _connection(self) -> sqlite3.Connection:
        """Return this thread's connection (a new one after ``fork``)."""
        pid = os.getpid()
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is not None and self._local.pid == pid:
            return conn
        conn = sqlite3.connect(
            self._path, timeout=self._timeout, isolation_level=None, check_same_thread=False
        )
        conn.execute(f"PRAGMA synchronous = {self._synchronous}")
        conn.execute(f"PRAGMA busy_timeout = {int(self._timeout * 1000)}")
        self._local.conn, self._local.pid = conn, pid
        with self._connections_lock:
            self._connections.append(conn)
        return conn

    @contextlib.contextmanager
    def _write_transaction(self) -> Iterator[sqlite3.Connection]:
        """Hold SQLite's write lock for the block; commit on success."""
        conn = self._connection()
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    def _write(self, sql: str, params: tuple[Any, ...]) -> set[str]:
        with self._write_transaction() as conn:
            return {row[0] for row in conn.execute(sql, params).fetchall()}

    def _add_new(self, ids: list[str], now: float, expires_at: float | None) -> set[str]:
        return self._write(self._sql_add_many, (self._endpoint, expires_at, json.dumps(ids), now))

    def _add_one(self, message_id: str, now: float, expires_at: float | None) -> bool:
        return bool(self._write(self._sql_add_one, (self._endpoint, expires_at, message_id, now)))

    def _find(self, ids: list[str], now: float) -> set[str]:
        rows = self._connection().execute(self._sql_find, (self._endpoint, json.dumps(ids), now))
        return {row[0] for row in rows}

    def _contains_one(self, message_id: str, now: float) -> bool:
        row = (
            self._connection().execute(self._sql_has, (self._endpoint, message_id, now)).fetchone()
        )
        return row is not None

    def _purge(self, now: float) -> int:
        with self._write_transaction() as conn:
            return conn.execute(self._sql_purge, (self._endpoint, now)).rowcount

    def _close(self) -> None:
        with self._connections_lock:
            connections, self._connections = self._connections, []
        pid = os.getpid()
        for conn in connections:
            if getattr(self._local, "pid", pid) == pid:
                conn.close()
        self._local = threading.local()
