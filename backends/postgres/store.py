"""``PostgresDeduplicationStore``: a deduplication table in PostgreSQL.

Options: those of :mod:`.postgres._client` (``table`` defaults to ``dedup_records``),
``endpoint`` and ``retention``. A table without one of the columns (``endpoint``, ``id``,
``expires_at``, ``writer``) is refused with a ``ConfigurationError`` naming what is missing.

Records live in one table keyed by ``(endpoint, id)``, both ``text COLLATE "C"`` (byte-exact).
Expiry is judged by the server's clock (``expires_at``: epoch seconds from ``now()`` in SQL). A
record is committed and flushed (``synchronous_commit`` on) before ``add`` returns. ``INSERT ... ON
CONFLICT`` decides the first writer; each record holds the write token of the call that wrote it
(``writer``), so an insert re-sent after a broken connection, or retried on the same store object
after ``StoreUnavailable``, reports the ids its lost attempt recorded as recorded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal

from dedupstore.backend import (
    Connected,
    DeduplicationStore,
    OptionSet,
    Steps,
    WriteRequest,
    io,
)

from ._client import PostgresConnection, Table, create_schema, postgres_options

if TYPE_CHECKING:
    from ._client import PgConnection

__all__ = ["DEFAULT_TABLE", "PostgresDeduplicationStore"]

#: The table used when no ``table`` option is given.
DEFAULT_TABLE = "dedup_records"

_PURGE_BATCH = 10_000
#: The columns of a deduplication table.
_COLUMNS = ("endpoint", "id", "expires_at", "writer")


class PostgresDeduplicationStore(DeduplicationStore):
    """Deduplication store in a PostgreSQL table, through a psycopg connection pool. Thread-safe and
    fork-safe (a child process opens its own pool); it pickles to its URL and options. See the
    module for the guarantees and the errors."""

    max_write_batch: ClassVar[int] = 2000
    max_read_batch: ClassVar[int] = 5000
    # Two chunks in flight: the server works on one while the next is sent (sorted: no deadlock).
    chunk_concurrency: ClassVar[int] = 2
    expiry_clock: ClassVar[Literal["client", "server"]] = "server"
    _pg = Connected(PostgresConnection)
    declared_options: ClassVar[OptionSet] = postgres_options(
        DeduplicationStore.declared_options, DEFAULT_TABLE
    )

    def _open(self) -> None:
        self.table = Table(
            self.options["table"], "a deduplication table", "SELECT, INSERT, UPDATE, DELETE"
        )
        self._build_statements()
        self._pg.open_table(self, self._sql_create, self._check_table)

    create_schema = classmethod(create_schema)

    # ------------------------------------------------------------------ table

    def _check_table(self, conn: PgConnection) -> None:
        """Every column (one missing is named), then a dry-run write."""
        self._pg.check_columns(self, conn, _COLUMNS)
        self._pg.execute(
            conn,
            self._sql_add_many,
            {"endpoint": self.endpoint, "ids": [], "retention": None, "token": "", "mine": []},
        )

    def _build_statements(self) -> None:
        render = self.table.render
        self._sql_create = [
            render(
                "CREATE TABLE IF NOT EXISTS {table} ("
                'endpoint text COLLATE "C" NOT NULL, '
                'id text COLLATE "C" NOT NULL, '
                "expires_at double precision, "
                "writer text, "
                "PRIMARY KEY (endpoint, id))"
            ),
            render(
                "CREATE INDEX IF NOT EXISTS {index} ON {table} (endpoint, expires_at) "
                "WHERE expires_at IS NOT NULL",
                index="expires_at",
            ),
        ]
        now = "extract(epoch FROM now())::float8"  # the server's clock, never the client's
        expires = f"{now} + %(retention)s::float8"  # NULL (forever) without retention
        on_conflict = (
            "ON CONFLICT (endpoint, id) DO UPDATE "
            "SET expires_at = EXCLUDED.expires_at, writer = EXCLUDED.writer "
            f"WHERE (r.expires_at IS NOT NULL AND r.expires_at <= {now}) "
            "OR r.writer = ANY(%(mine)s::text[]) "
        )
        # Every writer inserts rows in one order (COLLATE "C"): overlapping batches never deadlock.
        self._sql_add_many = render(
            "INSERT INTO {table} AS r (endpoint, id, expires_at, writer) "
            f"SELECT %(endpoint)s::text, u.id, {expires}, %(token)s::text "
            "FROM unnest(%(ids)b::text[]) WITH ORDINALITY AS u(id, n) ORDER BY u.n "
            f"{on_conflict}RETURNING r.id"
        )
        #: The one-id insert (params: :meth:`add_one_params`); public for the entity
        #: store's joint statements (:mod:`.postgres.entities`).
        self.sql_add_one = render(
            "INSERT INTO {table} AS r (endpoint, id, expires_at, writer) "
            f"VALUES (%(endpoint)s::text, %(id)s::text, {expires}, %(token)s::text) "
            f"{on_conflict}RETURNING 1"
        )
        live = f"(expires_at IS NULL OR expires_at > {now})"
        self._sql_find = render(
            "SELECT id FROM {table} "
            f"WHERE endpoint = %(endpoint)s::text AND id = ANY(%(ids)b::text[]) AND {live}"
        )
        #: The one-id lookup (params: :meth:`has_params`); public like :attr:`sql_add_one`.
        self.sql_has = render(
            "SELECT 1 FROM {table} "
            f"WHERE endpoint = %(endpoint)s::text AND id = %(id)s::text AND {live}"
        )
        self._sql_count = render(
            f"SELECT count(*) FROM {{table}} WHERE endpoint = %(endpoint)s::text AND {live}"
        )
        self._sql_endpoints = render(f"SELECT DISTINCT endpoint FROM {{table}} WHERE {live}")
        expired = f"endpoint = %(endpoint)s::text AND expires_at <= {now}"
        # The outer condition is re-checked on rows re-recorded meanwhile: never deleted.
        self._sql_purge = render(
            f"WITH d AS (DELETE FROM {{table}} WHERE {expired} AND id IN ("
            f"SELECT id FROM {{table}} WHERE {expired} LIMIT %(limit)s) RETURNING 1) "
            "SELECT count(*) FROM d"
        )

    # ------------------------------------------------------------------ primitives

    def _write_params(self, request: WriteRequest) -> dict[str, Any]:
        return {
            "endpoint": self.endpoint,
            "retention": request.retention,
            "token": request.token,
            "mine": list(request.mine),
        }

    def _add_new(self, request: WriteRequest) -> Steps[set[str]]:
        params = {**self._write_params(request), "ids": sorted(request.ids)}
        rows = yield from io(self._pg.write, self, self._sql_add_many, params, resend=True)
        return {row[0] for row in rows}

    def _add_one(self, request: WriteRequest) -> Steps[bool]:
        params = self.add_one_params(request)
        return bool((yield from io(self._pg.write, self, self.sql_add_one, params, resend=True)))

    def add_one_params(self, request: WriteRequest) -> dict[str, Any]:
        """The parameters of :attr:`sql_add_one` for ``request`` (one id)."""
        return {**self._write_params(request), "id": request.ids[0]}

    def _find(self, ids: list[str], now: float) -> Steps[set[str]]:
        params = {"endpoint": self.endpoint, "ids": ids}
        rows = yield from io(self._pg.read, self, self._sql_find, params)
        return {row[0] for row in rows}

    def _contains_one(self, message_id: str, now: float) -> Steps[bool]:
        return bool((yield from io(self._pg.read, self, self.sql_has, self.has_params(message_id))))

    def has_params(self, message_id: str) -> dict[str, Any]:
        """The parameters of :attr:`sql_has` for ``message_id``."""
        return {"endpoint": self.endpoint, "id": message_id}

    def _count(self, now: float) -> int:
        """Exact, one statement (a snapshot) judged by the server's ``now()``: reads the endpoint's
        range of the primary key within ``timeout`` (raise it for many millions of ids)."""
        return int(self._pg.read(self, self._sql_count, {"endpoint": self.endpoint})[0][0])

    def _endpoints(self, now: float) -> set[str]:
        """Exact, one statement (a snapshot) over the table, judged by the server's ``now()``."""
        return {row[0] for row in self._pg.read(self, self._sql_endpoints, {})}

    def _purge(self, now: float) -> int:
        params = {"endpoint": self.endpoint, "limit": _PURGE_BATCH}
        total = 0
        while True:
            with self._pg.pooled(self) as conn:
                deleted = int(self._pg.execute(conn, self._sql_purge, params)[0][0])
            total += deleted
            if deleted < _PURGE_BATCH:
                return total
