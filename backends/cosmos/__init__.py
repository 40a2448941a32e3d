"""``cosmos://<host>[:port]/<database>/<container>?...``: Azure Cosmos DB (NoSQL API).

Three thread-safe stores share one ``CosmosClient`` per account and process
(:class:`CosmosConnection`; a child after ``fork`` opens its own), each kind in a container of its
own (the URL names the container of the store it opens):

* :class:`CosmosDeduplicationStore` (``open_store``; :mod:`.cosmos.store`): one item per
  (endpoint, message id), in a container made by :func:`create_container`;
* :class:`CosmosEntityStore` (``open_entity_store``; :mod:`.cosmos.entities`): one item per
  entity, version = the item's ``_etag``, in a container made by :func:`create_entity_container`;
* :class:`CosmosTokenStore` (:mod:`.cosmos.tokens`): one item per token, in a container made by
  :func:`create_token_container` (``dedup_tokens`` when the URL names only the database).

An item's ``id`` is a hex SHA-256 of its key (:func:`document_id`, :func:`entity_document_id`,
:func:`token_document_id`): Cosmos DB ids may not contain ``/ \\ ? #``, have at most 255
characters and travel in URLs; keys are up to 1024 bytes of anything. The item keeps the key,
compared on every read: a mismatch (a SHA-256 collision, or a container shared with other data)
raises ``ConfigurationError``, never a merge. Containers are partitioned on ``/id``; reads are
queries, never point reads (:meth:`CosmosConnection.read_many`). Opening checks the partition key
(``ConfigurationError``), or creates database and container with ``create=true``. The creation
functions leave an existing container as it is (``offer_throughput``, RU/s, applies to a new one
only) and raise the SDK's errors (``CosmosHttpResponseError``), which a store opening with
``create=true`` translates.

Correctness needs the account's default consistency to be **Strong**, checked at open (weaker
accounts raise ``ConsistencyError``); requests ask for Strong explicitly, so an account weakened
later makes them fail loudly rather than read stale data.
``allow_weak_consistency_for_emulator_only`` is **UNSAFE in production.** It opens an account
weaker than Strong (the emulator reports "Session"), where reads may miss acknowledged writes;
logged as a WARNING at every open, and reported by ``health_warnings()``.

Options: the stores' declarations (tables in ``docs/cosmos.md``); the account key is ``key`` or
else ``COSMOS_KEY`` (then not pickled). The entity store's given ``client`` must have been created
with ``enable_compact_utf8_item_writes=True`` (see its size limit).

Failures: the SDK retries connection failures, reads and throttling (429) ``retries`` times, never a
write whose answer was lost (the deduplication store's write token settles it on a retry, and a
token store's retry finds the token: 409; an entity save raises and the caller reloads). A call (one
chunk of a batch) raises ``StoreUnavailable`` at most ``connect_timeout + (retries + 1) x timeout``
seconds after it started: every HTTP attempt and every pause is cut at that deadline; only the
waits a throttling service asks for (429 ``retry-after``, at most ``timeout`` in all) can extend it.
A given ``client`` keeps its own transport, which refuses a body shorter than its length but not a
reply cut inside its headers.
``StoreUnavailable`` (unreachable, timeout, throttling, 5xx, a reply cut short): retry.
``ConfigurationError``: rejected key, missing database or container, a container of another shape or
shared with other data. ``ConsistencyError``: weaker than Strong.
"""

from __future__ import annotations

from ._client import KEY_ENV_VAR, PARTITION_KEY_PATH, CosmosConnection
from .entities import CosmosEntityStore, create_entity_container, entity_document_id
from .store import CosmosDeduplicationStore, create_container, document_id
from .tokens import (
    DEFAULT_TOKEN_CONTAINER,
    CosmosTokenStore,
    create_token_container,
    token_document_id,
)

__all__ = [
    "DEFAULT_TOKEN_CONTAINER",
    "KEY_ENV_VAR",
    "PARTITION_KEY_PATH",
    "CosmosConnection",
    "CosmosDeduplicationStore",
    "CosmosEntityStore",
    "CosmosTokenStore",
    "create_container",
    "create_entity_container",
    "create_token_container",
    "document_id",
    "entity_document_id",
    "token_document_id",
]
