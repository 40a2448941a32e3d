"""``redis://`` and ``rediss://``: a deduplication store and an entity store on a Redis primary.

* :mod:`backends.redis._client` -- :class:`RedisClient`, the connection layer both
  stores share: options, the connection pool, fork safety, timeouts and retries, the
  one write script per store (``EVALSHA``, plus ``WAIT`` with ``wait_replicas``),
  error classification, health warnings (AOF, ``appendfsync``, eviction,
  asynchronous replicas), and the refusal of Redis Cluster and of replicas.
* :mod:`backends.redis.store` -- :class:`RedisDeduplicationStore`: one string key per
  (endpoint, id) under ``key_prefix`` ``dedup:``, native expiry.
* :mod:`backends.redis.entities` -- :class:`RedisEntityStore`: one hash per entity
  under ``key_prefix`` ``dedupent:``, the version compared by a Lua script, a set of
  pending ids per bucket for the segmented scan, 4 MiB per entity.

Both take the same URL, ``redis[s]://[[user]:password@]host[:port][/db]``, and the
same connection options; see each module for the key layout, the token and the
failure semantics.
"""

from backends.redis._client import RedisClient
from backends.redis.entities import RedisEntityStore, buckets_key, entity_key, pending_key
from backends.redis.store import RedisDeduplicationStore, record_key

__all__ = [
    "RedisClient",
    "RedisDeduplicationStore",
    "RedisEntityStore",
    "buckets_key",
    "entity_key",
    "pending_key",
    "record_key",
]
