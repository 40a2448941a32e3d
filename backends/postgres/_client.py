"""The connection layer both PostgreSQL stores share: :class:`PostgresClient`.

Options (URL query or keyword) of both stores, besides their own ``table``:

===================  ===============  ====================================================
option               default          meaning
===================  ===============  ====================================================
``create``           ``false``        create the table (and schema) when missing
``timeout``          ``10`` s         how long one statement may take
``connect_timeout``  ``5`` s          opening a connection, and waiting for a pooled one
``pool_min_size``    ``1``            connections kept open
``pool_max_size``    ``10``           connections at most
``password``         none             the password, instead of the URL's (secret)
``client``           none             a ready ``psycopg_pool.ConnectionPool`` (keyword
                                      only; not closed by the store)
===================  ===============  ====================================================

The URL is a libpq connection URI: every query parameter that is not a declared
option and is a libpq keyword (``sslmode``, ``application_name``, ``options``, ...)
goes to libpq unchanged, and libpq's environment variables (``PGPASSWORD``, ...)
apply. Connections are pooled (``psycopg_pool``), one pool per process (a child
after ``fork()`` opens its own), in autocommit, with ``synchronous_commit`` pinned
on and ``statement_timeout`` set to ``timeout``.

Every statement is bounded: the server cancels it after ``timeout``, TCP
keepalives and ``tcp_user_timeout`` detect a network partition, and a
client-side watchdog closes the connection of a statement that got no answer
shortly after ``timeout`` (a frozen server still accepts TCP).

Connections that died while pooled (a server restart, a reset, an outage) must
not fail the first call after the server is back. A pooled connection the server
closed is readable: it is discarded before use, without a round trip. One that
died silently (its peer forgot it: the server's host rebooted, a NAT or proxy
dropped it) only fails when used, so each call has one deadline (the pool's
timeout plus the statement's bound, the worst case of one attempt) and:

* a read, or a write the store marks ``resend`` (one whose second application
  answers like the first: the deduplication store's inserts, by their write
  token), is re-sent on another connection whenever a connection breaks under
  it, until the deadline;
* any other write (an entity save) is sent once, on a connection that has just
  answered an empty query (``ConnectionPool.check_connection``); a failure after
  it was sent is raised, as its outcome is unknown.

Writes are also retried when the server says it rolled them back (deadlock,
serialization failure); a statement the watchdog timed out is never re-sent.
Re-sends and retries go through :func:`dedupstore.calls.retry`, within the deadline.

Deadline: a call (one chunk of a batch) raises ``StoreUnavailable`` at most
``connect_timeout + timeout + min(1 s, timeout / 2)`` seconds after it started
(16 s with the defaults; with a given ``client`` pool, its own timeout stands for
``connect_timeout``): waiting for a pooled connection, checking it and the
statement's answer are each capped by the time left.
Errors are classified once, here: ``StoreUnavailable`` (retry) or
``ConfigurationError`` (fix the setup).
"""

from __future__ import annotations

import abc
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
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Self

import psycopg
import psycopg.conninfo
import psycopg.errors
from psycopg import sql
from psycopg.rows import TupleRow
from psycopg_pool import ConnectionPool, PoolTimeout

from dedupstore.calls import retry, time_left
from dedupstore.client import Client, ErrorKind, ProcessLocal
from dedupstore.errors import ConfigurationError, StoreUnavailable
from dedupstore.options import (
    Option,
    Options,
    OptionSet,
    client_option,
    connect_timeout_option,
    create_option,
    integer,
    text,
    timeout_option,
)
from dedupstore.urls import StoreURL

if TYPE_CHECKING:
    Connection = psycopg.Connection[TupleRow]

__all__ = ["PostgresClient", "StatementTimeout", "index_name", "postgres_options"]

_IDENTIFIER_MAX_BYTES = 63  # NAMEDATALEN - 1: PostgreSQL truncates longer names
_WRITE_ATTEMPTS = 3  # deadlock / serialization failure: rolled back, safe to retry
_MAX_MS = 2**31 - 1  # libpq's and the server's limit for millisecond settings

#: libpq keywords: undeclared URL query keys (and keywords) that pass through.
_LIBPQ_KEYWORDS = frozenset(o.keyword.decode() for o in psycopg.pq.Conninfo.get_defaults())
# Its secret ones (``sslpassword``, ``oauth_client_secret``, ...) are in masking.SECRET_NAMES.

