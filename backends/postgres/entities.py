"""``PostgresEntityStore``: entities and their outbox, one row each, in PostgreSQL.

Options: those of :mod:`.postgres._client` (``table`` defaults to ``dedupstore_entities``).
The URL is the deduplication store's; the default tables differ, so entities and records never mix.

Table layout (``create=true`` or :meth:`PostgresEntityStore.create_schema`)::

    id       text COLLATE "C" PRIMARY KEY  -- the entity id, byte-exact
    body     text NOT NULL                 -- canonical JSON of state and outbox
    version  bigint NOT NULL               -- the token: 1, 2, 3, ... per entity
    bucket   integer NOT NULL              -- bucket_of(id), 0..4095
    pending  boolean NOT NULL              -- the outbox is not empty
    listed   boolean NOT NULL              -- in the scan's index (see Scan)
    + index <table>_listed ON (id) WHERE listed; fillfactor 80 (in-page updates)

``body`` is ``text``, not ``jsonb``, so the canonical JSON comes back byte for byte (``jsonb``
reorders keys, turns ``1e20`` into an integer and refuses ``\\u0000``); ``body::jsonb`` queries it.

Token: ``version``. A save is one ``INSERT ... SELECT FROM unnest(...) ON CONFLICT (id) DO UPDATE
... WHERE t.version = <expected>`` per chunk of up to 1,000 entities (one statement per ~16 MiB of
bodies): a new entity is inserted only if absent, a loaded one updated only if its row still holds
the version it was loaded at. The server compares and writes each row atomically (the row lock of
``ON CONFLICT``), and savers write rows in id order, so overlapping saves never deadlock. A version
this store did not hand out conflicts without I/O. The store never deletes entities; a loaded
entity whose row was deleted by hand conflicts.

Scan: ``WHERE listed AND mod(bucket, segments) = segment``, keyset-paginated by ``id`` (the partial
index), at most 500 rows and ~16 MiB of bodies per page, each page its own statement. A save sets
``listed`` when the outbox is not empty and never clears it, so most saves are heap-only (HOT)
updates without new index entries; the scan clears ``listed`` on the rows of its page no longer
pending (re-checked under the row lock).

Size limit: 4 MiB of canonical JSON per entity (``max_entity_bytes``, checked before any I/O), so
one load answer stays below 400 MiB and a statement well inside ``timeout``.

Failures: a save is never re-sent (a re-send would conflict). When its answer is lost
(``StoreUnavailable``) it may or may not have been applied and ``version`` is left as it was, so a
retry conflicts if the first was applied (reload: the entity then holds that save's state).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from dedupstore.backend import (
    Connected,
    DeduplicationStore,
    EntityRecord,
    EntityStore,
    OptionSet,
    Steps,
    TokenStore,
    TokenWrites,
    WriteRequest,
    groups_by_size,
    io,
)

from ._client import PostgresConnection, Table, create_schema, postgres_options
from .store import PostgresDeduplicationStore
from .tokens import PostgresTokenStore

if TYPE_CHECKING:
    from ._client import PgConnection

__all__ = ["DEFAULT_ENTITY_TABLE", "PostgresEntityStore"]

#: The table used when no ``table`` option is given.
DEFAULT_ENTITY_TABLE = "dedupstore_entities"

_PAGE_ROWS = 500  # rows per page of the scan, at most
_PAGE_BYTES = 16 * 1024 * 1024  # bodies per page of the scan, about (one row at least)
_STATEMENT_BYTES = 16 * 1024 * 1024  # bodies per save statement, about (one row at least)
_MAX_VERSION = 2**63 - 2  # a bigint that can still be incremented


def _candidates(records: list[EntityRecord]) -> list[tuple[EntityRecord, int]]:
    """(record, the version it gets) for each record a stored row can match; the others conflict
    without a statement."""
    return [
        (record, 1 if record.version is None else record.version + 1)
        for record in records
        if record.version is None
        or (type(record.version) is int and 1 <= record.version <= _MAX_VERSION)
    ]


class PostgresEntityStore(EntityStore):
    """Entity store in a PostgreSQL table (one row per entity, ``version`` token). Thread-safe and
    fork-safe (a child process opens its own pool); it pickles to its URL and options. See the
    module for the layout, the guarantees and the errors."""

    #: 4 MiB of canonical JSON per entity: see the module documentation.
    max_entity_bytes: ClassVar[int] = 4 * 1024 * 1024
    max_load_batch: ClassVar[int] = 100
    #: Entities per save statement (one commit, one flush on a durable server).
    max_save_batch: ClassVar[int] = 1000
    joins = PostgresDeduplicationStore
    token_joins = PostgresTokenStore
    _pg = Connected(PostgresConnection)
    declared_options: ClassVar[OptionSet] = postgres_options(
        EntityStore.declared_options, DEFAULT_ENTITY_TABLE
    )

    def _open(self) -> None:
        self.table = Table(self.options["table"], "an entity table", "SELECT, INSERT, UPDATE")
        self._build_statements()
        self._pg.open_table(self, self._sql_create, self._check_table)

    create_schema = classmethod(create_schema)

    # ------------------------------------------------------------------ table

    def _check_table(self, conn: PgConnection) -> None:
        """Dry runs of the three statements: columns, types, unique id, privileges."""
        execute = self._pg.execute
        execute(conn, self._sql_save, self._save_params([]))
        execute(conn, self._sql_load, {"ids": []})
        execute(conn, self._sql_scan, self._scan_params(0, 1, "", 0))
        execute(conn, self._sql_unlist, {"ids": []})

    def _build_statements(self) -> None:
        render = self.table.render
        self._sql_create = [
            render(
                "CREATE TABLE IF NOT EXISTS {table} ("
                'id text COLLATE "C" PRIMARY KEY, '
                "body text NOT NULL, "
                "version bigint NOT NULL, "
                "bucket integer NOT NULL, "
                "pending boolean NOT NULL, "
                "listed boolean NOT NULL) "
                "WITH (fillfactor = 80)"
            ),
            render(
                "CREATE INDEX IF NOT EXISTS {index} ON {table} (id) WHERE listed", index="listed"
            ),
        ]

        # ``u.version``: the version the row gets (1: new, else the expected one + 1); a loaded
        # entity is never inserted (the store deletes no rows: the row of a version seen exists).
        def save(guard: str = "") -> bytes:  # guard: a condition on the rows written
            return render(
                "INSERT INTO {table} AS t (id, body, version, bucket, pending, listed) "
                "SELECT u.id, u.body, u.version, u.bucket, u.pending, u.pending "
                "FROM unnest(%(ids)b::text[], %(bodies)b::text[], %(versions)b::int8[], "
                "%(buckets)b::int4[], %(pending)b::bool[]) WITH ORDINALITY "
                "AS u(id, body, version, bucket, pending, n) "
                "WHERE (u.version = 1 OR EXISTS (SELECT 1 FROM {table} AS e WHERE e.id = u.id))"
                f"{guard} ORDER BY u.n "
                "ON CONFLICT (id) DO UPDATE SET body = EXCLUDED.body, "
                "version = EXCLUDED.version, bucket = EXCLUDED.bucket, pending = EXCLUDED.pending, "
                "listed = t.listed OR EXCLUDED.pending "
                "WHERE t.version = EXCLUDED.version - 1 "
                "RETURNING t.id, t.version"
            )

        self._sql_save = save()
        self._sql_save_unless = save(" AND NOT EXISTS (SELECT 1 FROM a)")
        self._sql_save_tokened = save(" AND NOT EXISTS (SELECT 1 FROM q WHERE q.eid = u.id)")
        self._sql_load = render(
            "SELECT id, body, version FROM {table} WHERE id = ANY(%(ids)b::text[])"
        )
        # One page: the next ``rows`` listed ids after ``after``, cut after about ``budget`` bytes
        # of bodies; a row no longer pending has a NULL body. ``n``: the rows before the cut.
        self._sql_scan = render(
            "SELECT id, body, version, n FROM ("
            "SELECT id, body, version, count(*) OVER () AS n, "
            "sum(coalesce(octet_length(body), 0)) OVER (ORDER BY id ROWS UNBOUNDED PRECEDING) "
            "- coalesce(octet_length(body), 0) AS before FROM ("
            "SELECT id, CASE WHEN pending THEN body END AS body, version FROM {table} "
            "WHERE listed AND mod(bucket, %(segments)s::int4) = %(segment)s::int4 "
            "AND id > %(after)s::text ORDER BY id LIMIT %(rows)s::int4) AS p"
            ") AS q WHERE before < %(budget)s::int8 ORDER BY id"
        )
        # The scan's prune: rows still not pending (re-checked under the row lock) leave the index.
        self._sql_unlist = render(
            "UPDATE {table} SET listed = false "
            "WHERE id = ANY(%(ids)b::text[]) AND listed AND NOT pending"
        )

    # ------------------------------------------------------------------ primitives

    def _load(self, ids: list[str]) -> Steps[dict[str, tuple[str, Any]]]:
        rows = yield from io(self._pg.read, self, self._sql_load, {"ids": ids})
        return {eid: (body, version) for eid, body, version in rows}

    # ------------------------------------------------------------------ with a dedup store

    def _load_with(
        self, dedup: DeduplicationStore, entity_id: str, key: str
    ) -> Steps[tuple[tuple[str, Any] | None, bool]]:
        """The entity's row and the record's, in one statement (a ``UNION ALL``)."""
        assert isinstance(dedup, PostgresDeduplicationStore)
        query = (
            b"SELECT l.body, l.version FROM (" + self._sql_load + b") AS l "
            b"UNION ALL SELECT NULL, NULL FROM (" + dedup.sql_has + b") AS h"
        )
        params = {"ids": [entity_id], **dedup.has_params(key)}
        rows = yield from io(self._pg.read, self, query, params)
        entity = next(((body, version) for body, version in rows if body is not None), None)
        return entity, any(body is None for body, _ in rows)

    def _save_with(
        self, dedup: DeduplicationStore, request: WriteRequest, record: EntityRecord
    ) -> Steps[tuple[set[str], dict[str, Any]]]:
        """The record's insert and the entity's save in one statement (:meth:`_joint`); a
        conflicting save writes no row, the record is written all the same."""
        assert isinstance(dedup, PostgresDeduplicationStore)
        params = dedup.add_one_params(request)
        added, versions = yield from self._joint(dedup.sql_add_one, self._sql_save, params, record)
        return set(request.ids) if added else set(), versions

    def _save_unless(
        self, dedup: DeduplicationStore, key: str, record: EntityRecord
    ) -> Steps[tuple[bool, dict[str, Any]]]:
        """The record's read and the entity's save, guarded by it, in one statement."""
        assert isinstance(dedup, PostgresDeduplicationStore)
        params = dedup.has_params(key)
        return (yield from self._joint(dedup.sql_has, self._sql_save_unless, params, record))

    def _joint(
        self, first: bytes, save: bytes, params: dict[str, Any], record: EntityRecord
    ) -> Steps[tuple[bool, dict[str, Any]]]:
        """``first`` (as ``a``) and ``save`` of ``record`` in one statement, so one transaction (two
        data-modifying ``WITH`` queries: all or nothing); whether ``first`` returned a row, and the
        versions saved. Not re-sent after a lost answer (its version check would refuse it)."""
        query = (
            b"WITH a AS (" + first + b"), s AS (" + save + b") "
            b"SELECT NULL::text, NULL::int8 FROM a UNION ALL SELECT s.id, s.version FROM s"
        )
        params = {**params, **self._save_params(_candidates([record]))}
        rows = yield from io(self._pg.write, self, query, params)
        return any(eid is None for eid, _ in rows), {e: v for e, v in rows if e is not None}

    # ------------------------------------------------------------------ with a token store

    def _load_with_token(
        self, tokens: TokenStore, entity_id: str, token_id: str
    ) -> Steps[tuple[tuple[str, Any] | None, bool]]:
        """The entity's row and the token's, in one statement (a ``UNION ALL``: one
        snapshot, as good as a read after the load)."""
        assert isinstance(tokens, PostgresTokenStore)
        query = (
            b"SELECT l.body, l.version FROM (" + self._sql_load + b") AS l "
            b"UNION ALL SELECT NULL, NULL FROM " + tokens.sql_table + b" WHERE id = %(token)s"
        )
        rows = yield from io(self._pg.read, self, query, {"ids": [entity_id], "token": token_id})
        entity = next(((body, version) for body, version in rows if body is not None), None)
        return entity, any(body is None for body, _ in rows)

    def _save_tokens(
        self,
        tokens: TokenStore,
        records: list[EntityRecord],
        writes: Mapping[str, TokenWrites],
    ) -> Steps[tuple[set[str], dict[str, Any]]]:
        """One statement per group of up to 16 MiB of bodies, so one transaction: ``q`` the
        entities whose required token is absent, ``s`` the save of the others, then the token
        rows inserted (``c``) and deleted (``d``) of the entities ``s`` returned (data-modifying
        ``WITH`` queries; a token written only once its entity's row is locked and saved). Not
        re-sent after a lost answer (its version check would refuse it)."""
        assert isinstance(tokens, PostgresTokenStore)
        candidates = _candidates(records)
        candidates.sort(key=lambda pair: pair[0].id)  # one lock order for every saver
        table = tokens.sql_table
        query = (
            b"WITH q AS (SELECT r.eid FROM unnest(%(req_e)b::text[], %(req_t)b::text[]) "
            b"AS r(eid, tid) WHERE NOT EXISTS (SELECT 1 FROM " + table + b" AS k "
            b"WHERE k.id = r.tid)), s AS (" + self._sql_save_tokened + b"), "
            b"c AS (INSERT INTO " + table + b" (id, endpoint, created) "
            b"SELECT n.tid, n.endpoint, n.created FROM unnest(%(new_e)b::text[], "
            b"%(new_t)b::text[], %(new_p)b::text[], %(new_c)b::float8[]) "
            b"AS n(eid, tid, endpoint, created) WHERE n.eid IN (SELECT id FROM s) "
            b"ORDER BY n.tid ON CONFLICT (id) DO NOTHING), "
            b"d AS (DELETE FROM " + table + b" WHERE id IN (SELECT g.tid FROM "
            b"unnest(%(gone_e)b::text[], %(gone_t)b::text[]) AS g(eid, tid) "
            b"WHERE g.eid IN (SELECT id FROM s))) "
            b"SELECT q.eid, NULL::int8 FROM q UNION ALL SELECT s.id, s.version FROM s"
        )
        missing: set[str] = set()
        saved: dict[str, Any] = {}
        for group in groups_by_size(candidates, _STATEMENT_BYTES, lambda pair: pair[0].size):
            params: dict[str, Any] = {
                "req_e": [], "req_t": [], "new_e": [], "new_t": [], "new_p": [], "new_c": [],
                "gone_e": [], "gone_t": [],
            }  # fmt: skip
            for record, _ in group:
                change = writes.get(record.id)
                if change is None:
                    continue
                if change.require is not None:
                    params["req_e"].append(record.id)
                    params["req_t"].append(change.require)
                for token in change.create:
                    params["new_e"].append(record.id)
                    params["new_t"].append(token.id)
                    params["new_p"].append(token.endpoint)
                    params["new_c"].append(float(token.created))
                params["gone_e"] += [record.id] * len(change.delete)
                params["gone_t"] += list(change.delete)
            params.update(self._save_params(group))
            for eid, version in (yield from io(self._pg.write, self, query, params)):
                if version is None:
                    missing.add(eid)
                else:
                    saved[eid] = version
        return missing, saved

    def _save(self, records: list[EntityRecord]) -> Steps[dict[str, Any]]:
        candidates = _candidates(records)
        candidates.sort(key=lambda pair: pair[0].id)  # one lock order for every saver
        saved: dict[str, Any] = {}
        for group in groups_by_size(candidates, _STATEMENT_BYTES, lambda pair: pair[0].size):
            rows = yield from io(self._pg.write, self, self._sql_save, self._save_params(group))
            saved.update((eid, version) for eid, version in rows)
        return saved

    def _scan(self, segment: int, segments: int) -> Iterator[tuple[str, str, Any]]:
        after = ""  # ids are never empty: every id sorts after it
        while True:
            params = self._scan_params(segment, segments, after, _PAGE_ROWS)
            rows = self._pg.read(self, self._sql_scan, params)
            stale = [eid for eid, body, _, _ in rows if body is None]
            if stale:
                self._pg.write(self, self._sql_unlist, {"ids": stale}, resend=True)
            for eid, body, version, _ in rows:
                if body is not None:
                    yield eid, body, version
            if not rows or (len(rows) == rows[0][3] < _PAGE_ROWS):
                return
            after = rows[-1][0]

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _save_params(candidates: list[tuple[EntityRecord, int]]) -> dict[str, Any]:
        """The parameters of ``_sql_save`` for (record, version it gets) pairs."""
        return {
            "ids": [r.id for r, _ in candidates],
            "bodies": [r.body for r, _ in candidates],
            "versions": [v for _, v in candidates],
            "buckets": [r.bucket for r, _ in candidates],
            "pending": [r.pending for r, _ in candidates],
        }

    @staticmethod
    def _scan_params(segment: int, segments: int, after: str, rows: int) -> dict[str, Any]:
        return {
            "segment": segment,
            "segments": segments,
            "after": after,
            "rows": rows,
            "budget": _PAGE_BYTES,
        }
