"""``postgresql://`` / ``postgres://``: PostgreSQL tables for deduplication, entities and tokens.

:class:`PostgresDeduplicationStore` (:mod:`.store`), :class:`PostgresEntityStore`
(:mod:`.entities`) and :class:`PostgresTokenStore` (:mod:`.tokens`) take the same URL (a libpq
connection URI) and share one :class:`PostgresConnection` per server and process: its module
(:mod:`._client`) documents the options, the pool, the bounds on every statement, what is re-sent,
and the errors.
"""

from ._client import PostgresConnection, StatementTimeout
from .entities import DEFAULT_ENTITY_TABLE, PostgresEntityStore
from .store import DEFAULT_TABLE, PostgresDeduplicationStore
from .tokens import DEFAULT_TOKEN_TABLE, PostgresTokenStore

__all__ = [
    "DEFAULT_ENTITY_TABLE",
    "DEFAULT_TABLE",
    "DEFAULT_TOKEN_TABLE",
    "PostgresConnection",
    "PostgresDeduplicationStore",
    "PostgresEntityStore",
    "PostgresTokenStore",
    "StatementTimeout",
]
