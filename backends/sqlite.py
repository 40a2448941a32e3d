"""``sqlite:///path.db``: the embedded default store.

``sqlite:///relative/path.db`` (made absolute at open, so a pickled store reopens the same file)
or ``sqlite:////absolute/path.db``. WAL mode with ``synchronous=FULL``: a record is on disk when
``add`` returns, and threads and processes may share one file (each write takes SQLite's write
lock; ``INSERT ... ON CONFLICT`` decides the first writer). Expiry is judged by the ``clock``
option (every client of one file runs on one machine). The entity store and the dispatcher keep
their own tables in the same file.

Options (:data:`SQLITE_OPTIONS`, ``table``): with ``create=false`` or ``must_exist=True`` nothing
is created and a missing file or table is "no such store". Operating-system errors that retrying
cannot heal (permission denied, read-only filesystem, ...) are ``ConfigurationError`` naming the
path, not ``StoreUnavailable``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import sqlite3
import threading
import weakref
from collections.abc import Hashable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import quote, unquote, urlsplit

import filelock

from dedupstore.backend import (
    CLOCK,
    Client,
    ConfigurationError,
    Connected,
    Connection,
    DeduplicationStore,
    DispatchStats,
    EncodedMessage,
    EntityRecord,
    EntityStore,
    ErrorKind,
    Option,
    Options,
    OptionSet,
    OutgoingMessage,
    ReadMessage,
    StoredMessage,
    StoreUnavailable,
    StoreURL,
    TokenCount,
    TokenRecord,
    TokenStore,
    TokenWrites,
    URLDispatcher,
    WriteRequest,
    choice,
    create_option,
    creates,
    text,
    timeout_option,
)

__all__ = [
    "SQLITE_OPTIONS",
    "SqliteDeduplicationStore",
    "SqliteDispatcher",
    "SqliteEntityStore",
    "SqliteTokenStore",
    "absolute_sqlite_url",
    "sqlite_path",
]

_IDENTIFIER = r"[A-Za-z_][A-Za-z0-9_]{0,62}"
#: Operating-system errors that retrying cannot heal: a configuration to fix.
_PERMANENT_ERRNOS = {
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EROFS: "read-only filesystem",
    errno.ENOENT: "no such file or directory, and it cannot be created there",
    errno.ENOTDIR: "a part of the path is not a directory",
    errno.EEXIST: "a part of the path is a file, not a directory",
    errno.EISDIR: "is a directory",
    errno.ENAMETOOLONG: "file name too long",
    errno.ELOOP: "too many symbolic links",
    errno.EINVAL: "invalid path for this filesystem",
    errno.ENXIO: "no such device",
    errno.ENODEV: "no such device",
}
#: SQLite errors (lower-cased) that retrying cannot heal: a table, file or permission to fix.
_TO_FIX = re.compile(
    "no such table|no such column|readonly database|unable to open|not a database"
    "|has no column|authorization"
)
#: Options shared by the SQLite deduplication store, entity store and dispatcher.
SQLITE_OPTIONS = (
    timeout_option(10.0, "seconds a call waits for another writer's lock"),
    Option(
        "synchronous",
        choice("OFF", "NORMAL", "FULL", "EXTRA"),
        "FULL",
        "SQLite's synchronous pragma; below FULL a power loss can lose acknowledged writes",
    ),
    create_option(True, "create the directory, file and table when missing"),
)


def _table_option(default: str) -> Option:
    return Option("table", text(_IDENTIFIER, "a plain SQL identifier"), default, "the table")


def sqlite_path(url: StoreURL) -> Path:
    """Return the database file of a ``sqlite:///...`` URL."""
    if url.netloc:
        raise ConfigurationError(
            "a sqlite URL has no host: use 'sqlite:///relative.db' or 'sqlite:////abs.db', "
            f"got {url.masked!r}"
        )
    path = unquote(url.path[1:])
    if not path or path == ":memory:":
        raise ConfigurationError(
            "a sqlite URL must name a database file (an in-memory database cannot be "
            f"shared between connections), got {url.masked!r}"
        )
    return Path(path)