# Connection failures (libpq gives them no SQLSTATE) that a retry will not fix:
# credentials, unknown role or database, pg_hba.conf, a value libpq refuses.
_REFUSED = re.compile(
    r"authentication failed|no password supplied|password is required|pg_hba\.conf"
    r"|does not exist|permission denied|not permitted to log in|invalid \S+ value"
    r"|invalid integer value|invalid connection option|invalid URI|SSL was required"
)

# Contention errors raised by the server for a statement that was rolled back.
_RETRYABLE_WRITE_ERRORS: tuple[type[psycopg.Error], ...] = (
    psycopg.errors.DeadlockDetected,
    psycopg.errors.SerializationFailure,
)


class StatementTimeout(psycopg.OperationalError):
    """A statement got no answer in time; the store closed its connection."""


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
    """One thread per process that fires the alarms of statements past their deadline.

    Firing and disarming hold one lock: after :meth:`disarm` an alarm has either
    fired completely or never will. Few alarms are armed at once (one per
    statement in flight), so the thread scans them all when it wakes.
    """

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


def _call_deadline() -> float | None:
    """The current call's deadline as a ``time.monotonic()`` instant, if it has one."""
    left = time_left()
    return None if left is None else time.monotonic() + left


def _shut_down(conn: Connection) -> None:
    """Shut the connection's socket down: a call blocked on it fails at once."""
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
        sock.shutdown(socket.SHUT_RDWR)


# --------------------------------------------------------------------------- connections


class _ConnectFailures:
    """The last failed connection attempt of a pool, to explain its timeouts."""

    def __init__(self) -> None:
        self.at = -math.inf
        self.error: psycopg.Error | None = None


class _OwnPool(ConnectionPool["Connection"]):
    """A pool dedupstore made (closed by it): notes its failed connection attempts."""

    def __init__(self, conninfo: str, failures: _ConnectFailures, **kwargs: Any) -> None:
        super().__init__(conninfo, connection_class=_recording_connection_class(failures), **kwargs)
        self.failures = failures


def _recording_connection_class(failures: _ConnectFailures) -> type[Connection]:
    """A connection class that notes each failed connection attempt in ``failures``."""

    class RecordingConnection(psycopg.Connection[TupleRow]):
        @classmethod
        def connect(cls, conninfo: str = "", **kwargs: Any) -> Self:
            try:
                return super().connect(conninfo, **kwargs)
            except psycopg.Error as exc:
                failures.at, failures.error = time.monotonic(), exc
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
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLIN | select.POLLPRI)
    return bool(poller.poll(0))


#: (setting, value that puts acknowledged writes at risk, warning).
_RISKY_SETTINGS = (
    (
        "fsync",
        "off",
        "fsync is off on the PostgreSQL server: an OS crash or power loss can lose or "
        "corrupt {kind}'s rows",
    ),
    (
        "full_page_writes",
        "off",
        "full_page_writes is off on the PostgreSQL server: a crash can corrupt {kind}",
    ),
    (
        "synchronous_commit",
        "off",
        "synchronous_commit is off on the PostgreSQL server: a crash loses recent commits "
        "of other clients (this store turns it on for its own sessions)",
    ),
    (
        "session synchronous_commit",
        "off",
        "synchronous_commit is off in this store's sessions: a crash can lose writes it "
        "acknowledged",
    ),
    ("relpersistence", "u", "table {table} is UNLOGGED: PostgreSQL empties it after a crash"),
)


