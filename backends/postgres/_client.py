"""The connection the PostgreSQL stores share: :class:`PostgresConnection`.

Options: :func:`postgres_options`. The URL is a libpq connection URI: undeclared query
parameters that are libpq keywords (``sslmode``, ...) go to libpq unchanged, and libpq's
environment variables apply. One ``psycopg_pool`` pool per server, options and process, in
autocommit, with ``synchronous_commit`` pinned on and ``statement_timeout`` set to ``timeout``.

Every statement is bounded: the server cancels it after ``timeout``, TCP keepalives and
``tcp_user_timeout`` detect a partition, and a watchdog closes the connection of a statement
with no answer shortly after ``timeout`` (a frozen server still accepts TCP). A pooled
connection the server closed is discarded before use without a round trip; one that died
silently fails when used, so a read, or a write marked ``resend`` (answering alike when applied
twice: the deduplication store's inserts, by their write token; the token store's creates and
deletes), is re-sent on another connection until the deadline, and any other write (an entity
save) is sent once, on a connection that just answered an empty query (a failure after sending
it is raised). Writes the server rolled back (deadlock, serialization failure) are retried, 3
attempts in all; a statement the watchdog timed out is never re-sent.

Deadline: ``connect_timeout + timeout + min(1 s, timeout / 2)`` per call (16 s by default; a
given pool's timeout stands for ``connect_timeout``). Errors: ``StoreUnavailable`` (retry:
server down, timeout, failover to a replica) or ``ConfigurationError`` (fix the setup: a missing
table or database, refused credentials or privileges, a table of another shape).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import math
import os
import re
import select
import socket
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar, Self

import psycopg
import psycopg.conninfo
import psycopg.errors
from psycopg import sql
from psycopg.rows import TupleRow
from psycopg_pool import ConnectionPool, PoolTimeout

from dedupstore.backend import (
    Client,
    ConfigurationError,
    Connection,
    ErrorKind,
    Option,
    Options,
    OptionSet,
    ProcessLocal,
    StoreUnavailable,
    StoreURL,
    check_client,
    client_option,
    connect_timeout_option,
    create_option,
    format_error,
    integer,
    part_of,
    retry,
    scrub,
    text,
    time_left,
    timeout_option,
)

if TYPE_CHECKING:
    PgConnection = psycopg.Connection[TupleRow]

__all__ = [
    "PostgresConnection",
    "StatementTimeout",
    "Table",
    "create_schema",
    "index_name",
    "postgres_options",
]

_IDENTIFIER_MAX_BYTES = 63  # NAMEDATALEN - 1: PostgreSQL truncates longer names
WRITE_ATTEMPTS = 3  # deadlock / serialization failure: rolled back, safe to retry
_MAX_MS = 2**31 - 1  # libpq's and the server's limit for millisecond settings

#: libpq keywords: undeclared URL query keys (and keywords) that pass through.
_LIBPQ_KEYWORDS = frozenset(o.keyword.decode() for o in psycopg.pq.Conninfo.get_defaults())
# Its secret ones (``sslpassword``, ``oauth_client_secret``, ...) are in masking.SECRET_NAMES.

# Connection failures (libpq gives them no SQLSTATE) that a retry will not fix: credentials, unknown
# role or database, pg_hba.conf, a value libpq refuses.
_REFUSED = re.compile(
    r"authentication failed|no password supplied|password is required|pg_hba\.conf"
    r"|does not exist|permission denied|not permitted to log in|invalid \S+ value"
    r"|invalid integer value|invalid connection option|invalid URI|SSL was required"
)


class StatementTimeout(psycopg.OperationalError):
    """A statement got no answer in time; the store closed its connection."""


#: A new connection's settings (:meth:`PostgresConnection.configure`), params
#: :func:`configure_params`.
CONFIGURE = (
    "SELECT set_config('synchronous_commit', CASE current_setting('synchronous_commit') "
    "WHEN 'off' THEN 'on' ELSE current_setting('synchronous_commit') END, false), "
    "set_config('statement_timeout', %s, false)"
)


def configure_params(timeout: float) -> list[str]:
    """The parameters of :data:`CONFIGURE`: the statement timeout, in ms."""
    return [str(min(_MAX_MS, math.ceil(timeout * 1000)))]


# --------------------------------------------------------------------------- names and options


def _split_table(table: str) -> tuple[str, ...]:
    """``'name'`` or ``'schema.name'`` -> identifier parts; ``ValueError`` if bad."""
    parts = tuple(table.split("."))
    if len(parts) > 2 or not all(parts):
        raise ValueError(f"expected 'name' or 'schema.name', got {table!r:.80}")
    for part in parts:
        if "\x00" in part or len(part.encode("utf-8", "surrogatepass")) > _IDENTIFIER_MAX_BYTES:
            raise ValueError(
                f"each part must be at most {_IDENTIFIER_MAX_BYTES} bytes without NUL "
                f"characters, got {part[:70]!r}"
            )
    return parts


def _table_name(value: object) -> str:
    name: str = text(what="a table name")(value)
    _split_table(name)
    return name


def index_name(table_name: str, suffix: str) -> str:
    """``<table>_<suffix>``, shortened with a digest when longer than PostgreSQL allows."""
    name = f"{table_name}_{suffix}"
    if len(name.encode("utf-8")) <= _IDENTIFIER_MAX_BYTES:
        return name
    digest = hashlib.sha256(table_name.encode("utf-8")).hexdigest()[:10]
    return f"{table_name.encode('utf-8')[:40].decode('utf-8', 'ignore')}_{digest}_{suffix}"


def postgres_options(base: OptionSet, table: str) -> OptionSet:
    """``base`` plus the options of a PostgreSQL store, with its ``table`` default."""
    return base.extend(
        Option("table", _table_name, table, "'name' or 'schema.name' of the table"),
        create_option(False, "create the table (and its schema) when missing"),
        timeout_option(10.0, "seconds one statement may take before StoreUnavailable"),
        connect_timeout_option(5.0),
        Option("pool_min_size", integer(0, 1000), 1, "connections kept open"),
        Option("pool_max_size", integer(1, 1000), 10, "connections at most"),
        Option(
            "password",
            text(r"[^\x00]+", "a non-empty password"),
            None,
            "the password (instead of the URL's)",
            secret=True,
        ),
        client_option("a ready psycopg_pool.ConnectionPool to use (not closed by the store)"),
        driver_params=lambda key: key in _LIBPQ_KEYWORDS,
    )


# --------------------------------------------------------------------------- watchdog


class _Watchdog:
    """One thread per process firing the alarms of statements past their deadline. Firing and
    disarming hold one lock: after :meth:`disarm` an alarm has fired completely or never will."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._armed: dict[int, tuple[float, Callable[[], None]]] = {}
        self._keys = itertools.count()
        self._wake = math.inf  # when the thread wakes next
        self._thread: threading.Thread | None = None

    def arm(self, delay: float, fire: Callable[[], None]) -> int:
        key, deadline = next(self._keys), time.monotonic() + delay
        with self._cond:
            self._armed[key] = (deadline, fire)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="dedupstore-pg", daemon=True)
                self._thread.start()
            if deadline < self._wake:
                self._cond.notify()
        return key

    def disarm(self, key: int) -> bool:
        """Cancel an alarm (once); return whether it had fired."""
        with self._cond:
            return self._armed.pop(key, None) is None

    def _run(self) -> None:
        with self._cond:
            while True:
                now = time.monotonic()
                for key, (deadline, fire) in list(self._armed.items()):
                    if deadline <= now:
                        del self._armed[key]
                        with contextlib.suppress(Exception):
                            fire()
                self._wake = min((d for d, _ in self._armed.values()), default=math.inf)
                self._cond.wait(None if self._wake == math.inf else self._wake - now)


