"""``redis://`` and ``rediss://``: stores and a dispatcher on a Redis primary.

* :mod:`.redis._client` -- :class:`RedisConnection`, shared by the objects of one server in a
  process: options, pool, timeouts and retries, the write script, errors, health warnings.
* :mod:`.redis.store` -- :class:`RedisDeduplicationStore`: a string key per (endpoint, id).
* :mod:`.redis.entities` -- :class:`RedisEntityStore`: a hash per entity.
* :mod:`.redis.tokens` -- :class:`RedisTokenStore`: a string key per token.
* :mod:`.redis.dispatcher` -- :class:`RedisDispatcher`: a stream per destination.
* :mod:`.redis.consumer` -- :class:`RedisStreamsBroker`: the consume loop's broker, a consumer
  group; imported on first use (``dedupstore.consumers.open_broker``).

All take the URL ``redis[s]://[[user]:password@]host[:port][/db]``; each module documents its key
layout, token and failure semantics.
"""

from ._client import RedisConnection
from .dispatcher import RedisDispatcher, sent_key, stream_key
from .entities import RedisEntityStore, buckets_key, entity_key, pending_key
from .store import RedisDeduplicationStore, record_key
from .tokens import RedisTokenStore, token_key

__all__ = [
    "RedisConnection",
    "RedisDeduplicationStore",
    "RedisDispatcher",
    "RedisEntityStore",
    "RedisTokenStore",
    "buckets_key",
    "entity_key",
    "pending_key",
    "record_key",
    "sent_key",
    "stream_key",
    "token_key",
]