class PostgresClient(Client):
    """A PostgreSQL table through a psycopg connection pool: what both stores share.

    Resolves the connection options, opens the pool (one per process), checks the
    database and the table (creating it with ``create``), bounds every statement,
    and classifies psycopg errors. A store class names its table's kind and
    privileges, builds its statements in :meth:`_build_statements`, creates its
    table in :meth:`_create_objects` and checks it in :meth:`_check_table`.
    """

    schemes: ClassVar[tuple[str, ...]] = ("postgresql", "postgres")
    connection_options: ClassVar[tuple[str, ...]] = (
        "timeout",
        "connect_timeout",
        "pool_min_size",
        "pool_max_size",
    )
    #: What the table holds, for messages ("a deduplication table").
    table_kind: ClassVar[str] = "a table of this store"
    #: The privileges the store needs on its table, for the GRANT hint.
    table_privileges: ClassVar[str] = "SELECT, INSERT, UPDATE, DELETE"

    def __init__(self, url: str | StoreURL, /, **options: Any) -> None:
        """Resolve the options, connect, check the table (creating it with ``create``).

        Raises ``ConfigurationError`` for a bad URL or option, refused credentials,
        a non-UTF8 database or a missing/unusable table, and ``StoreUnavailable``
        when the server cannot be reached.
        """
        super().__init__(url, **options)
        self._timeout: float = self._opts["timeout"]
        self._connect_timeout: float = self._opts["connect_timeout"]
        # The server cancels a statement at ``timeout``; the watchdog acts a little
        # later, only when the server did not answer at all.
        self._watchdog_delay = self._timeout + min(1.0, self._timeout / 2)
        given = self._opts["client"]
        self._table_parts = _split_table(self._opts["table"])
        self._table = sql.Identifier(*self._table_parts)
        self._table_text = self._table.as_string(None)
        self._build_statements()
        self._conninfo = self._libpq_conninfo()
        self._unused_client: ConnectionPool[Connection] | None = given
        self._conn: ProcessLocal[ConnectionPool[Connection]] = (
            ProcessLocal(self._given_pool, self._close_pool)
            if given is not None
            else self._shared_connection(self._conninfo, self._make_pool, self._close_pool)
        )
        with self._translating_errors("open"):
            if given is None:
                with psycopg.connect(self._conninfo, autocommit=True) as conn:
                    self._configure(conn)
                    self._check_storage(conn)
                self._conn.get()
            else:
                self._conn.get()
                with self._pooled() as conn:
                    self._check_storage(conn)

    @classmethod
    def _validate(cls, url: StoreURL, options: Options) -> None:
        """The pool sizes agree; ``client`` is a ``psycopg_pool.ConnectionPool``."""
        super()._validate(url, options)
        minimum, maximum = options["pool_min_size"], options["pool_max_size"]
        if minimum > maximum:
            raise ConfigurationError(
                f"pool_min_size ({minimum}) must not exceed pool_max_size ({maximum}) "
                f"for {cls.__name__}"
            )
        given = options["client"]
        if given is not None and not isinstance(given, ConnectionPool):
            raise ConfigurationError(
                f"client must be a psycopg_pool.ConnectionPool, got {type(given).__name__}"
            )

    @classmethod
    def create_schema(cls, url: str | StoreURL, **options: Any) -> None:
        """Create the table and its index if missing (idempotent).

        Takes the same URL and options as the constructor and opens the store with
        ``create=true``; needs the CREATE privilege. Safe to run concurrently.
        Raises like the constructor.
        """
        parsed = StoreURL.parse(url)
        parsed = parsed.with_query([(k, v) for k, v in parsed.query if k != "create"])
        cls(parsed, **{**options, "create": True}).close()

    # ------------------------------------------------------------------ for the stores

    def _render(self, text: str) -> bytes:
        """``text`` with ``{table}`` filled in, as bytes ready to send."""
        return sql.SQL(text).format(table=self._table).as_bytes(None)

    @abc.abstractmethod
    def _build_statements(self) -> None:
        """Render the store's statements (``self._table`` is set)."""

    @abc.abstractmethod
    def _create_objects(self, conn: Connection) -> None:
        """Create the table and its indexes (``IF NOT EXISTS``; the schema lock is held)."""

    @abc.abstractmethod
    def _check_table(self, conn: Connection) -> None:
        """Check the existing table has the store's shape (dry runs of its statements)."""

    # ------------------------------------------------------------------ opening

    def _libpq_conninfo(self) -> str:
        """The URL without its query, plus the libpq parameters, validated by libpq."""
        timeout_s = max(1, math.ceil(self._timeout))
        params: dict[str, Any] = {
            "keepalives": 1,
            "keepalives_idle": timeout_s,
            "keepalives_interval": max(1, math.ceil(self._timeout / 3)),
            "keepalives_count": 3,
            "tcp_user_timeout": min(_MAX_MS, math.ceil(self._timeout * 1000)),
            "fallback_application_name": "dedupstore",
            **self._opts.driver_params,
            "client_encoding": "UTF8",
            "connect_timeout": max(2, math.ceil(self._connect_timeout)),
        }
        if self._opts["password"] is not None:
            params["password"] = self._opts["password"]
        try:
            return psycopg.conninfo.make_conninfo(self._url.with_query([]).text, **params)
        except psycopg.Error as exc:
            raise ConfigurationError(
                f"bad PostgreSQL URL {self.url}: {self._describe_error(exc)}"
            ) from None

    def _configure(self, conn: Connection) -> None:
        """New connection: pin a durable ``synchronous_commit`` and the statement timeout.

        The server's ``synchronous_commit`` is kept unless it is ``off`` (then
        ``on``); pinning it in the session means a later configuration reload
        cannot turn it off under the pool.
        """
        self._execute(
            conn,
            "SELECT set_config('synchronous_commit', CASE current_setting('synchronous_commit') "
            "WHEN 'off' THEN 'on' ELSE current_setting('synchronous_commit') END, false), "
            "set_config('statement_timeout', %s, false)",
            [str(min(_MAX_MS, math.ceil(self._timeout * 1000)))],
        )

    def _check_storage(self, conn: Connection) -> None:
        """Check the encoding and the table (creating it if asked) on ``conn``."""
        row = self._execute(conn, "SELECT current_setting('server_encoding')")[0]
        if row[0] != "UTF8" or conn.info.encoding != "utf-8":
            raise self._error(
                ConfigurationError,
                None,
                f"the database encoding is {row[0]} and the client "
                f"encoding {conn.info.encoding}; dedupstore needs UTF8 for both so every id "
                "round-trips",
            )
        found = self._execute(conn, "SELECT to_regclass(%s) IS NOT NULL", [self._table_text])
        if not found[0][0]:
            if not self._creates:
                raise self._no_such_store(
                    f"table {self._table_text} does not exist in PostgreSQL at {self.url}",
                    f"call {type(self).__name__}.create_schema(url) once, or open the "
                    "store with create=true",
                )
            self._create_table(conn)
        self._check_table(conn)

    def _lock_schema(self, conn: Connection) -> None:
        """Serialize schema changes of this table (in the current transaction)."""
        self._execute(
            conn,
            "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))",
            [f"dedupstore:{self._table_text}"],
        )

    def _create_table(self, conn: Connection) -> None:
        """Create the schema, table and indexes (serialized by an advisory lock)."""
        with conn.transaction():
            self._lock_schema(conn)
            if len(self._table_parts) == 2:
                schema = self._table_parts[0]
                if not self._execute(
                    conn, "SELECT 1 FROM pg_namespace WHERE nspname = %s", [schema]
                ):
                    self._execute(
                        conn,
                        sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema)),
                    )
            self._create_objects(conn)

    # ------------------------------------------------------------------ pool

    def _given_pool(self) -> ConnectionPool[Connection]:
        """The given ``client`` in the opening process; a pool of our own after a fork."""
        given, self._unused_client = self._unused_client, None
        return self._make_pool() if given is None else given

    def _make_pool(self) -> ConnectionPool[Connection]:
        """A pool of our own, shared by the stores of this server (``_shared_connection``)."""
        failures = _ConnectFailures()
        pool = _OwnPool(
            self._conninfo,
            failures,
            kwargs={"autocommit": True},
            min_size=self._opts["pool_min_size"],
            max_size=self._opts["pool_max_size"],
            open=False,
            configure=self._configure,
            timeout=self._connect_timeout,
            # Stop background reconnection after half the wait: a later call then
            # connects on demand at once instead of waiting for a backed-off retry.
            reconnect_timeout=self._connect_timeout / 2,
            name="dedupstore",
        )
        pool.open(wait=False)
        return pool

    def _close_pool(self, pool: ConnectionPool[Connection]) -> None:
        if isinstance(pool, _OwnPool):
            pool.close(timeout=5.0)

    @contextlib.contextmanager
    def _pooled(
        self, *, verify: bool = True, deadline: float | None = None
    ) -> Iterator[Connection]:
        """A live pooled connection (autocommit), returned to the pool on exit.

        Connections the server is known to have closed (readable while idle: a
        restart, a reset that reached us) are discarded and the next one tried at
        once, without a round trip. With ``verify`` (for a request that must not
        be re-sent) the connection must also answer an empty query first
        (``ConnectionPool.check_connection``, bounded like a statement): one that
        died silently (its peer forgot it: the server's host rebooted, a NAT or
        proxy dropped it) fails that instead of the request, and is discarded too.
        Discarded connections are replaced by the pool. Waits at most the pool's
        timeout, and not past ``deadline``; then the ``PoolTimeout`` says why the
        last connection attempt failed, if known. A check that gets no answer
        raises :class:`StatementTimeout`.
        """
        pool = self._conn.get()
        began = time.monotonic()
        deadline = _call_deadline() if deadline is None else deadline
        until = began + pool.timeout if deadline is None else min(began + pool.timeout, deadline)
        while True:
            try:
                conn = pool.getconn(timeout=until - time.monotonic())
            except PoolTimeout as exc:
                waited = max(0.0, until - began)
                message = f"timed out after {waited:.3g} s waiting for a connection"
                failures = pool.failures if isinstance(pool, _OwnPool) else _ConnectFailures()
                cause: BaseException = exc
                if failures.error is not None and failures.at >= began - pool.timeout:
                    cause = failures.error
                    message += f"; the last connection attempt failed: {failures.error}"
                raise PoolTimeout(self._scrub(message)) from cause
            if not conn.autocommit:
                pool.putconn(conn)
                raise self._error(
                    ConfigurationError,
                    None,
                    "the connections of the given client pool must be in autocommit mode "
                    "(ConnectionPool(kwargs={'autocommit': True}))",
                )
            try:
                alive = not _server_closed(conn) and (not verify or self._answers(conn, deadline))
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

    def _answers(self, conn: Connection, deadline: float | None) -> bool:
        """Whether ``conn`` answers an empty query; ``StatementTimeout`` if nothing comes."""
        try:
            with self._bounded(conn, deadline):
                ConnectionPool.check_connection(conn)
        except StatementTimeout:
            raise
        except psycopg.Error:
            return False
        return True

    def _execute(
        self, conn: Connection, query: Any, params: Any = None, *, deadline: float | None = None
    ) -> list[tuple[Any, ...]]:
        """Run one statement and fetch its rows, bounded by the watchdog (and ``deadline``)."""
        with self._bounded(conn, deadline):
            cursor = conn.execute(query, params)
            return cursor.fetchall() if cursor.description is not None else []

    @contextlib.contextmanager
    def _bounded(self, conn: Connection, deadline: float | None) -> Iterator[None]:
        """Close ``conn`` if the round trip in the block gets no answer in time.

        In time: shortly after ``timeout`` (the server cancels the statement at
        ``timeout``), and not past ``deadline``. A psycopg error after the
        watchdog fired is raised as :class:`StatementTimeout`.
        """
        delay = self._watchdog_delay
        deadline = _call_deadline() if deadline is None else deadline
        if deadline is not None:
            delay = max(0.0, min(delay, deadline - time.monotonic()))
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
                raise StatementTimeout(
                    f"timed out after {delay:.3g} s (timeout={self._timeout:g}): "
                    "PostgreSQL did not answer; the connection was closed"
                ) from exc
            raise

    def _run(self, query: Any, params: Any, *, resend: bool) -> list[tuple[Any, ...]]:
        """Run one statement on a pooled connection; re-send it if allowed and useful.

        The call has one deadline (:meth:`_deadline_seconds`: the pool's timeout
        plus the statement's bound, ``timeout`` and the watchdog's grace, the
        worst case of one attempt). ``resend=True`` (reads, and writes that
        recognise their own earlier application): when the connection breaks
        under the statement (a reset, a restart, a connection that died while
        pooled) it is sent again on another connection, until the deadline; each attempt waits for a
        connection and for the answer only until then. ``resend=False``: the
        statement is sent once, on a connection that has just answered a round
        trip (so a connection that died while pooled costs that round trip, not
        the request); a failure after it was sent is raised. A watchdog timeout
        is never re-sent (the server may still be running the statement).
        """
        broke = False

        def attempt() -> list[tuple[Any, ...]]:
            nonlocal broke
            broke = False  # a connection that never came (PoolTimeout) broke nothing
            with self._pooled(verify=not resend) as conn:
                try:
                    return self._execute(conn, query, params)
                except psycopg.OperationalError:
                    # The connection failed under the statement: libpq saw it (broken),
                    # or psycopg's wait saw the socket hang up before libpq did
                    # ("connection socket closed", the connection still reported OK).
                    broke = _server_closed(conn)
                    raise

        def resendable(exc: BaseException) -> bool:
            return resend and broke and not isinstance(exc, StatementTimeout)

        return retry(attempt, attempts=None, retry_on=resendable)

    def _write(
        self, query: bytes, params: Mapping[str, Any], *, resend: bool = False
    ) -> list[tuple[Any, ...]]:
        """Run a write; retried when the server reports it rolled back (deadlock, ...).

        The retries share the call's deadline with the re-sends of :meth:`_run`.

        ``resend=True`` only for a statement whose second application answers
        like the first: the deduplication store's inserts return the rows holding
        the call's write token, so a re-sent ``add`` reports the ids its lost
        first send recorded (never "already recorded"). An entity save is not
        re-sent once sent: after a lost answer its own version check would refuse
        it and the save would be reported as a conflict (harmless: the caller
        reloads and sees the saved state) where the contract says a lost answer
        is an error; the connection it is sent on is checked first instead.
        """
        return retry(
            lambda: self._run(query, params, resend=resend),
            attempts=_WRITE_ATTEMPTS,
            retry_on=lambda exc: isinstance(exc, _RETRYABLE_WRITE_ERRORS),
        )

    def _health_warnings(self) -> list[str]:
        """The server settings and table persistence that put acknowledged writes at risk."""
        with self._pooled() as conn:
            settings = self._execute(
                conn,
                "SELECT name, reset_val FROM pg_settings "
                "WHERE name IN ('fsync', 'synchronous_commit', 'full_page_writes') "
                "UNION ALL SELECT 'session synchronous_commit', "
                "current_setting('synchronous_commit') "
                "UNION ALL SELECT 'relpersistence', relpersistence::text FROM pg_class "
                "WHERE oid = to_regclass(%s)",
                [self._table_text],
            )
        values = {str(name): str(value) for name, value in settings}
        return [
            message.format(table=self._table_text, kind=self.table_kind)
            for setting, bad, message in _RISKY_SETTINGS
            if values.get(setting) == bad
        ]

    def _deadline_seconds(self) -> float:
        """``connect_timeout + timeout + min(1 s, timeout / 2)``: see the module.

        With a given ``client`` pool, its own timeout stands for ``connect_timeout``.
        """
        given = self._opts["client"]
        wait = given.timeout if isinstance(given, ConnectionPool) else self._connect_timeout
        return float(wait + self._watchdog_delay)

    def _read(self, query: bytes, params: Mapping[str, Any]) -> list[tuple[Any, ...]]:
        """Run a read; re-sent on another connection when one breaks under it."""
        return self._run(query, params, resend=True)

    def _close(self) -> None:
        self._conn.close()

    # ------------------------------------------------------------------ errors

    def _classify_error(self, exc: BaseException) -> ErrorKind:
        """psycopg errors: what to fix (``ConfigurationError``) or retry (``StoreUnavailable``)."""
        errors = psycopg.errors
        if isinstance(exc, StatementTimeout):
            return StoreUnavailable
        if isinstance(exc, PoolTimeout):
            cause = exc.__cause__
            if isinstance(cause, psycopg.OperationalError) and self._refused(cause):
                return self._error(
                    ConfigurationError, None, f"connecting failed: {self._describe_error(exc)}"
                )
            return StoreUnavailable
        if isinstance(exc, errors.UndefinedTable):
            return self._error(
                ConfigurationError,
                None,
                f"table {self._table_text} does not exist ({self._describe_error(exc)}): "
                f"create it with {type(self).__name__}.create_schema(url), or open the "
                "store with create=true",
            )
        if isinstance(exc, errors.InsufficientPrivilege):
            return self._error(
                ConfigurationError,
                None,
                f"permission denied ({self._describe_error(exc)}): GRANT "
                f"{self.table_privileges} ON {self._table_text} TO the role the store "
                "connects as",
            )
        if isinstance(
            exc,
            errors.InvalidPassword
            | errors.InvalidAuthorizationSpecification
            | errors.InvalidCatalogName,
        ):
            return ConfigurationError
        if isinstance(exc, psycopg.OperationalError):
            # lost or refused connections, QueryCanceled (statement_timeout),
            # AdminShutdown, CannotConnectNow, deadlocks after retries, ...
            return ConfigurationError if self._refused(exc) else StoreUnavailable
        if isinstance(exc, errors.ReadOnlySqlTransaction):
            return StoreUnavailable  # failed over to a replica: retry later
        if isinstance(
            exc,
            psycopg.ProgrammingError
            | psycopg.DataError
            | psycopg.IntegrityError
            | psycopg.NotSupportedError,
        ):
            return self._error(
                ConfigurationError,
                None,
                f"table {self._table_text} is not usable as {self.table_kind}: "
                f"{self._describe_error(exc)}",
            )
        if isinstance(exc, psycopg.Error):
            return StoreUnavailable
        return super()._classify_error(exc)

    @staticmethod
    def _refused(exc: psycopg.Error) -> bool:
        """A connection attempt refused for a reason a retry will not fix."""
        return exc.sqlstate is None and _REFUSED.search(str(exc)) is not None