_WATCHDOG: ProcessLocal[_Watchdog] = ProcessLocal(_Watchdog)


def _shut_down(conn: psycopg.BaseConnection[Any]) -> None:
    """Shut the connection's socket down: a call blocked on it fails at once."""
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
        sock.shutdown(socket.SHUT_RDWR)


# --------------------------------------------------------------------------- connections


class _OwnPool(ConnectionPool["PgConnection"]):
    """A pool dedupstore made (and closes), filled from its first use on (a refused open costs
    one login attempt), noting its last failed connection attempt: ``(monotonic time, error)``."""

    def __init__(self, conninfo: str, **kwargs: Any) -> None:
        self.last_failure: tuple[float, psycopg.Error] | None = None
        self._started = False
        pool = self

        class RecordingConnection(psycopg.Connection[TupleRow]):
            @classmethod
            def connect(cls, conninfo: str = "", **kwargs: Any) -> Self:
                try:
                    return super().connect(conninfo, **kwargs)
                except psycopg.Error as exc:
                    pool.last_failure = (time.monotonic(), exc)
                    raise

        RecordingConnection.__qualname__ = RecordingConnection.__name__
        super().__init__(conninfo, connection_class=RecordingConnection, open=False, **kwargs)

    def start(self) -> None:
        """Start filling the pool in the background (the first call only)."""
        if not self._started:
            self._started = True
            self.open(wait=False)

    def getconn(self, timeout: float | None = None) -> PgConnection:
        self.start()
        return super().getconn(timeout)

    def reconnect_failed(self) -> None:
        """psycopg_pool gave up retrying a connection (after ``reconnect_timeout``): if calls
        wait for one, start another attempt at once. They began waiting while the failed one
        was under way, so none of them started one: they would wait with no attempt under way
        until their timeout, even once the server answers again."""
        with self._lock:
            if self._waiting:
                self._maybe_grow_pool()
        super().reconnect_failed()