def absolute_sqlite_url(url: str | StoreURL) -> StoreURL:
    """The same URL with the path made absolute (so a pickled copy finds the file). The scheme is
    kept: a subclass registered under a scheme of its own stays itself."""
    parsed = StoreURL.parse(url)
    path = sqlite_path(parsed).absolute()
    query = urlsplit(parsed.text).query
    return StoreURL.parse(f"{parsed.scheme}:///{quote(str(path))}" + (f"?{query}" if query else ""))


class _Connection(sqlite3.Connection):
    """A connection that can be weakly referenced (the plain class cannot)."""


class SqliteConnection(Connection):
    """One SQLite file in one process: a ``sqlite3`` connection per thread (weakly held: a thread
    that ended leaks nothing), closed with this object."""

    schemes: ClassVar[tuple[str, ...]] = ("sqlite",)
    shaped_by: ClassVar[tuple[str, ...]] = ("timeout", "synchronous", "create", "must_exist")
    # One writer per file on the async face: 1,000 tasks' writes in 64 threads contend
    # for the file's write lock (make bench-drivers: one thread, 1.24x the writes/s and
    # 0.42x the memory of 64; aiosqlite, itself one thread, only 1.13x sqlite3 in one).
    offload_threads: ClassVar[int | None] = 1

    def __init__(self, url: StoreURL, options: Options) -> None:
        """No I/O: each thread connects on first use (:meth:`thread_connection`)."""
        super().__init__(url, options)
        self.path = sqlite_path(url)
        self._timeout = float(options["timeout"])
        self.creates = creates(options)
        self._local = threading.local()
        self._all: weakref.WeakSet[sqlite3.Connection] = weakref.WeakSet()
        self._lock = threading.Lock()

    @classmethod
    def portable_url(cls, url: str | StoreURL) -> StoreURL:
        """The URL with the file's absolute path (see ``Client.portable_url``)."""
        return absolute_sqlite_url(url)

    @classmethod
    def address(cls, url: StoreURL, options: Options) -> Hashable:
        """The database file (the URL's path is absolute: :meth:`portable_url`)."""
        return sqlite_path(url)

    def thread_connection(self) -> sqlite3.Connection:
        """This thread's connection."""
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is not None:
            return conn
        # Without ``create`` a missing file is an error, not a new empty database.
        creates = self.creates
        target = self.path if creates else f"file:{quote(str(self.path))}?mode=rw"
        conn = sqlite3.connect(
            target,
            timeout=self._timeout,  # SQLite's busy timeout (PRAGMA busy_timeout)
            isolation_level=None,
            check_same_thread=False,
            uri=not creates,
            factory=_Connection,
        )
        conn.execute(f"PRAGMA synchronous = {self.options['synchronous']}")
        self._local.conn = conn
        with self._lock:
            self._all.add(conn)
        return conn

    def fetch(self, sql: str, params: tuple[Any, ...] = ()) -> list[Any]:
        """The rows of a read, on this thread's connection."""
        return self.thread_connection().execute(sql, params).fetchall()

    @contextlib.contextmanager
    def write_transaction(self) -> Iterator[sqlite3.Connection]:
        """Hold SQLite's write lock for the block; commit on success."""
        conn = self.thread_connection()
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    def open_table(
        self,
        client: Client,
        what: str,
        columns: dict[str, str],
        *,
        key: str = "",
        rowid: bool = False,
    ) -> tuple[sqlite3.Connection, str]:
        """This thread's connection and the quoted name of ``client``'s ``table``, checked to have
        ``columns`` (name: declaration; ``what`` names the table's use in messages). With
        ``create`` the directory, the file (WAL) and the table (``key``: a table constraint;
        ``WITHOUT ROWID`` unless ``rowid``) are created first; else a missing one is "no such
        store"."""
        table = f'"{client.options["table"]}"'
        declared = [f"{name} {kind}" for name, kind in columns.items()] + ([key] if key else [])
        create_sql = f"CREATE TABLE IF NOT EXISTS {table} ({', '.join(declared)})"
        create_sql += "" if rowid else " WITHOUT ROWID"
        conn = self._bootstrap(create_sql) if self.creates else self._open_existing(client)
        names = {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}
        if not names:
            raise client.no_such_store(
                f"table {table} does not exist in SQLite file {self.path}",
                "open with create=true to create it",
            )
        missing = [c for c in columns if c not in names]
        if missing:
            raise client.make_error(
                ConfigurationError,
                None,
                f"table {table} is not usable as {what}: it has no column "
                f"{', '.join(missing)} (it has {', '.join(sorted(names))}); drop it or "
                "name another table",
            )
        return conn, table

    def _open_existing(self, client: Client) -> sqlite3.Connection:
        """This thread's connection to the existing file; "no such store" if missing."""
        if not self.path.exists():
            folder = self.path.absolute().parent
            what = f"unable to open SQLite file {self.path}: it does not exist" + (
                "" if folder.is_dir() else f" (nor does the directory {folder})"
            )
            raise client.no_such_store(what, "open with create=true to create it")
        return self.thread_connection()

    def _bootstrap(self, create_sql: str) -> sqlite3.Connection:
        """Create the directory, switch to WAL and run ``create_sql`` (idempotent)."""
        if self.path.parent != Path():
            self.path.parent.mkdir(parents=True, exist_ok=True)
        lock = f"{self.path}.lock"
        # Created first: filelock would wait out its timeout where it cannot be created at all.
        os.close(os.open(lock, os.O_RDWR | os.O_CREAT, 0o644))
        with filelock.FileLock(lock, timeout=self._timeout):
            conn = self.thread_connection()
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise StoreUnavailable(f"{self.path}: cannot switch to WAL (got {mode!r})")
            conn.execute(create_sql)
            return conn

    def health_warnings(self, client: Client) -> list[str]:
        """A ``synchronous`` level that can lose acknowledged writes."""
        level = self.options["synchronous"]
        if level in ("OFF", "NORMAL"):
            return [
                f"synchronous={level}: a power loss or OS crash can lose records that were "
                "acknowledged; use FULL (the default)"
            ]
        return []

    @classmethod
    def classify_error(cls, client: Client, exc: BaseException) -> ErrorKind:
        """Errors of the file system (what to fix, named with the path) and of SQLite."""
        path = sqlite_path(client.store_url)
        message = str(exc).lower()
        if isinstance(exc, OSError) and exc.errno in _PERMANENT_ERRNOS:
            where = exc.filename if exc.filename is not None else path
            return ConfigurationError(
                f"cannot use SQLite file {path}: {_PERMANENT_ERRNOS[exc.errno]}: {where}"
            )
        if isinstance(exc, filelock.Timeout):
            return StoreUnavailable
        if isinstance(exc, sqlite3.OperationalError) and (
            "unable to open" in message or "readonly database" in message
        ):
            problem = _path_problem(path)
            if problem is not None:
                return ConfigurationError(f"cannot use SQLite file {path}: {problem}")
        if isinstance(exc, sqlite3.OperationalError) and ("locked" in message or "busy" in message):
            return StoreUnavailable
        if isinstance(exc, sqlite3.DatabaseError) and _TO_FIX.search(message):
            return ConfigurationError
        if isinstance(exc, PermissionError | IsADirectoryError | NotADirectoryError):
            return ConfigurationError
        if isinstance(exc, sqlite3.Error | OSError):
            return StoreUnavailable
        return None

    def close(self) -> None:
        """Close every thread's connection."""
        self.close_offload_executor()
        with self._lock:
            connections, self._all = list(self._all), weakref.WeakSet()
        for conn in connections:
            conn.close()


