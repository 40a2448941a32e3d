"""``postgresql://`` / ``postgres://``: PostgreSQL tables for deduplication and entities.

Both stores take the same URL: a libpq connection URI whose query parameters that
are dedupstore options configure the store, every other libpq keyword
(``sslmode``, ``application_name``, ``options``, ...) going to libpq unchanged.

* :class:`PostgresDeduplicationStore` (:mod:`.store`): processed message ids in
  the table ``dedup_records`` by default, keyed by ``(endpoint, id)``.
* :class:`PostgresEntityStore` (:mod:`.entities`): entities and their outbox, one
  row each under a ``version`` token, in ``dedupstore_entities`` by default.

Both hold one connection (:mod:`._client`, :class:`PostgresConnection`) per server
and process: the options ``create``, ``timeout`` (10 s per statement),
``connect_timeout`` (5 s), ``pool_min_size``, ``pool_max_size``, ``password`` and
``client`` (besides each store's ``table``); the pool, the statement watchdog,
durable commits, and one error classification: ``StoreUnavailable`` (retry) or
``ConfigurationError`` (fix the setup). An entity save is never re-sent after a lost
answer; the deduplication store's inserts are, under their write token.
"""

from backends.postgres._client import PostgresConnection, StatementTimeout
from backends.postgres.entities import DEFAULT_ENTITY_TABLE, PostgresEntityStore
from backends.postgres.store import DEFAULT_TABLE, PostgresDeduplicationStore

__all__ = [
    "DEFAULT_ENTITY_TABLE",
    "DEFAULT_TABLE",
    "PostgresConnection",
    "PostgresDeduplicationStore",
    "PostgresEntityStore",
    "StatementTimeout",
]
