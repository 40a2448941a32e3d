"""``postgresql://`` / ``postgres://``: PostgreSQL tables for deduplication and entities.

:class:`PostgresDeduplicationStore` (:mod:`.store`) and :class:`PostgresEntityStore`
(:mod:`.entities`) take the same URL (a libpq connection URI) and share one
:class:`PostgresConnection` per server and process: its module (:mod:`._client`) documents the
options, the pool, the bounds on every statement, what is re-sent, and the errors.
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