def _path_problem(path: Path) -> str | None:
    """Why the database file cannot be opened, if the filesystem says why."""
    path = path.absolute()
    if path.is_dir():
        return f"{path} is a directory"
    folder = path.parent
    if not folder.is_dir():
        return f"the directory {folder} does not exist"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"permission denied on the directory {folder}"
    if path.exists() and not os.access(path, os.R_OK | os.W_OK):
        return f"permission denied on {path}"
    with contextlib.suppress(OSError):
        if os.statvfs(folder).f_flag & os.ST_RDONLY:
            return f"{folder} is on a read-only filesystem"
    return None


class SqliteDeduplicationStore(DeduplicationStore):
    """Deduplication store in one SQLite file; safe across threads and processes."""

    _sqlite = Connected(SqliteConnection)

    max_write_batch: ClassVar[int] = 5000
    max_read_batch: ClassVar[int] = 5000
    declared_options: ClassVar[OptionSet] = DeduplicationStore.declared_options.extend(
        CLOCK, _table_option("dedup_records"), *SQLITE_OPTIONS
    )

    def _open(self) -> None:
        _, t = self._sqlite.open_table(
            self,
            "a deduplication table",
            {
                "endpoint": "TEXT NOT NULL",
                "id": "TEXT NOT NULL",
                "expires_at": "REAL",
                "writer": "TEXT",
            },
            key="PRIMARY KEY (endpoint, id)",
        )
        upsert = (
            "ON CONFLICT (endpoint, id) DO UPDATE SET expires_at = excluded.expires_at, "
            "writer = excluded.writer "
            f"WHERE ({t}.expires_at IS NOT NULL AND {t}.expires_at <= ?4) "
            f"OR {t}.writer IN (SELECT value FROM json_each(?5)) RETURNING id"
        )
        self._sql_add_many = (
            f"INSERT INTO {t} (endpoint, id, expires_at, writer) "
            f"SELECT ?1, value, ?2, ?6 FROM json_each(?3) WHERE true {upsert}"
        )
        self._sql_add_one = (
            f"INSERT INTO {t} (endpoint, id, expires_at, writer) VALUES (?1, ?3, ?2, ?6) {upsert}"
        )
        live = "(expires_at IS NULL OR expires_at > ?3)"
        self._sql_find = (
            f"SELECT id FROM {t} WHERE endpoint = ?1 "
            f"AND id IN (SELECT value FROM json_each(?2)) AND {live}"
        )
        self._sql_has = f"SELECT 1 FROM {t} WHERE endpoint = ?1 AND id = ?2 AND {live}"
        self._sql_purge = (
            f"DELETE FROM {t} WHERE endpoint = ? AND expires_at IS NOT NULL AND expires_at <= ?"
        )
        self._sql_count = (
            f"SELECT count(*) FROM {t} WHERE endpoint = ?1 "
            "AND (expires_at IS NULL OR expires_at > ?2)"
        )
        self._sql_endpoints = (
            f"SELECT DISTINCT endpoint FROM {t} WHERE expires_at IS NULL OR expires_at > ?1"
        )

    def _write(self, sql: str, params: tuple[Any, ...]) -> set[str]:
        with self._sqlite.write_transaction() as conn:
            return {row[0] for row in conn.execute(sql, params).fetchall()}

    def _params(self, request: WriteRequest, ids: str) -> tuple[Any, ...]:
        return (
            self.endpoint,
            request.expires_at,
            ids,
            request.now,
            json.dumps(sorted(request.mine)),
            request.token,
        )

    def _add_new(self, request: WriteRequest) -> set[str]:
        return self._write(self._sql_add_many, self._params(request, json.dumps(request.ids)))

    def _add_one(self, request: WriteRequest) -> bool:
        return bool(self._write(self._sql_add_one, self._params(request, request.ids[0])))

    def _find(self, ids: list[str], now: float) -> set[str]:
        rows = self._sqlite.fetch(self._sql_find, (self.endpoint, json.dumps(ids), now))
        return {row[0] for row in rows}

    def _contains_one(self, message_id: str, now: float) -> bool:
        return bool(self._sqlite.fetch(self._sql_has, (self.endpoint, message_id, now)))

    def _purge(self, now: float) -> int:
        with self._sqlite.write_transaction() as conn:
            return conn.execute(self._sql_purge, (self.endpoint, now)).rowcount

    def _count(self, now: float) -> int:
        """Exact, one statement (a snapshot): the endpoint's range of the primary key."""
        return int(self._sqlite.fetch(self._sql_count, (self.endpoint, now))[0][0])

    def _endpoints(self, now: float) -> set[str]:
        """Exact, one statement (a snapshot) over the table."""
        return {row[0] for row in self._sqlite.fetch(self._sql_endpoints, (now,))}


