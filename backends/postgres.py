"""``postgresql://`` / ``postgres://``: a deduplication table in PostgreSQL.

The URL is a libpq connection URI. Query parameters that are dedupstore options
(``table``, ``create_schema``, ``pool_min_size``, ``pool_max_size``,
``connect_timeout``, ``password``, ``endpoint``, ``retention``) configure the store;
every other one (``sslmode``, ``application_name``, ``options``, ...) goes to
libpq unchanged, and libpq's environment variables (``PGPASSWORD``, ...) apply.

Records live in one table keyed by ``(endpoint, id)``, both ``text COLLATE "C"``
(byte-exact comparison, so ids differing only in case, accents or trailing spaces
never collide), with the expiry as ``double precision`` epoch seconds compared with
the store's clock, never the server's. Every statement runs in autocommit: a
record is committed (and, with ``synchronous_commit`` forced on for the store's
sessions, flushed to the WAL) before ``add`` returns. ``INSERT ... ON CONFLICT``
decides the first writer.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import math
import os
import select
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar, Self
from urllib.parse import parse_qsl, quote, unquote, unquote_plus, urlencode, urlunsplit

import psycopg
import psycopg.conninfo
import psycopg.errors
from psycopg import sql
from psycopg.rows import TupleRow
from psycopg_pool import ConnectionPool, PoolTimeout

from dedupstore.errors import ConfigurationError, StoreUnavailable
from dedupstore.store import Clock, DeduplicationStore
from dedupstore.urls import (
    SECRET_OPTION_NAMES,
    mask_url,
    parse_bool,
    query_options,
    split_url,
)

if TYPE_CHECKING:
    Connection = psycopg.Connection[TupleRow]

__all__ = ["DEFAULT_TABLE", "PostgresDeduplicationStore"]

#: The table used when no ``table`` option is given.
DEFAULT_TABLE = "dedup_records"

_IDENTIFIER_MAX_BYTES = 63  # NAMEDATALEN - 1: PostgreSQL truncates longer names
_PURGE_BATCH = 10_000
_WRITE_ATTEMPTS = 3  # deadlock / serialization failure: rolled back, safe to retry

# libpq's connection failures that a retry will not fix: wrong password, unknown
# role or database, refused by pg_hba.conf.
_CREDENTIAL_MARKERS = (
    "password authentication failed",
    "no password supplied",
    "authentication failed",
    "pg_hba.conf",
    "does not exist",
    "permission denied",
    "password is required",
)

# Contention errors raised by the server for a statement that was rolled back.
_RETRYABLE_WRITE_ERRORS: tuple[type[psycopg.Error], ...] = (
    psycopg.errors.DeadlockDetected,
    psycopg.errors.SerializationFailure,
)

# Pools of stores inherited through ``fork()``: their sockets belong to the parent,
# so the child must neither use nor close them (closing would end the parent's
# sessions). They are kept referenced here, never collected.
_inherited_pools: list[object] = []


def _query_pieces(query: str, keep: Callable[[str], bool]) -> str:
    """The ``key=value`` pieces of a URL query whose (decoded) key passes ``keep``."""
    return "&".join(
        piece for piece in query.split("&") if piece and keep(unquote_plus(piece.partition("=")[0]))
    )


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def _split_table(table: str) -> tuple[str, ...]:
    """``'name'`` or ``'schema.name'`` -> identifier parts; ``ConfigurationError`` if bad."""
    if not isinstance(table, str):
        raise ConfigurationError(f"table must be a str, got {type(table).__name__}")
    parts = tuple(table.split("."))
    if len(parts) > 2 or not all(parts):
        raise ConfigurationError(f"table must be 'name' or 'schema.name', got {table!r}")
    for part in parts:
        if "\x00" in part or len(part.encode("utf-8", "surrogatepass")) > _IDENTIFIER_MAX_BYTES:
            raise ConfigurationError(
                f"table name part {part[:70]!r} must be at most {_IDENTIFIER_MAX_BYTES} bytes "
                "without NUL characters"
            )
    return parts


def _index_name(table_name: str) -> str:
    name = f"{table_name}_expires_at"
    if len(name.encode("utf-8")) <= _IDENTIFIER_MAX_BYTES:
        return name
    digest = hashlib.sha256(table_name.encode("utf-8")).hexdigest()[:10]
    return f"{table_name.encode('utf-8')[:40].decode('utf-8', 'ignore')}_{digest}_expires_at"


class _ConnectFailures:
    """The last failed connection attempt of a pool, to explain its timeouts."""

    def __init__(self) -> None:
        self.at = -math.inf
        self.message = ""


def _recording_connection_class(failures: _ConnectFailures) -> type[Connection]:
    """A connection class that notes each failed connection attempt in ``failures``."""

    class RecordingConnection(psycopg.Connection[TupleRow]):
        @classmethod
        def connect(cls, conninfo: str = "", **kwargs: Any) -> Self:
            try:
                return super().connect(conninfo, **kwargs)
            except psycopg.Error as exc:
                failures.at, failures.message = time.monotonic(), _one_line(exc)
                raise

    RecordingConnection.__qualname__ = RecordingConnection.__name__
    return RecordingConnection


def _server_closed(conn: Connection) -> bool:
    """Whether the server ended this idle connection; checked without a round trip.

    An idle connection has nothing to read: readable means the server closed the
    session (restart, crash, idle timeout) or sent something unexpected.
    """
    if conn.closed or conn.broken:
        return True
    fd = conn.fileno()
    if hasattr(select, "poll"):
        poller = select.poll()
        poller.register(fd, select.POLLIN | select.POLLPRI)
        return bool(poller.poll(0))
    return bool(select.select([fd], [], [], 0)[0])  # pragma: no cover - Windows


def _configure(conn: Connection) -> None:
    """New pooled connection: pin a durable ``synchronous_commit`` for the session.

    The server's value is kept unless it is ``off`` (then ``on``); pinning it in the
    session means a later configuration reload cannot turn it off under the pool.
    """
    conn.execute(
        "SELECT set_config('synchronous_commit', CASE current_setting('synchronous_commit') "
        "WHEN 'off' THEN 'on' ELSE current_setting('synchronous_commit') END, false)"
    )


class PostgresDeduplicationStore(DeduplicationStore):
    """Deduplication store in a PostgreSQL table, through a psycopg connection pool.

    Thread-safe; open one per process (it pickles to its URL and options). Raises
    ``StoreUnavailable`` when the server cannot answer; ``add``/``add_many`` are
    never retried once sent, so their answer is exact or an error.
    """

    schemes: ClassVar[tuple[str, ...]] = ("postgresql", "postgres")
    max_write_batch: ClassVar[int] = 2000
    max_read_batch: ClassVar[int] = 5000
    # Two chunks in flight: the server works on one while the next is sent (and on
    # two cores at once); overlapping chunks are sorted, so they cannot deadlock.
    chunk_concurrency: ClassVar[int] = 2
    url_options: ClassVar[Mapping[str, Callable[[str], Any]]] = {
        "table": str,
        "create_schema": parse_bool,
        "pool_min_size": int,
        "pool_max_size": int,
        "connect_timeout": float,
        "password": str,
    }

    def __init__(
        self,
        url: str,
        *,
        endpoint: str = "default",
        retention: timedelta | None = None,
        clock: Clock | None = None,
        table: str = DEFAULT_TABLE,
        create_schema: bool = False,
        pool_min_size: int = 1,
        pool_max_size: int = 10,
        connect_timeout: float = 10.0,
        password: str | None = None,
        client: ConnectionPool[Connection] | None = None,
    ) -> None:
        """Connect, check the table (creating it if ``create_schema``) and open the pool.

        ``table`` is ``'name'`` or ``'schema.name'``, used verbatim (quoted).
        ``connect_timeout`` (seconds) bounds connecting and waiting for a pooled
        connection. ``client`` is a ready ``psycopg_pool.ConnectionPool`` to use
        instead of opening one (it is not closed by :meth:`close`).

        Raises ``ConfigurationError`` for a bad URL or option, refused credentials,
        a non-UTF8 database or a missing/unusable table, and ``StoreUnavailable``
        when the server cannot be reached.
        """
        self._table_parts = _split_table(table)
        try:
            create_schema = parse_bool(create_schema)
        except (ValueError, AttributeError):
            raise ConfigurationError(
                f"create_schema must be true or false, got {create_schema!r}"
            ) from None
        if isinstance(pool_min_size, bool) or not isinstance(pool_min_size, int):
            raise ConfigurationError(f"pool_min_size must be an int, got {pool_min_size!r}")
        if isinstance(pool_max_size, bool) or not isinstance(pool_max_size, int):
            raise ConfigurationError(f"pool_max_size must be an int, got {pool_max_size!r}")
        if pool_min_size < 0 or pool_max_size < max(1, pool_min_size):
            raise ConfigurationError(
                "pool sizes must satisfy 0 <= pool_min_size <= pool_max_size and "
                f"pool_max_size >= 1, got {pool_min_size} and {pool_max_size}"
            )
        if (
            isinstance(connect_timeout, bool)
            or not isinstance(connect_timeout, int | float)
            or not connect_timeout > 0
            or math.isinf(connect_timeout)
        ):
            raise ConfigurationError(
                f"connect_timeout must be a positive number of seconds, got {connect_timeout!r}"
            )
        options: dict[str, Any] = {
            "table": table,
            "create_schema": create_schema,
            "pool_min_size": pool_min_size,
            "pool_max_size": pool_max_size,
            "connect_timeout": connect_timeout,
        }
        if password is not None:
            options["password"] = password
        if client is not None:
            options["client"] = client
        super().__init__(url, endpoint=endpoint, retention=retention, clock=clock, options=options)
        self._unavailable_errors = (psycopg.Error,)
        self._password = password
        self._check_url_agrees(url)
        self._conninfo = self._libpq_conninfo(url)
        self._connect_timeout = float(connect_timeout)
        self._connect_kwargs: dict[str, Any] = {
            "autocommit": True,
            "connect_timeout": max(2, math.ceil(connect_timeout)),
            "client_encoding": "UTF8",
            "fallback_application_name": "dedupstore",
        }
        if password is not None:
            self._connect_kwargs["password"] = password
        self._pool_sizes = (pool_min_size, pool_max_size)
        self._connect_failures = _ConnectFailures()
        self._owns_pool = client is None
        self._pool_lock = threading.Lock()
        self._build_statements()
        if client is not None:
            with self._translating_errors("connect"), client.connection() as conn:
                self._check_storage(conn, create_schema)
            self._pool = client
        else:
            self._probe(create_schema)
            self._pool = self._new_pool()
        self._pool_pid = os.getpid()

    # ------------------------------------------------------------------ opening

    @classmethod
    def from_url(cls, url: str, **options: Any) -> Self:
        """Build a store from its URL; dedupstore options are taken from the query.

        Other query parameters are libpq's: they stay in the URL, and libpq rejects
        unknown ones when the store opens.
        """
        parts = split_url(url)
        converters = {**cls._COMMON_URL_OPTIONS, **cls.url_options}
        own = _query_pieces(parts.query, lambda key: key in converters)
        merged = {**query_options(parts._replace(query=own), converters), **options}
        if _query_pieces(parts.query, lambda key: key in options) != "":
            # keywords override the URL: drop the overridden values from it
            url = urlunsplit(
                parts._replace(query=_query_pieces(parts.query, lambda key: key not in options))
            )
        try:
            inspect.signature(cls).bind(url, **merged)
        except TypeError as exc:
            raise ConfigurationError(
                f"cannot open {mask_url(url)} with {cls.__name__}: {exc}"
            ) from None
        return cls(url, **merged)

    @classmethod
    def create_schema(cls, url: str, **options: Any) -> None:
        """Create the table and its expiry index if missing (idempotent).

        Takes the same URL and options as :func:`dedupstore.open_store`; needs
        the CREATE privilege. Safe to run concurrently. Raises like the
        constructor.
        """
        cls.from_url(url, **{**options, "create_schema": True}).close()

    def _check_url_agrees(self, url: str) -> None:
        """Refuse dedupstore options in the URL that the keyword arguments contradict.

        Only :meth:`from_url` (and so ``open_store``) reads options from the query;
        a direct constructor call must not silently ignore them.
        """
        parts = split_url(url)
        converters = {**self._COMMON_URL_OPTIONS, **self.url_options}
        in_url = query_options(
            parts._replace(query=_query_pieces(parts.query, lambda key: key in converters)),
            converters,
        )
        effective = {**self._options, "endpoint": self._endpoint, "retention": self._retention}
        for key, value in in_url.items():
            if effective.get(key) != value:
                secret = key.lower() in SECRET_OPTION_NAMES
                shown, given = ("***", "***") if secret else (repr(value), repr(effective.get(key)))
                raise ConfigurationError(
                    f"the URL sets {key}={shown} but the {key} argument is {given}: open the "
                    f"store with open_store() or {type(self).__name__}.from_url(), where "
                    "keyword arguments override the URL"
                )

    def _libpq_conninfo(self, url: str) -> str:
        """``url`` minus dedupstore's query options, validated by libpq's parser."""
        parts = split_url(url)
        if parts.scheme not in self.schemes:
            raise ConfigurationError(
                f"expected a postgresql:// or postgres:// URL, got {self._scrub(self.url)!r}"
            )
        ours = {*self._COMMON_URL_OPTIONS, *self.url_options}
        kept = [
            (key, value)
            for key, value in parse_qsl(parts.query, keep_blank_values=True)
            if key not in ours
        ]
        conninfo = urlunsplit(parts._replace(query=urlencode(kept, quote_via=quote), fragment=""))
        try:
            psycopg.conninfo.conninfo_to_dict(conninfo)
        except psycopg.Error as exc:
            raise ConfigurationError(
                f"bad PostgreSQL URL {self.url}: {self._scrub(_one_line(exc))}"
            ) from None
        return conninfo

    def _scrub(self, text: str) -> str:
        """Remove the password (raw or decoded) from ``text``."""
        secrets = {self._password} if self._password else set()
        userinfo = split_url(self._url).netloc.rpartition("@")[0]
        if ":" in userinfo:
            raw = userinfo.split(":", 1)[1]
            secrets |= {raw, unquote(raw)}
        for secret in sorted((s for s in secrets if s), key=len, reverse=True):
            text = text.replace(secret, "***")
        return text

    def _probe(self, create_schema: bool) -> None:
        """Connect once to report bad credentials or an unreachable server clearly."""
        try:
            conn = psycopg.connect(self._conninfo, **self._connect_kwargs)
        except psycopg.OperationalError as exc:
            message = self._scrub(_one_line(exc))
            if any(marker in message for marker in _CREDENTIAL_MARKERS):
                raise ConfigurationError(
                    f"PostgreSQL at {self.url} refused the connection: {message}"
                ) from exc
            raise StoreUnavailable(
                f"cannot connect to PostgreSQL at {self.url}: {message}"
            ) from exc
        except psycopg.Error as exc:
            raise ConfigurationError(
                f"cannot connect to PostgreSQL at {self.url}: {self._scrub(_one_line(exc))}"
            ) from exc
        with conn, self._translating_errors("open the table"):
            self._check_storage(conn, create_schema)

    def _check_storage(self, conn: Connection, create_schema: bool) -> None:
        """Check the encoding and the table (creating it if asked) on ``conn``."""
        row = conn.execute("SELECT current_setting('server_encoding')").fetchone()
        encoding = row[0] if row else None
        if encoding != "UTF8" or conn.info.encoding != "utf-8":
            raise ConfigurationError(
                f"PostgreSQL at {self.url}: the database encoding is {encoding} and the client "
                f"encoding {conn.info.encoding}; dedupstore needs UTF8 for both so every id "
                "round-trips"
            )
        found = conn.execute("SELECT to_regclass(%s) IS NOT NULL", [self._table_text]).fetchone()
        if not (found and found[0]):
            if not create_schema:
                raise ConfigurationError(
                    f"table {self._table_text} does not exist in PostgreSQL at {self.url}: "
                    "call PostgresDeduplicationStore.create_schema(url) once, or open the "
                    "store with create_schema=true"
                )
            self._create_table(conn)
        try:
            conn.execute(self._sql_columns)
            conn.execute(
                self._sql_add_many,
                {"endpoint": self._endpoint, "ids": [], "expires_at": None, "now": 0.0},
            )
        except (psycopg.ProgrammingError, psycopg.DataError) as exc:
            raise ConfigurationError(
                f"table {self._table_text} in PostgreSQL at {self.url} is not usable as a "
                f"deduplication table: {_one_line(exc)}"
            ) from exc

    def _create_table(self, conn: Connection) -> None:
        """Create the schema, table and index (serialized by an advisory lock)."""
        with conn.transaction():
            conn.execute(
                "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))",
                [f"dedupstore:{self._table_text}"],
            )
            if len(self._table_parts) == 2:
                schema = self._table_parts[0]
                exists = conn.execute(
                    "SELECT 1 FROM pg_namespace WHERE nspname = %s", [schema]
                ).fetchone()
                if not exists:
                    conn.execute(
                        sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema))
                    )
            conn.execute(
                sql.SQL(
                    "CREATE TABLE IF NOT EXISTS {table} ("
                    'endpoint text COLLATE "C" NOT NULL, '
                    'id text COLLATE "C" NOT NULL, '
                    "expires_at double precision, "
                    "PRIMARY KEY (endpoint, id))"
                ).format(table=self._table)
            )
            conn.execute(
                sql.SQL(
                    "CREATE INDEX IF NOT EXISTS {index} ON {table} (endpoint, expires_at) "
                    "WHERE expires_at IS NOT NULL"
                ).format(
                    index=sql.Identifier(_index_name(self._table_parts[-1])), table=self._table
                )
            )

    def _build_statements(self) -> None:
        self._table = sql.Identifier(*self._table_parts)
        self._table_text = self._table.as_string(None)

        def render(text: str) -> bytes:
            return sql.SQL(text).format(table=self._table).as_bytes(None)

        on_conflict = (
            "ON CONFLICT (endpoint, id) DO UPDATE SET expires_at = EXCLUDED.expires_at "
            "WHERE r.expires_at IS NOT NULL AND r.expires_at <= %(now)s::float8 "
        )
        # Rows are inserted in one order (code points = UTF-8 bytes = COLLATE "C")
        # by every writer, so overlapping batches wait for each other, never deadlock.
        self._sql_add_many = render(
            "INSERT INTO {table} AS r (endpoint, id, expires_at) "
            "SELECT %(endpoint)s::text, u.id, %(expires_at)s::float8 "
            "FROM unnest(%(ids)b::text[]) WITH ORDINALITY AS u(id, n) ORDER BY u.n "
            f"{on_conflict}RETURNING r.id"
        )
        self._sql_add_one = render(
            "INSERT INTO {table} AS r (endpoint, id, expires_at) "
            "VALUES (%(endpoint)s::text, %(id)s::text, %(expires_at)s::float8) "
            f"{on_conflict}RETURNING 1"
        )
        live = "(expires_at IS NULL OR expires_at > %(now)s::float8)"
        self._sql_find = render(
            "SELECT id FROM {table} "
            f"WHERE endpoint = %(endpoint)s::text AND id = ANY(%(ids)b::text[]) AND {live}"
        )
        self._sql_has = render(
            "SELECT 1 FROM {table} "
            f"WHERE endpoint = %(endpoint)s::text AND id = %(id)s::text AND {live}"
        )
        expired = "endpoint = %(endpoint)s::text AND expires_at <= %(now)s::float8"
        # The outer condition is re-checked on rows re-recorded meanwhile: never deleted.
        self._sql_purge = render(
            f"DELETE FROM {{table}} WHERE {expired} AND id IN ("
            f"SELECT id FROM {{table}} WHERE {expired} LIMIT %(limit)s)"
        )
        self._sql_columns = render("SELECT endpoint, id, expires_at FROM {table} WHERE false")

    def _new_pool(self) -> ConnectionPool[Connection]:
        minimum, maximum = self._pool_sizes
        pool: ConnectionPool[Connection] = ConnectionPool(
            self._conninfo,
            connection_class=_recording_connection_class(self._connect_failures),
            kwargs=self._connect_kwargs,
            min_size=minimum,
            max_size=maximum,
            open=False,
            configure=_configure,
            timeout=self._connect_timeout,
            # Stop background reconnection after half the wait: a later call then
            # connects on demand at once instead of waiting for a backed-off retry.
            reconnect_timeout=self._connect_timeout / 2,
            name=f"dedupstore:{self._table_text}",
        )
        pool.open(wait=False)
        return pool

    def _current_pool(self) -> ConnectionPool[Connection]:
        """The pool, replaced in a child process after ``fork()``."""
        if self._pool_pid != os.getpid() and self._owns_pool:
            with self._pool_lock:
                if self._pool_pid != os.getpid():
                    _inherited_pools.append(self._pool)
                    self._pool = self._new_pool()
                    self._pool_pid = os.getpid()
        return self._pool

    @contextlib.contextmanager
    def _connection(self) -> Iterator[Connection]:
        """A live pooled connection, committed (autocommit) and returned on exit.

        Connections the server has closed (after a restart) are discarded and the
        next one tried at once. When none comes within the pool's timeout, the
        ``PoolTimeout`` says why the last connection attempt failed, if known.
        """
        pool = self._current_pool()
        budget = pool.timeout
        began = time.monotonic()
        while True:
            try:
                conn = pool.getconn(timeout=budget - (time.monotonic() - began))
            except PoolTimeout as exc:
                message = f"couldn't get a connection within {budget:.2f} sec"
                failures = self._connect_failures
                if failures.at >= began - budget:
                    message += f"; the last connection attempt failed: {failures.message}"
                raise PoolTimeout(self._scrub(message)) from exc
            if not _server_closed(conn):
                break
            conn.close()  # the pool replaces it
            pool.putconn(conn)
        try:
            with conn:
                yield conn
        finally:
            pool.putconn(conn)

    # ------------------------------------------------------------------ statements

    def _write(self, query: bytes, params: Mapping[str, Any]) -> list[tuple[Any, ...]]:
        """Run a write once; retried only when the server reports it rolled back."""
        attempt = 1
        while True:
            try:
                with self._connection() as conn:
                    return conn.execute(query, params).fetchall()
            except _RETRYABLE_WRITE_ERRORS:
                if attempt >= _WRITE_ATTEMPTS:
                    raise
                attempt += 1

    def _read(self, query: bytes, params: Mapping[str, Any]) -> list[tuple[Any, ...]]:
        """Run a read; retried once on a connection that broke under it."""
        used: Connection | None = None
        try:
            with self._connection() as conn:
                used = conn
                return conn.execute(query, params).fetchall()
        except psycopg.OperationalError:
            if used is None or not used.broken:
                raise
        with self._connection() as conn:
            return conn.execute(query, params).fetchall()

    # ------------------------------------------------------------------ primitives

    def _add_new(self, ids: list[str], now: float, expires_at: float | None) -> set[str]:
        rows = self._write(
            self._sql_add_many,
            {"endpoint": self._endpoint, "ids": sorted(ids), "expires_at": expires_at, "now": now},
        )
        return {row[0] for row in rows}

    def _add_one(self, message_id: str, now: float, expires_at: float | None) -> bool:
        rows = self._write(
            self._sql_add_one,
            {"endpoint": self._endpoint, "id": message_id, "expires_at": expires_at, "now": now},
        )
        return bool(rows)

    def _find(self, ids: list[str], now: float) -> set[str]:
        rows = self._read(self._sql_find, {"endpoint": self._endpoint, "ids": ids, "now": now})
        return {row[0] for row in rows}

    def _contains_one(self, message_id: str, now: float) -> bool:
        rows = self._read(self._sql_has, {"endpoint": self._endpoint, "id": message_id, "now": now})
        return bool(rows)

    def _purge(self, now: float) -> int:
        params = {"endpoint": self._endpoint, "now": now, "limit": _PURGE_BATCH}
        total = 0
        while True:
            with self._connection() as conn:
                deleted = conn.execute(self._sql_purge, params).rowcount
            total += deleted
            if deleted < _PURGE_BATCH:
                return total

    def _health_warnings(self) -> list[str]:
        with self._connection() as conn:
            settings: Sequence[tuple[Any, ...]] = conn.execute(
                "SELECT name, reset_val FROM pg_settings "
                "WHERE name IN ('fsync', 'synchronous_commit', 'full_page_writes') "
                "UNION ALL SELECT 'session synchronous_commit', "
                "current_setting('synchronous_commit') "
                "UNION ALL SELECT 'relpersistence', relpersistence::text FROM pg_class "
                "WHERE oid = to_regclass(%s)",
                [self._table_text],
            ).fetchall()
        values = {str(name): str(value) for name, value in settings}
        warnings: list[str] = []
        if values.get("fsync") == "off":
            warnings.append(
                "fsync is off on the PostgreSQL server: an OS crash or power loss can lose "
                "or corrupt recorded ids"
            )
        if values.get("full_page_writes") == "off":
            warnings.append(
                "full_page_writes is off on the PostgreSQL server: a crash can corrupt the "
                "deduplication table"
            )
        if values.get("synchronous_commit") == "off":
            warnings.append(
                "synchronous_commit is off on the PostgreSQL server: a crash loses recent "
                "commits of other clients (this store turns it on for its own sessions)"
            )
        if values.get("session synchronous_commit") == "off":
            warnings.append(
                "synchronous_commit is off in this store's sessions: a crash can lose ids "
                "that add() acknowledged"
            )
        if values.get("relpersistence") == "u":
            warnings.append(
                f"table {self._table_text} is UNLOGGED: PostgreSQL empties it after a crash"
            )
        return warnings

    def _close(self) -> None:
        if self._owns_pool and self._pool_pid == os.getpid():
            self._pool.close(timeout=5.0)
