"""``PostgresTokenStore``: the tokens of token-based deduplication in a PostgreSQL table.

Options: those of :mod:`.postgres._client` (``table`` defaults to ``dedup_tokens``) and
``clock`` (the mint time recorded per token). The URL is the deduplication store's, and the
stores of one server share its pool; the default tables differ, so tokens and records never mix.

Table layout (``create=true`` or :meth:`PostgresTokenStore.create_schema`)::

    id        text COLLATE "C" PRIMARY KEY  -- the token id, byte-exact
    endpoint  text COLLATE "C" NOT NULL     -- the receiving endpoint it authorises
    created   double precision NOT NULL     -- mint time, epoch seconds (the client's clock)

The role needs SELECT, INSERT and DELETE on it. A table without one of the columns is refused with
a ``ConfigurationError`` naming what is missing; the open also dry-runs the three statements
below, so a missing privilege, a column of another type or an ``id`` without a unique index is
refused at once.

One statement per chunk of up to 2,000 tokens, two chunks in flight: a create is ``INSERT ...
SELECT FROM unnest(...) ON CONFLICT (id) DO NOTHING`` (an existing token is left as it is; rows
are written in id order, so overlapping creates never deadlock), a read ``SELECT id ... WHERE id =
ANY(...)``, a delete ``DELETE ... WHERE id = ANY(...)``; :meth:`~TokenStore.outstanding` is one
``GROUP BY endpoint`` over the table. Every statement commits (``synchronous_commit`` on) before
the call returns, and reads see every commit (one server: strongly consistent). Creates and deletes
answer alike when applied twice, so all of them are re-sent on another connection when one breaks
under them. Nothing expires and the store never deletes a token on its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, ClassVar

from dedupstore.backend import (
    Connected,
    OptionSet,
    Steps,
    TokenCount,
    TokenRecord,
    TokenStore,
    io,
)

from ._client import PostgresConnection, Table, create_schema, postgres_options

if TYPE_CHECKING:
    from ._client import PgConnection

__all__ = ["DEFAULT_TOKEN_TABLE", "PostgresTokenStore"]

#: The table used when no ``table`` option is given.
DEFAULT_TOKEN_TABLE = "dedup_tokens"

#: The columns of a token table.
_COLUMNS = ("id", "endpoint", "created")


class PostgresTokenStore(TokenStore):
    """Token store in a PostgreSQL table (one row per token), through the psycopg pool it shares
    with the other PostgreSQL stores of the server. Thread-safe and fork-safe (a child process
    opens its own pool); it pickles to its URL and options. See the module for the layout, the
    statements and the errors."""

    max_batch: ClassVar[int] = 2000
    # Two chunks in flight: the server works on one while the next is sent (sorted: no deadlock).
    chunk_concurrency: ClassVar[int] = 2
    _pg = Connected(PostgresConnection)
    declared_options: ClassVar[OptionSet] = postgres_options(
        TokenStore.declared_options, DEFAULT_TOKEN_TABLE
    )

    def _open(self) -> None:
        self.table = Table(self.options["table"], "a token table", "SELECT, INSERT, DELETE")
        self._build_statements()
        self._pg.open_table(self, self._sql_create, self._check_table)

    create_schema = classmethod(create_schema)

    # ------------------------------------------------------------------ table

    def _check_table(self, conn: PgConnection) -> None:
        """Every column (one missing is named), then dry runs of the statements that take ids
        (types, the unique ``id``, privileges); none touches a row."""
        self._pg.check_columns(self, conn, _COLUMNS)
        execute = self._pg.execute
        execute(conn, self._sql_insert, self._create_params([]))
        execute(conn, self._sql_present, {"ids": []})
        execute(conn, self._sql_delete, {"ids": []})

    def _build_statements(self) -> None:
        render = self.table.render
        self._sql_create = [
            render(
                "CREATE TABLE IF NOT EXISTS {table} ("
                'id text COLLATE "C" PRIMARY KEY, '
                'endpoint text COLLATE "C" NOT NULL, '
                "created double precision NOT NULL)"
            )
        ]
        self._sql_insert = render(
            "INSERT INTO {table} (id, endpoint, created) "
            "SELECT u.id, u.endpoint, u.created "
            "FROM unnest(%(ids)b::text[], %(endpoints)b::text[], %(created)b::float8[]) "
            "WITH ORDINALITY AS u(id, endpoint, created, n) ORDER BY u.n "
            "ON CONFLICT (id) DO NOTHING"
        )
        self._sql_present = render("SELECT id FROM {table} WHERE id = ANY(%(ids)b::text[])")
        #: The table's quoted name, for the entity store's joint saves.
        self.sql_table = render("{table}")
        self._sql_delete = render("DELETE FROM {table} WHERE id = ANY(%(ids)b::text[])")
        self._sql_outstanding = render(
            "SELECT endpoint, count(*), min(created) FROM {table} GROUP BY endpoint"
        )
        self._sql_scan = render(
            "SELECT id, endpoint, created FROM {table} WHERE id > %(after)s "
            "ORDER BY id LIMIT %(limit)s"
        )

    @staticmethod
    def _create_params(records: list[TokenRecord]) -> dict[str, list[str] | list[float]]:
        return {
            "ids": [r.id for r in records],
            "endpoints": [r.endpoint for r in records],
            "created": [float(r.created) for r in records],
        }

    # ------------------------------------------------------------------ primitives

    def _create(self, records: list[TokenRecord]) -> Steps[None]:
        # Every creator inserts rows in one order (COLLATE "C"): overlapping chunks never deadlock.
        params = self._create_params(sorted(records, key=lambda r: r.id))
        yield from io(self._pg.write, self, self._sql_insert, params, resend=True)

    def _present(self, ids: list[str]) -> Steps[set[str]]:
        rows = yield from io(self._pg.read, self, self._sql_present, {"ids": ids})
        return {row[0] for row in rows}

    def _delete(self, ids: list[str]) -> Steps[None]:
        yield from io(self._pg.write, self, self._sql_delete, {"ids": sorted(ids)}, resend=True)

    def _outstanding(self) -> dict[str, TokenCount]:
        """Exact, one statement (a snapshot) over the table, within ``timeout`` (raise it for
        many millions of tokens)."""
        rows = self._pg.read(self, self._sql_outstanding, {})
        return {endpoint: TokenCount(int(n), float(oldest)) for endpoint, n, oldest in rows}

    def _scan(self) -> Iterator[TokenRecord]:
        """Pages of :attr:`page_size` rows in id order (the primary key's index), each one
        statement starting after the last id seen: no offset, no cursor held open."""
        after, size = "", self.page_size
        while True:
            rows = self._pg.read(self, self._sql_scan, {"after": after, "limit": size})
            for tid, endpoint, created in rows:
                yield TokenRecord(tid, endpoint, float(created))
            if len(rows) < size:
                return
            after = rows[-1][0]
