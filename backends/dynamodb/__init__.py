"""``dynamodb://<table>?region=…``: Amazon DynamoDB (or a compatible endpoint).

Three stores, each in a table of its own named by the URL (a table whose key schema differs is
refused; the entity and token tables share theirs, key ``id``, so neither tells the other's table:
name them apart), all holding this process's :class:`DynamoDBConnection` (one boto3 client per
endpoint and credentials, new after ``fork``):

* :class:`DynamoDBDeduplicationStore` (:mod:`.dynamodb.store`): key ``pk`` (message id) +
  ``sk`` (endpoint), expiry by the client's clock, native TTL;
* :class:`DynamoDBEntityStore` (:mod:`.dynamodb.entities`): key ``id``, one item per entity,
  ``version`` the concurrency token;
* :class:`DynamoDBTokenStore` (:mod:`.dynamodb.tokens`): key ``id`` (token id), ``endpoint`` and
  ``created``, one item per token, never expiring.

Consistency: every read is strongly consistent (``ConsistentRead=True``). Tables with global-table
replicas (MRSC tables included) are refused with ``ConsistencyError`` (a strongly consistent read
only sees writes made in its own Region, and conditional writes in two Regions can both succeed),
unless ``allow_global_table=True`` (UNSAFE).

Options: the stores' declarations (tables in ``docs/dynamodb.md``). Credentials default to boto3's
chain; a given ``client`` (keyword only) is neither pickled nor closed, and the connection options
are then unused. ``create=true`` makes the table (on demand; TTL on ``ttl`` for deduplication).

Deadline: a call (one chunk of a batch) raises ``StoreUnavailable`` at most ``connect_timeout +
(retries + 1) x timeout`` seconds after it started, whatever the endpoint does. The store, not
botocore, retries each request (connection errors, timeouts, throttling, 5xx), transaction conflicts
and unprocessed keys; attempts start and wait only until ``connect_timeout`` before the deadline, so
a last connection attempt still ends within it. A given ``client`` keeps its own timeouts and
retries; every client refuses a reply cut short (:mod:`dedupstore.replies`).

Errors: ``StoreUnavailable`` (connection failure, a reply cut short, timeout, throttling, 5xx,
conflicts that outlast the backoff: retry), ``ConfigurationError`` (rejected credentials or IAM
policy, no credentials, no region, missing table, wrong key schema, a request DynamoDB rejects as
invalid: fix the setup), ``ConsistencyError`` (a global table). Each store's module says what a
caller may conclude.
"""

from __future__ import annotations

from ._client import MAX_BATCH_GET_KEYS, MAX_TRANSACT_ITEMS, DynamoDBConnection
from .entities import DynamoDBEntityStore
from .store import DynamoDBDeduplicationStore
from .tokens import DynamoDBTokenStore

__all__ = [
    "MAX_BATCH_GET_KEYS",
    "MAX_TRANSACT_ITEMS",
    "DynamoDBConnection",
    "DynamoDBDeduplicationStore",
    "DynamoDBEntityStore",
    "DynamoDBTokenStore",
]