class SqliteTokenStore(TokenStore):
    """Tokens in one table of a SQLite file (``id`` primary key, ``endpoint``, ``created``);
    safe across threads and processes. A chunk is one statement in one write transaction."""

    _sqlite = Connected(SqliteConnection)

    max_batch: ClassVar[int] = 5000
    declared_options: ClassVar[OptionSet] = TokenStore.declared_options.extend(
        _table_option("dedup_tokens"), *SQLITE_OPTIONS
    )

    def _open(self) -> None:
        _, t = self._sqlite.open_table(
            self,
            "a token table",
            {"id": "TEXT PRIMARY KEY NOT NULL", "endpoint": "TEXT NOT NULL", "created": "REAL"},
        )
        self.sql_create = (
            f"INSERT INTO {t} (id, endpoint, created) SELECT value ->> '$[0]', "
            f"value ->> '$[1]', value ->> '$[2]' FROM json_each(?) WHERE true "
            "ON CONFLICT (id) DO NOTHING"
        )
        self.sql_present = f"SELECT id FROM {t} WHERE id IN (SELECT value FROM json_each(?))"
        self.sql_delete = f"DELETE FROM {t} WHERE id IN (SELECT value FROM json_each(?))"
        self._sql_outstanding = f"SELECT endpoint, count(*), min(created) FROM {t} GROUP BY 1"
        self._sql_scan = f"SELECT id, endpoint, created FROM {t} WHERE id > ? ORDER BY id LIMIT ?"

    def _create(self, records: list[TokenRecord]) -> None:
        with self._sqlite.write_transaction() as conn:
            conn.execute(self.sql_create, (json.dumps([list(r) for r in records]),))

    def _present(self, ids: list[str]) -> set[str]:
        return {row[0] for row in self._sqlite.fetch(self.sql_present, (json.dumps(ids),))}

    def _delete(self, ids: list[str]) -> None:
        with self._sqlite.write_transaction() as conn:
            conn.execute(self.sql_delete, (json.dumps(ids),))

    def _outstanding(self) -> dict[str, TokenCount]:
        rows = self._sqlite.fetch(self._sql_outstanding)
        return {row[0]: TokenCount(int(row[1]), float(row[2])) for row in rows}

    def _scan(self) -> Iterator[TokenRecord]:
        """Pages of :attr:`page_size` rows in id order, each one statement after the last
        id seen (the primary key's index: no offset, no long read transaction)."""
        after, size = "", self.page_size
        while True:
            rows = self._sqlite.fetch(self._sql_scan, (after, size))
            for row in rows:
                yield TokenRecord(row[0], row[1], float(row[2]))
            if len(rows) < size:
                return
            after = rows[-1][0]


