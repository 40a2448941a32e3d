"""``postgresql://`` / ``postgres://``: PostgreSQL tables for deduplication and entities.

* :class:`PostgresDeduplicationStore` (:mod:`.store`): processed message ids, keyed by
  ``(endpoint, id)``.
* :class:`PostgresEntityStore` (:mod:`.entities`): entities and their outbox, one row each under a
  ``version`` token.

Both take the same URL (a libpq connection URI) and share one connection per server and process,
:class:`PostgresConnection`: its module (:mod:`._client`) documents the common options, the pool,
the bounds on every statement, what is re-sent, and the errors (``StoreUnavailable``: retry;
``ConfigurationError``: fix the setup).
"""

from ._client import PostgresConnection, StatementTimeout
from .entities import DEFAULT_ENTITY_TABLE, PostgresEntityStore
from .store import DEFAULT_TABLE, PostgresDeduplicationStore

__all__ = [
    "DEFAULT_ENTITY_TABLE",
    "DEFAULT_TABLE",
    "PostgresConnection",
    "PostgresDeduplicationStore",
    "PostgresEntityStore",
    "StatementTimeout",
]
