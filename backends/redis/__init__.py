"""``redis://`` and ``rediss://``: stores and a dispatcher on a Redis primary.

* :mod:`backends.redis._client` -- :class:`RedisConnection`, the connection the
  stores, the dispatcher and the broker of one server share in a process (each
  holds it, none inherits from it): options, the connection pool, timeouts and
  retries, the one write script per object (``EVALSHA``, plus ``WAIT``
  with ``wait_replicas``), error classification, health warnings (AOF,
  ``appendfsync``, eviction, asynchronous replicas), and the refusal of Redis
  Cluster and of replicas.
* :mod:`backends.redis.store` -- :class:`RedisDeduplicationStore`: one string key per
  (endpoint, id) under ``key_prefix`` ``dedup:``, native expiry.
* :mod:`backends.redis.entities` -- :class:`RedisEntityStore`: one hash per entity
  under ``key_prefix`` ``dedupent:``, the version compared by a Lua script, a set of
  pending ids per bucket for the segmented scan, 4 MiB per entity.
* :mod:`backends.redis.dispatcher` -- :class:`RedisDispatcher`: one stream per
  destination under ``key_prefix`` ``dedupout:``, one script call per dispatch, a
  re-dispatch within ``dedupe_window`` appended once.
* :mod:`backends.redis.consumer` -- :class:`RedisStreamsBroker`: the consume loop's
  broker (:mod:`dedupstore.consumers`), a consumer group read with ``XREADGROUP``,
  ``XACK`` after processing, ``XAUTOCLAIM`` after a lease; imported on first use
  (``dedupstore.consumers.open_broker``).

All take the same URL, ``redis[s]://[[user]:password@]host[:port][/db]``, and the
same connection options; see each module for the key layout, the token and the
failure semantics.
"""

from backends.redis._client import RedisConnection
from backends.redis.dispatcher import RedisDispatcher, sent_key, stream_key
from backends.redis.entities import RedisEntityStore, buckets_key, entity_key, pending_key
from backends.redis.store import RedisDeduplicationStore, record_key

__all__ = [
    "RedisConnection",
    "RedisDeduplicationStore",
    "RedisDispatcher",
    "RedisEntityStore",
    "buckets_key",
    "entity_key",
    "pending_key",
    "record_key",
    "sent_key",
    "stream_key",
]