class SqliteEntityStore(EntityStore):
    """Entities in one table of a SQLite file; safe across threads and processes. Token: the
    ``version`` column. A ``save_many`` chunk is one write transaction. The scan pages by id
    through a partial index on ``(bucket, id) WHERE pending``."""

    _sqlite = Connected(SqliteConnection)

    max_load_batch: ClassVar[int] = 500
    max_save_batch: ClassVar[int] = 500
    #: Rows per page of the pending scan.
    page_size: ClassVar[int] = 500
    declared_options: ClassVar[OptionSet] = EntityStore.declared_options.extend(
        _table_option("dedup_entities"), *SQLITE_OPTIONS
    )
    token_joins = SqliteTokenStore

    def _open(self) -> None:
        conn, t = self._sqlite.open_table(
            self,
            "an entity table",
            {
                "id": "TEXT PRIMARY KEY NOT NULL",
                "body": "TEXT NOT NULL",
                "version": "INTEGER NOT NULL",
                "bucket": "INTEGER NOT NULL",
                "pending": "INTEGER NOT NULL",
            },
        )
        if self.creates:
            index = f'"{self.options["table"]}_pending"'
            conn.execute(f"CREATE INDEX IF NOT EXISTS {index} ON {t} (bucket, id) WHERE pending")
        self._sql_load = (
            f"SELECT id, body, version FROM {t} WHERE id IN (SELECT value FROM json_each(?))"
        )
        self._sql_insert = (
            f"INSERT INTO {t} (id, body, version, bucket, pending) VALUES (?, ?, 1, ?, ?) "
            "ON CONFLICT (id) DO NOTHING"
        )
        self._sql_update = (
            f"UPDATE {t} SET body = ?, version = version + 1, bucket = ?, pending = ? "
            "WHERE id = ? AND version = ?"
        )
        self._sql_scan = (
            f"SELECT id, body, version FROM {t} WHERE pending AND bucket % ? = ? AND id > ? "
            "ORDER BY id LIMIT ?"
        )

    def _load(self, ids: list[str]) -> dict[str, tuple[str, Any]]:
        rows = self._sqlite.fetch(self._sql_load, (json.dumps(ids),))
        return {row[0]: (row[1], row[2]) for row in rows}

    def _save(self, records: list[EntityRecord]) -> dict[str, Any]:
        saved: dict[str, Any] = {}
        with self._sqlite.write_transaction() as conn:
            for r in records:
                if r.version is None:
                    cursor = conn.execute(self._sql_insert, (r.id, r.body, r.bucket, r.pending))
                else:
                    cursor = conn.execute(
                        self._sql_update, (r.body, r.bucket, r.pending, r.id, r.version)
                    )
                if cursor.rowcount == 1:
                    saved[r.id] = 1 if r.version is None else r.version + 1
        return saved

    def _load_with_token(
        self, tokens: TokenStore, entity_id: str, token_id: str
    ) -> tuple[tuple[str, Any] | None, bool]:
        """The entity's row, then the token's, in one read transaction."""
        assert isinstance(tokens, SqliteTokenStore)
        conn = self._sqlite.thread_connection()
        conn.execute("BEGIN")
        try:
            row = conn.execute(self._sql_load, (json.dumps([entity_id]),)).fetchone()
            found = conn.execute(tokens.sql_present, (json.dumps([token_id]),)).fetchone()
        finally:
            conn.execute("COMMIT")
        return (None if row is None else (row[1], row[2])), found is not None

    def _save_tokens(
        self,
        tokens: TokenStore,
        records: list[EntityRecord],
        writes: Mapping[str, TokenWrites],
    ) -> tuple[set[str], dict[str, Any]]:
        """One write transaction for the chunk: per record, the required token's row read,
        then the save, then (if it wrote) the token rows inserted and deleted."""
        assert isinstance(tokens, SqliteTokenStore)
        missing: set[str] = set()
        saved: dict[str, Any] = {}
        with self._sqlite.write_transaction() as conn:
            for r in records:
                change = writes.get(r.id)
                if change is not None and change.require is not None:
                    found = conn.execute(tokens.sql_present, (json.dumps([change.require]),))
                    if found.fetchone() is None:
                        missing.add(r.id)
                        continue
                if r.version is None:
                    cursor = conn.execute(self._sql_insert, (r.id, r.body, r.bucket, r.pending))
                else:
                    cursor = conn.execute(
                        self._sql_update, (r.body, r.bucket, r.pending, r.id, r.version)
                    )
                if cursor.rowcount != 1:
                    continue
                saved[r.id] = 1 if r.version is None else r.version + 1
                if change is not None and change.create:
                    rows = json.dumps([list(t) for t in change.create])
                    conn.execute(tokens.sql_create, (rows,))
                if change is not None and change.delete:
                    conn.execute(tokens.sql_delete, (json.dumps(change.delete),))
        return missing, saved

    def _scan(self, segment: int, segments: int) -> Iterator[tuple[str, str, Any]]:
        after = ""
        while True:
            page = self._sqlite.fetch(self._sql_scan, (segments, segment, after, self.page_size))
            yield from ((row[0], row[1], row[2]) for row in page)
            if len(page) < self.page_size:
                return
            after = page[-1][0]