def pool_timeout(
    client: Client, pool: Any, began: float, until: float, exc: PoolTimeout
) -> PoolTimeout:
    """The ``PoolTimeout`` of a wait for a connection from ``began`` to ``until``: how long, and
    why the last connection attempt failed when the pool is ours and one failed meanwhile (then
    its ``__cause__``)."""
    waited = max(0.0, until - began)
    message = f"timed out after {waited:.3g} s waiting for a connection"
    error = PoolTimeout()
    error.__cause__ = exc
    failure = getattr(pool, "last_failure", None)
    if failure is not None and failure[0] >= began - pool.timeout:
        error.__cause__ = failure[1]
        message += f"; the last connection attempt failed: {failure[1]}"
    error.args = (client.scrub(message),)
    error.__suppress_context__ = True
    return error


def wait_until(pool: Any) -> tuple[float, float]:
    """(now, when a wait for a connection of ``pool`` ends): its timeout, capped by the call's
    deadline."""
    began = time.monotonic()
    left = time_left()
    return began, began + (pool.timeout if left is None else min(pool.timeout, left))


def alarm_delay(watchdog_delay: float) -> float:
    """When a statement's alarm closes its connection: ``watchdog_delay``, or the time left of
    the call's deadline if sooner."""
    left = time_left()
    return watchdog_delay if left is None else max(0.0, min(watchdog_delay, left))


def timed_out(delay: float, timeout: float) -> StatementTimeout:
    """The error of a statement whose alarm fired after ``delay`` seconds."""
    return StatementTimeout(
        f"timed out after {delay:.3g} s (timeout={timeout:g}): "
        "PostgreSQL did not answer; the connection was closed"
    )


def rolled_back(exc: BaseException) -> bool:
    """A write the server rolled back (deadlock, serialization failure): run it again."""
    return isinstance(exc, psycopg.errors.DeadlockDetected | psycopg.errors.SerializationFailure)


def server_closed(conn: psycopg.BaseConnection[Any]) -> bool:
    """Whether the server ended this idle connection; checked without a round trip. An idle
    connection has nothing to read: readable means the server closed the session (restart, crash,
    idle timeout) or sent something unexpected."""
    if conn.closed or conn.broken:
        return True
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLIN | select.POLLPRI)
    return bool(poller.poll(0))


#: (setting, value that puts acknowledged writes at risk) -> warning.
_RISKY_SETTINGS = {
    ("fsync", "off"): (
        "fsync is off on the PostgreSQL server: an OS crash or power loss can lose or "
        "corrupt {kind}'s rows"
    ),
    ("full_page_writes", "off"): (
        "full_page_writes is off on the PostgreSQL server: a crash can corrupt {kind}"
    ),
    ("synchronous_commit", "off"): (
        "synchronous_commit is off on the PostgreSQL server: a crash loses recent commits "
        "of other clients (this store turns it on for its own sessions)"
    ),
    ("session synchronous_commit", "off"): (
        "synchronous_commit is off in this store's sessions: a crash can lose writes it "
        "acknowledged"
    ),
    ("relpersistence", "u"): "table {table} is UNLOGGED: PostgreSQL empties it after a crash",
}


