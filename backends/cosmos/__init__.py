"""``cosmos://<host>[:port]/<database>/<container>?...``: Azure Cosmos DB (NoSQL API).

Two stores share one ``CosmosClient`` per account and process (:class:`CosmosConnection`):

* :class:`CosmosDeduplicationStore` (``open_store``; :mod:`backends.cosmos.store`):
  one item per (endpoint, message id) in a container made by :func:`create_container`;
* :class:`CosmosEntityStore` (``open_entity_store``; :mod:`backends.cosmos.entities`):
  one item per entity, version = the item's ``_etag``, in a container made by
  :func:`create_entity_container`. Give each kind its own container: the URL names
  the container of the store it opens.

Both containers are partitioned on ``/id`` (a SHA-256 of the record's key: Cosmos DB
ids may not contain ``/ \\ ? #``); opening checks that the container exists and has
that partition key (``ConfigurationError`` otherwise), or creates database and
container with ``create=true``.

Correctness needs the account's default consistency to be **Strong**, checked at
open (weaker accounts raise ``ConsistencyError``); requests then ask for Strong
explicitly, so an account weakened later makes them fail loudly rather than read
stale data.

Options of both stores (URL query or keyword; ``client`` keyword only):

=============================================  ==========  ==========================
``key``                                        COSMOS_KEY  account key (secret; one
                                                           from the environment is
                                                           not pickled)
``tls``                                        true        false: plain ``http://``
``endpoint_discovery``                         true        follow regional endpoints
``allow_weak_consistency_for_emulator_only``   false       see below
``create``                                     false       create database, container
``max_concurrency``                            32          requests in flight
``timeout``                                    10 s        read timeout per request
``connect_timeout``                            5 s         connect timeout per request
``retries``                                    3           SDK retries per request
``client``                                     none        a ready ``CosmosClient``
                                                           (not pickled, not closed;
                                                           key, tls, timeouts and
                                                           retries then unused)
=============================================  ==========  ==========================

The deduplication store adds ``endpoint``, ``retention``, ``max_clock_skew`` (60 s)
and ``clock`` (keyword only); the entity store's ``client`` must have been created
with ``enable_compact_utf8_item_writes=True`` (see its size limit).

``allow_weak_consistency_for_emulator_only`` is **UNSAFE in production.** It opens an
account whose default consistency is weaker than Strong (the emulator reports
"Session"); reads may then miss acknowledged writes: messages may be processed
twice, entities may load stale. Logged as a WARNING at every open, and reported by
``health_warnings()``.

Failures: connection failures, reads and throttling (429) are retried by the SDK
``retries`` times; a write whose answer was lost is not resent (the deduplication
store's write token settles it on a retry; an entity save raises and the caller
reloads). Deadline: a call (one chunk of a batch) raises ``StoreUnavailable`` at
most ``connect_timeout + (retries + 1) x timeout`` seconds after it started (45 s
with the defaults), whatever the service does: every HTTP attempt of the SDK
(connecting and reading together) and every pause between attempts is cut at the
deadline, and no attempt starts after it. Only the waits a throttling service
asks for (429 ``retry-after``, at most ``timeout`` rounded up, in all) can extend
it. A ``client`` given by the user keeps its own transport and retries, and so
lacks the store's check of a reply cut short (``backends._http``): azure-core's
default transport still refuses a body shorter than its length, but not a reply
cut inside its headers.
``StoreUnavailable`` (unreachable, timeout, throttling, 5xx, a reply cut short): retry.
``ConfigurationError``: rejected key, missing database or container, a container
of another shape or shared with other data.
``ConsistencyError``: weaker than Strong. Each store's module says what its
operations guarantee on failure.
"""

from __future__ import annotations

from backends.cosmos._client import KEY_ENV_VAR, PARTITION_KEY_PATH, CosmosConnection
from backends.cosmos.entities import (
    CosmosEntityStore,
    create_entity_container,
    entity_document_id,
)
from backends.cosmos.store import CosmosDeduplicationStore, create_container, document_id

__all__ = [
    "KEY_ENV_VAR",
    "PARTITION_KEY_PATH",
    "CosmosConnection",
    "CosmosDeduplicationStore",
    "CosmosEntityStore",
    "create_container",
    "create_entity_container",
    "document_id",
    "entity_document_id",
]