#: Epoch seconds in SQL (``unixepoch('subsec')`` needs SQLite 3.42).
_SQL_NOW = "((julianday('now') - 2440587.5) * 86400.0)"


class SqliteDispatcher(URLDispatcher):
    """A table queue in a SQLite file: one row per message id; safe across processes.

    Table (``table``, default ``dedup_outgoing``): ``seq``, ``id`` (UNIQUE), ``destination``,
    ``body`` (canonical JSON), ``headers`` (JSON), ``deliveries``, ``mismatches``, ``first_at``
    (epoch seconds). A dispatch is one write transaction (all messages or none): a re-dispatch
    adds 1 to ``deliveries``, and to ``mismatches`` when its content differs (the first
    delivery's is kept). Rows keep their insertion order (``seq``: AUTOINCREMENT, assigned under
    the write lock and never reused, so a reader paging by ``seq`` never misses a later commit).
    :meth:`read_back` and :meth:`remove` serve ``dedupstore dead-letters``. Size bound:
    ``max_message_bytes`` is the connection's ``SQLITE_LIMIT_LENGTH`` (read at open; 10^9).
    """

    _sqlite = Connected(SqliteConnection)

    receiver_dedup: ClassVar[str] = (
        "by the table: one row per message id (PRIMARY KEY); re-dispatches only count "
        "deliveries, so a receiver reading rows sees each id once"
    )
    #: Rows per page of :meth:`messages`.
    page_size: ClassVar[int] = 500
    declared_options: ClassVar[OptionSet] = URLDispatcher.declared_options.extend(
        _table_option("dedup_outgoing"), *SQLITE_OPTIONS
    )

    def _open(self) -> None:
        _, t = self._sqlite.open_table(
            self,
            "a dispatcher table",
            {
                "seq": "INTEGER PRIMARY KEY AUTOINCREMENT",  # never reused: see receive()
                "id": "TEXT NOT NULL UNIQUE",
                "destination": "TEXT NOT NULL",
                "body": "TEXT NOT NULL",
                "headers": "TEXT NOT NULL",
                "deliveries": "INTEGER NOT NULL",
                "mismatches": "INTEGER NOT NULL",
                "first_at": "REAL NOT NULL",
            },
            rowid=True,  # (AUTOINCREMENT needs a rowid table)
        )
        length = self._sqlite.thread_connection().getlimit(sqlite3.SQLITE_LIMIT_LENGTH)
        own = self.max_message_bytes
        self.max_message_bytes = length if own is None else min(own, length)
        self._sql_upsert = (
            f"INSERT INTO {t} (id, destination, body, headers, deliveries, mismatches, first_at) "
            f"VALUES (?, ?, ?, ?, 1, 0, {_SQL_NOW}) ON CONFLICT (id) DO UPDATE SET "
            "deliveries = deliveries + 1, mismatches = mismatches + (destination IS NOT "
            "excluded.destination OR body IS NOT excluded.body OR headers IS NOT excluded.headers)"
        )
        self._sql_receive = (
            "SELECT seq, id, destination, body, headers, deliveries, mismatches, first_at "
            f"FROM {t} WHERE seq > ? ORDER BY seq LIMIT ?"
        )
        self._sql_read_back = (
            f"SELECT seq, id, body, headers FROM {t} WHERE destination = ? AND seq > ? "
            "ORDER BY seq LIMIT ?"
        )
        self._sql_remove = f"DELETE FROM {t} WHERE destination = ? AND seq = ? AND id = ?"
        self._sql_stats = (
            f"SELECT count(*), coalesce(sum(deliveries), 0), coalesce(sum(mismatches), 0) FROM {t}"
        )

    def _dispatch(self, batch: list[EncodedMessage]) -> None:
        rows = [(m.id, m.destination, m.body, m.headers) for m in batch]
        with self._sqlite.write_transaction() as conn:
            conn.executemany(self._sql_upsert, rows)

    # ------------------------------------------------------------------ reading

    def count(self) -> int:
        """How many distinct message ids the table holds. Raises ``StoreUnavailable``."""
        return self.stats().rows

    def stats(self) -> DispatchStats:
        """``(rows, deliveries, mismatches)`` over the table, in one statement: ``mismatches >
        0`` means an id was dispatched with different contents. Raises ``StoreUnavailable``."""
        self.check_open()
        with self.translating_errors("read"):
            rows, deliveries, mismatches = self._sqlite.fetch(self._sql_stats)[0]
        return DispatchStats(int(rows), int(deliveries), int(mismatches))

    def receive(self, limit: int = 500, after: int | None = None) -> list[StoredMessage]:
        """Up to ``limit`` rows after row ``after`` (a ``seq``; ``None``: from the start).

        In insertion order; rows are not removed (a receiver keeps its last ``seq``). Raises
        ``ValueError`` for a bad ``limit``/``after``, ``StoreUnavailable``.
        """
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"limit must be an int >= 1, got {limit!r}")
        start = 0 if after is None else after
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise ValueError(f"after must be a seq (an int >= 0) or None, got {after!r}")
        self.check_open()
        with self.translating_errors("read"):
            rows = self._sqlite.fetch(self._sql_receive, (start, limit))
        return [
            StoredMessage(
                seq=row[0],
                message=OutgoingMessage(row[1], row[2], json.loads(row[3]), json.loads(row[4])),
                deliveries=row[5],
                mismatches=row[6],
                first_at=row[7],
            )
            for row in rows
        ]

    def messages(self, after: int | None = None) -> Iterator[StoredMessage]:
        """Every row after ``after`` in insertion order, :attr:`page_size` rows per read."""
        while True:
            page = self.receive(self.page_size, after)
            yield from page
            if len(page) < self.page_size:
                return
            after = page[-1].seq

    def read_back(self, destination: str) -> list[ReadMessage]:
        """Every row of ``destination`` in insertion order (:attr:`page_size` rows per read);
        the ``position`` is the row's ``seq``. Raises ``StoreUnavailable``."""
        self.check_open()
        out: list[ReadMessage] = []
        after = 0
        with self.translating_errors("read"):
            while True:
                rows = self._sqlite.fetch(self._sql_read_back, (destination, after, self.page_size))
                for seq, mid, body, headers in rows:
                    message = OutgoingMessage(
                        mid, destination, json.loads(body), json.loads(headers)
                    )
                    out.append(ReadMessage(message, len(body.encode("utf-8")), str(seq)))
                if len(rows) < self.page_size:
                    return out
                after = rows[-1][0]

    def remove(self, destination: str, messages: Sequence[ReadMessage]) -> int:
        """Delete the rows of ``messages`` (by ``seq`` and id) from ``destination`` in one write
        transaction; return how many were still there. Their ``seq`` is never given again.
        Raises ``StoreUnavailable``."""
        self.check_open()
        rows = [(destination, int(m.position), m.message.id) for m in messages]
        if not rows:
            return 0
        with self.translating_errors("remove"), self._sqlite.write_transaction() as conn:
            return sum(conn.execute(self._sql_remove, row).rowcount for row in rows)