class Table:
    """A store's table (its ``table`` option): identifiers, and how messages name it."""

    def __init__(self, name: str, kind: str, privileges: str) -> None:
        #: ``('name',)`` or ``('schema', 'name')``.
        self.parts = _split_table(name)
        self.identifier = sql.Identifier(*self.parts)
        #: The quoted name, as in SQL and in messages.
        self.text: str = self.identifier.as_string(None)
        #: What the table holds ("a deduplication table") and the privileges it needs.
        self.kind, self.privileges = kind, privileges

    def render(self, text: str, index: str = "") -> bytes:
        """``text`` with ``{table}``, and ``{index}`` (the table's index named by ``index``), filled
        in, as bytes ready to send."""
        index_id = sql.Identifier(index_name(self.parts[-1], index))
        return sql.SQL(text).format(table=self.identifier, index=index_id).as_bytes(None)


def watchdog_delay(options: Options) -> float:
    """When the watchdog closes a silent statement's connection: shortly after the server's own
    cancel at ``timeout``."""
    timeout: float = options["timeout"]
    return timeout + min(1.0, timeout / 2)


def conninfo(url: StoreURL, options: Options) -> str:
    """The URL without its query, plus the libpq parameters, validated by libpq."""
    timeout, connect_timeout = options["timeout"], options["connect_timeout"]
    params: dict[str, Any] = {
        "keepalives": 1,
        "keepalives_idle": max(1, math.ceil(timeout)),
        "keepalives_interval": max(1, math.ceil(timeout / 3)),
        "keepalives_count": 3,
        "tcp_user_timeout": min(_MAX_MS, math.ceil(timeout * 1000)),
        "fallback_application_name": "dedupstore",
        **options.driver_params,
        "client_encoding": "UTF8",
        "connect_timeout": max(2, math.ceil(connect_timeout)),
    }
    if options["password"] is not None:
        params["password"] = options["password"]
    try:
        return psycopg.conninfo.make_conninfo(url.with_query([]).text, **params)
    except psycopg.Error as exc:
        detail = scrub(format_error(exc), {*url.secrets, options["password"]})
        raise ConfigurationError(f"bad PostgreSQL URL {url.masked}: {detail}") from None


# Given pools and the process that was given each: a child after fork makes its own.
_given_in: weakref.WeakKeyDictionary[ConnectionPool[Any], int] = weakref.WeakKeyDictionary()


class PostgresConnection(Connection):
    """The psycopg pool of one PostgreSQL server, shared by its stores (``self._pg``): statements
    go through :meth:`read` and :meth:`write`; a store's :class:`Table` is its public ``table``."""

    schemes: ClassVar[tuple[str, ...]] = ("postgresql", "postgres")
    needs_host: ClassVar[bool] = True
    shaped_by: ClassVar[tuple[str, ...]] = (
        "timeout",
        "connect_timeout",
        "pool_min_size",
        "pool_max_size",
    )

    def __init__(self, url: StoreURL, options: Options) -> None:
        """The given ``client`` pool in the process it was given in, else a pool of our own (opened
        in the background)."""
        super().__init__(url, options)
        self.timeout: float = options["timeout"]
        self.watchdog_delay = watchdog_delay(options)
        self.conninfo = conninfo(url, options)
        given: ConnectionPool[PgConnection] | None = options["client"]
        if given is not None and _given_in.setdefault(given, os.getpid()) == os.getpid():
            self.pool = given
        else:
            self.pool = self._make_pool()

    @classmethod
    def async_twin(cls, url: StoreURL, options: Options) -> Any:
        """An :class:`~._aio.AsyncPostgresConnection` (psycopg's ``AsyncConnectionPool``) of
        the same server."""
        from ._aio import AsyncPostgresConnection

        return AsyncPostgresConnection(url, options)

    @classmethod
    def address(cls, url: StoreURL, options: Options) -> Hashable:
        """libpq's connection string: the server, database, credentials and parameters."""
        return conninfo(url, options)

    @classmethod
    def validate(cls, url: StoreURL, options: Options) -> None:
        """The pool sizes agree; libpq takes the URL; ``client`` is a ``ConnectionPool``."""
        minimum, maximum = options["pool_min_size"], options["pool_max_size"]
        if minimum > maximum:
            raise ConfigurationError(
                f"pool_min_size ({minimum}) must not exceed pool_max_size ({maximum})"
            )
        check_client(options, ConnectionPool, "a psycopg_pool.ConnectionPool")
        conninfo(url, options)

    @classmethod
    def deadline_seconds(cls, options: Options) -> float:
        """``connect_timeout`` (a given pool's timeout) ``+ timeout + min(1 s, timeout / 2)``."""
        given = options["client"]
        wait = given.timeout if isinstance(given, ConnectionPool) else options["connect_timeout"]
        return float(wait + watchdog_delay(options))

    def _make_pool(self) -> ConnectionPool[PgConnection]:
        connect_timeout: float = self.options["connect_timeout"]
        return _OwnPool(
            self.conninfo,
            kwargs={"autocommit": True},
            min_size=self.options["pool_min_size"],
            max_size=self.options["pool_max_size"],
            configure=self.configure,
            timeout=connect_timeout,
            # Stop background reconnection after half the wait: a later call then connects on demand
            # at once instead of waiting for a backed-off retry.
            reconnect_timeout=connect_timeout / 2,
            name="dedupstore",
        )

    def close(self) -> None:
        """Close our own pool (never a given one)."""
        if isinstance(self.pool, _OwnPool):
            self.pool.close(timeout=5.0)

    def configure(self, conn: PgConnection) -> None:
        """New connection: pin ``synchronous_commit`` (``on`` if the server's is ``off``; a later
        configuration reload cannot turn it off under the pool) and the statement timeout."""
        self.execute(conn, CONFIGURE, configure_params(self.timeout))

    # ------------------------------------------------------------------ tables

    def open_table(
        self, client: Client, create: list[bytes], check: Callable[[PgConnection], None]
    ) -> None:
        """Check the encoding and ``client``'s table (``create`` it if missing and allowed, then
        ``check`` it), on a connection of its own when the pool is ours (so refused credentials
        are the error, not a pool timeout)."""
        table = part_of(client, "table", Table)
        with contextlib.ExitStack() as stack:
            if isinstance(self.pool, _OwnPool):
                conn = stack.enter_context(psycopg.connect(self.conninfo, autocommit=True))
                self.configure(conn)
            else:
                conn = stack.enter_context(self.pooled(client))
            row = self.execute(conn, "SELECT current_setting('server_encoding')")[0]
            if row[0] != "UTF8" or conn.info.encoding != "utf-8":
                raise client.make_error(
                    ConfigurationError,
                    None,
                    f"the database encoding is {row[0]} and the client encoding "
                    f"{conn.info.encoding}; dedupstore needs UTF8 for both so every id "
                    "round-trips",
                )
            if not self.execute(conn, "SELECT to_regclass(%s) IS NOT NULL", [table.text])[0][0]:
                if not client.creates:
                    raise client.no_such_store(
                        f"table {table.text} does not exist in PostgreSQL at {client.url}",
                        f"call {type(client).__name__}.create_schema(url) once, or open the "
                        "store with create=true",
                    )
                self._create_table(conn, table, create)
            check(conn)
        if isinstance(self.pool, _OwnPool):
            self.pool.start()  # usable: fill it while the caller goes on

    def check_columns(self, client: Client, conn: PgConnection, columns: tuple[str, ...]) -> None:
        """Refuse ``client``'s table if it lacks one of ``columns`` (naming what is missing)."""
        table = part_of(client, "table", Table)
        found = self.execute(
            conn,
            "SELECT array_agg(attname::text) FROM pg_attribute WHERE attrelid = "
            "to_regclass(%s) AND attnum > 0 AND NOT attisdropped",
            [table.text],
        )
        missing = [c for c in columns if c not in (found[0][0] or [])]
        if missing:
            raise client.make_error(
                ConfigurationError,
                None,
                f"table {table.text} is not usable as {table.kind}: it has no "
                f"column {', '.join(missing)} (needed: {', '.join(columns)}); drop it or "
                "name another table, then open with create=true",
            )

    def _create_table(self, conn: PgConnection, table: Table, create: list[bytes]) -> None:
        """The schema (if named) and ``create``, one process at a time (an advisory lock)."""
        with conn.transaction():
            lock = "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))"
            self.execute(conn, lock, [f"dedupstore:{table.text}"])
            schema = table.parts[0] if len(table.parts) == 2 else None
            # CREATE SCHEMA needs the database's CREATE privilege even when it exists
            exists = "SELECT 1 FROM pg_namespace WHERE nspname = %s"
            if schema is not None and not self.execute(conn, exists, [schema]):
                statement = sql.SQL("CREATE SCHEMA IF NOT EXISTS {}")
                self.execute(conn, statement.format(sql.Identifier(schema)))
            for ddl in create:
                self.execute(conn, ddl)

    # ------------------------------------------------------------------ statements

    @contextlib.contextmanager
    def pooled(self, client: Client, *, verify: bool = True) -> Iterator[PgConnection]:
        """A live pooled connection (autocommit), returned to the pool on exit: one the server
        closed is discarded; with ``verify`` it must also answer an empty query (bounded like a
        statement: :class:`StatementTimeout`). Waits at most the pool's timeout, capped by the
        call's deadline; the ``PoolTimeout`` then says why the last connection attempt failed."""
        pool = self.pool
        began, until = wait_until(pool)
        while True:
            try:
                conn = pool.getconn(timeout=until - time.monotonic())
            except PoolTimeout as exc:
                raise pool_timeout(client, pool, began, until, exc)  # noqa: B904 (its cause set)
            if not conn.autocommit:
                pool.putconn(conn)
                raise client.make_error(
                    ConfigurationError,
                    None,
                    "the connections of the given client pool must be in autocommit mode "
                    "(ConnectionPool(kwargs={'autocommit': True}))",
                )
            try:
                alive = not server_closed(conn) and (not verify or self._answers(conn))
            except BaseException:  # the check timed out (the connection is closed), ...
                pool.putconn(conn)
                raise
            if alive:
                break
            conn.close()  # the pool replaces it
            pool.putconn(conn)
        try:
            yield conn
        finally:
            pool.putconn(conn)

    def _answers(self, conn: PgConnection) -> bool:
        """Whether ``conn`` answers an empty query; ``StatementTimeout`` if nothing comes."""
        try:
            with self._bounded(conn):
                ConnectionPool.check_connection(conn)
        except StatementTimeout:
            raise
        except psycopg.Error:
            return False
        return True

    def execute(self, conn: PgConnection, query: Any, params: Any = None) -> list[tuple[Any, ...]]:
        """Run one statement and fetch its rows, bounded by the watchdog."""
        with self._bounded(conn):
            cursor = conn.execute(query, params)
            return cursor.fetchall() if cursor.description is not None else []

    @contextlib.contextmanager
    def _bounded(self, conn: PgConnection) -> Iterator[None]:
        """Close ``conn`` if the round trip in the block gets no answer shortly after ``timeout``
        (or by the call's deadline); a psycopg error after that is raised as
        :class:`StatementTimeout`."""
        delay = alarm_delay(self.watchdog_delay)
        watchdog = _WATCHDOG.get()
        alarm = watchdog.arm(delay, lambda: _shut_down(conn))
        fired = False
        try:
            try:
                yield
            finally:
                fired = watchdog.disarm(alarm)
                if fired:  # the socket is shut down, even if the answer came
                    conn.close()
        except psycopg.Error as exc:
            if fired:
                raise timed_out(delay, self.timeout) from exc
            raise

    def run(
        self, client: Client, query: Any, params: Any, *, resend: bool
    ) -> list[tuple[Any, ...]]:
        """Run one statement on a pooled connection, within the call's deadline: with ``resend``
        re-sent on another connection when one breaks under it (never after a watchdog timeout),
        else sent once, on a freshly checked connection."""
        broke = False

        def attempt() -> list[tuple[Any, ...]]:
            nonlocal broke
            broke = False  # a connection that never came (PoolTimeout) broke nothing
            with self.pooled(client, verify=not resend) as conn:
                try:
                    return self.execute(conn, query, params)
                except psycopg.OperationalError:
                    # (psycopg may see the socket hang up before libpq marks the connection broken)
                    broke = server_closed(conn)
                    raise

        def resendable(exc: BaseException) -> bool:
            return resend and broke and not isinstance(exc, StatementTimeout)

        return retry(attempt, attempts=None, retry_on=resendable)

    def read(self, client: Client, query: bytes, params: Any) -> list[tuple[Any, ...]]:
        """Run a read; re-sent on another connection when one breaks under it."""
        return self.run(client, query, params, resend=True)

    def write(
        self, client: Client, query: bytes, params: Any, *, resend: bool = False
    ) -> list[tuple[Any, ...]]:
        """Run a write (``resend`` only for one whose second application answers like the first);
        retried within the call's deadline when the server rolled it back."""
        return retry(
            lambda: self.run(client, query, params, resend=resend),
            attempts=WRITE_ATTEMPTS,
            retry_on=rolled_back,
        )

    # ------------------------------------------------------------------ checks and errors

    def health_warnings(self, client: Client) -> list[str]:
        """The server settings and the table's persistence that put acknowledged writes at risk."""
        table = part_of(client, "table", Table)
        with self.pooled(client) as conn:
            settings = self.execute(
                conn,
                "SELECT name, reset_val FROM pg_settings "
                "WHERE name IN ('fsync', 'synchronous_commit', 'full_page_writes') "
                "UNION ALL SELECT 'session synchronous_commit', "
                "current_setting('synchronous_commit') "
                "UNION ALL SELECT 'relpersistence', relpersistence::text FROM pg_class "
                "WHERE oid = to_regclass(%s)",
                [table.text],
            )
        values = {str(setting): str(value) for setting, value in settings}
        return [
            message.format(table=table.text, kind=table.kind)
            for (setting, bad), message in _RISKY_SETTINGS.items()
            if values.get(setting) == bad
        ]

    @classmethod
    def classify_error(cls, client: Client, exc: BaseException) -> ErrorKind:
        """psycopg errors: what to fix (``ConfigurationError``) or retry (``StoreUnavailable``).
        Errors about the table name the client's :class:`Table` and how to fix it."""
        errors = psycopg.errors
        table = part_of(client, "table", Table)

        def fix(detail: str) -> ConfigurationError:
            return client.make_error(ConfigurationError, None, detail)

        if isinstance(exc, StatementTimeout | errors.ReadOnlySqlTransaction):
            return StoreUnavailable  # ReadOnlySqlTransaction: failed over to a replica
        if isinstance(exc, PoolTimeout):
            cause = exc.__cause__
            if isinstance(cause, psycopg.OperationalError) and _refused(cause):
                return fix(f"connecting failed: {client.describe_error(exc)}")
            return StoreUnavailable
        if isinstance(exc, errors.UndefinedTable):
            return fix(
                f"table {table.text} does not exist ({client.describe_error(exc)}): "
                f"create it with {type(client).__name__}.create_schema(url), or open the "
                "store with create=true"
            )
        if isinstance(exc, errors.InsufficientPrivilege):
            return fix(
                f"permission denied ({client.describe_error(exc)}): GRANT "
                f"{table.privileges} ON {table.text} TO the role the store connects as"
            )
        if isinstance(
            exc,
            errors.InvalidPassword
            | errors.InvalidAuthorizationSpecification
            | errors.InvalidCatalogName,
        ):
            return ConfigurationError
        if isinstance(exc, psycopg.OperationalError):
            # lost or refused connections, QueryCanceled (statement_timeout), AdminShutdown,
            # CannotConnectNow, deadlocks after retries, ...
            return ConfigurationError if _refused(exc) else StoreUnavailable
        if isinstance(
            exc,
            psycopg.ProgrammingError
            | psycopg.DataError
            | psycopg.IntegrityError
            | psycopg.NotSupportedError,
        ):
            return fix(
                f"table {table.text} is not usable as {table.kind}: {client.describe_error(exc)}"
            )
        if isinstance(exc, psycopg.Error):
            return StoreUnavailable
        return None


def _refused(exc: psycopg.Error) -> bool:
    """A connection attempt refused for a reason a retry will not fix."""
    return exc.sqlstate is None and _REFUSED.search(str(exc)) is not None


def create_schema(cls: type[Client], /, url: str | StoreURL, **options: Any) -> None:
    """Create the table and its index if missing (idempotent).

    Takes the same URL and options as the constructor and opens the store with ``create=true``;
    needs the CREATE privilege. Safe to run concurrently. Raises like the constructor.
    """
    parsed = StoreURL.parse(url)
    parsed = parsed.with_query([(k, v) for k, v in parsed.query if k != "create"])
    cls(parsed, **{**options, "create": True}).close()
