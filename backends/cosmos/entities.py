"""The Cosmos DB entity store: :class:`CosmosEntityStore`, one item per entity.

URL: ``cosmos://<host>[:port]/<database>/<container>``, as for the deduplication
store; the container named is the ENTITY container (give each kind its own
container: :func:`create_entity_container`, or ``create=true``). It is partitioned
on ``/id``. Each entity is one item::

    {"id": "<hex SHA-256 of a namespace tag and the UTF-8 entity id>",
     "entity_id": "<the entity id as given>",
     "body": "<the canonical JSON of state and outbox, as a string>",
     "bucket": <bucket_of(entity id), 0..4095>,
     "pending": <true when the outbox is not empty>,
     "token": "<random, new on every save>"}

* ``id``: Cosmos DB ids may not contain ``/ \\ ? #`` and are at most 255 characters,
  so the entity id (up to 1024 UTF-8 bytes, any character) is hashed, as the
  deduplication store hashes message ids; ``entity_id`` keeps the original and is
  compared on every read (a mismatch: a container shared with other data, or a
  SHA-256 collision, raises ``ConfigurationError``, never a merge).
* ``body`` is the canonical JSON text, not a nested object: Cosmos DB keeps numbers
  as IEEE doubles, so an integer beyond 2**53 in the state would not round-trip.
* The version token is the item's ``_etag``. A new entity is written with
  ``create_item`` (409: someone created it first: a conflict); a loaded one with
  ``replace_item`` and ``If-Match: <version>`` (412, or 404 when it is gone: a
  conflict). Each write is atomic; nothing is ever half-written.
* ``save_many`` sends one request per entity, ``max_concurrency`` in flight, not a
  transactional batch: a batch fails as a whole on one conflict (and the emulator
  refuses batches of anything but creates). A conflicting answer (409/412) is read
  back: an item carrying this save's ``token`` is this save's own write (a request
  the SDK resent after its first attempt succeeded) and is reported as saved, with
  its ``_etag``. The SDK never resends a write whose answer was lost: that save
  raises ``StoreUnavailable`` (the write may or may not have happened; reload). It
  resends only requests never sent and answers meaning "not done" (429, 449, 410,
  503 with endpoint discovery), so the one case left, a resend that finds our write
  already replaced by a third writer, is reported as a conflict (the reload shows
  both writes: the third writer saved on top of ours).
* Loads are read-many queries (one per physical partition, in parallel; a lone id a
  single-partition query), strongly consistent, never point reads (see
  :meth:`CosmosConnection.read_many`).
* ``pending_outboxes(segment, segments)`` is a cross-partition query
  ``WHERE c.pending = true AND c.bucket % @segments = @segment``, read page by page
  (continuation tokens, at most 100 items a page): segments follow the stored
  bucket, so they are disjoint and complete for any count (the emulator exposes a
  single feed range, so feed ranges cannot be the segments). The container indexes
  ``/pending`` and ``/bucket`` only.

Size limit: Cosmos DB refuses a request over 2 MiB of JSON ("Request size is too
large", 413), counted as sent. The body travels as a JSON string inside the item:
every ``"`` and ``\\`` doubles, so the item's JSON is at most twice the body plus the
other fields. The store's own client writes compact UTF-8
(``enable_compact_utf8_item_writes``); without it non-ASCII text would travel as
``\\uXXXX`` escapes (up to 6 bytes per byte), so a ``client`` given as an option
must have it on too. Hence ``max_entity_bytes`` = (2 MiB - 16 KiB) // 2 = 1,040,384
bytes of canonical JSON, 16 KiB being room for the id, the entity id (up to 6 KiB
escaped), bucket, pending, token and the system properties (``_rid``, ``_self``,
``_etag``, ``_ts``, ``_attachments``). cosmosdb-server (the test emulator) does not
enforce the 2 MiB limit at all; the tests check the item's serialized size instead.

Options: those of the package (``key``, ``tls``, ``endpoint_discovery``,
``allow_weak_consistency_for_emulator_only``, ``create``, ``max_concurrency``,
``timeout``, ``connect_timeout``, ``retries``, ``client``); see :mod:`backends.cosmos`
for them and for the failure semantics (timeouts, retries, error classes).
"""

from __future__ import annotations

import dataclasses
import hashlib
import secrets
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Final

from azure.core import MatchConditions
from azure.core.exceptions import HttpResponseError
from azure.cosmos import CosmosClient
from azure.cosmos.exceptions import CosmosHttpResponseError

from backends.cosmos._client import CONNECTION_OPTIONS, ContainerKind, CosmosConnection
from dedupstore.client import Connected, ErrorKind
from dedupstore.entities import EntityRecord, EntityStore
from dedupstore.errors import ConfigurationError, EntityTooLarge
from dedupstore.options import Options, OptionSet
from dedupstore.urls import StoreURL

if TYPE_CHECKING:
    from azure.cosmos import ContainerProxy

__all__ = ["CosmosEntityStore", "create_entity_container", "entity_document_id"]

_ID_NAMESPACE: Final = b"dedupstore/cosmos/entity/v1\x00"
#: Cosmos DB's largest request (an item write), in bytes of JSON as sent.
MAX_REQUEST_BYTES: Final = 2 * 1024 * 1024
#: Room in an item for everything but the body (see the module documentation).
ITEM_OVERHEAD_BYTES: Final = 16 * 1024
#: Items per page of the scan.
_SCAN_PAGE: Final = 100
_INDEXING_POLICY: Final[dict[str, Any]] = {
    "indexingMode": "consistent",
    "automatic": True,
    "includedPaths": [{"path": "/pending/?"}, {"path": "/bucket/?"}],
    "excludedPaths": [{"path": "/*"}],
}


def entity_document_id(entity_id: str) -> str:
    """The Cosmos DB item id of an entity: 64 hex characters.

    Hex SHA-256 of a namespace tag (distinct from the deduplication store's) and
    the UTF-8 entity id: valid as a Cosmos DB id and as a URL path segment.
    """
    return hashlib.sha256(_ID_NAMESPACE + entity_id.encode("utf-8")).hexdigest()


def create_entity_container(
    client: CosmosClient,
    database: str,
    container: str,
    *,
    offer_throughput: int | None = None,
) -> ContainerProxy:
    """Create ``database`` and an entity ``container`` if missing.

    Partition key path ``/id``, no TTL, an indexing policy limited to what the scan
    filters on (``/pending``, ``/bucket``). ``offer_throughput`` (RU/s) applies only
    when the container is created; leave it ``None`` on serverless accounts. An
    existing container is left as it is. Raises ``CosmosHttpResponseError`` and
    azure-core errors; :class:`CosmosEntityStore` translates them when it calls this.
    """
    return CosmosEntityStore._kind.create(client, database, container, offer_throughput)


def _etag_of(result: Mapping[str, Any]) -> str | None:
    """The ``_etag`` a write answered with (header; body when the service sent one)."""
    headers = getattr(result, "get_response_headers", None)
    etag = headers().get("etag") if callable(headers) else None
    etag = etag or result.get("_etag")
    return str(etag) if etag else None


class CosmosEntityStore(EntityStore):
    """Entities in an Azure Cosmos DB (NoSQL API) container, one item each.

    The version is the item's ``_etag``; a save writes only if it is unchanged
    (``If-Match``), a new entity only if absent (create). Loads are strongly
    consistent on an account whose default consistency is Strong (else
    ``ConsistencyError`` at open). Entities over :attr:`max_entity_bytes` (about
    1 MB of canonical JSON) raise ``EntityTooLarge`` before any I/O. Raises
    ``StoreUnavailable`` (retry; a save may have happened: reload),
    ``ConfigurationError`` (key, database, container, a container shared with
    other data), ``ConsistencyError``, ``StoreClosed``. Thread-safe; after ``fork``
    a child opens its own client.
    """

    connection_class = CosmosConnection
    _cosmos = Connected[CosmosConnection]()
    max_entity_bytes: ClassVar[int] = (MAX_REQUEST_BYTES - ITEM_OVERHEAD_BYTES) // 2
    max_load_batch: ClassVar[int] = 100
    declared_options: ClassVar[OptionSet] = EntityStore.declared_options.extend(
        *CONNECTION_OPTIONS,
        dataclasses.replace(
            CONNECTION_OPTIONS[-1],
            doc="a ready CosmosClient created with enable_compact_utf8_item_writes=True "
            "(key, tls, timeouts and retries are then unused)",
        ),
    )
    _kind: ClassVar[ContainerKind] = ContainerKind(
        "an entity container",
        "create_entity_container()",
        {"indexing_policy": _INDEXING_POLICY},
        "a strongly consistent entity store",
        "loads may miss acknowledged saves and return stale entities",
    )

    def _open(self) -> None:
        self._cosmos.open_container(self)

    @classmethod
    def _validate(cls, url: StoreURL, options: Options) -> None:
        """Also: a given ``client`` writes compact UTF-8 (else the size limit cannot hold)."""
        super()._validate(url, options)
        connection = getattr(options["client"], "client_connection", None)
        if getattr(connection, "_enable_compact_utf8_item_writes", None) is False:
            raise ConfigurationError(
                f"option 'client' of {cls.__name__}: the CosmosClient escapes non-ASCII "
                "text (up to 6 bytes per byte), so an entity within max_entity_bytes could "
                "exceed Cosmos DB's 2 MiB request limit; create it with "
                "enable_compact_utf8_item_writes=True"
            )

    def _classify_error(self, exc: BaseException) -> ErrorKind:
        if isinstance(exc, HttpResponseError) and exc.status_code == 413:
            return self._error(
                EntityTooLarge,
                None,
                f"Cosmos DB refused an item as too "
                f"large ({self._describe_error(exc)}) although its entity was within "
                f"max_entity_bytes; that entity was not written (others of the same "
                "save_many may have been)",
            )
        return super()._classify_error(exc)

    # ------------------------------------------------------------------ items

    @staticmethod
    def _item(record: EntityRecord, token: str) -> dict[str, Any]:
        return {
            "id": entity_document_id(record.id),
            "entity_id": record.id,
            "body": record.body,
            "bucket": record.bucket,
            "pending": record.pending,
            "token": token,
        }

    def _check_item(self, item: Mapping[str, Any], entity_id: str | None = None) -> str:
        """The item's entity id; ``ConfigurationError`` if it is not one of our items."""
        stored = item.get("entity_id")
        if (
            not isinstance(stored, str)
            or not isinstance(item.get("body"), str)
            or (entity_id is not None and stored != entity_id)
            or entity_document_id(stored) != item.get("id")
        ):
            wanted = "not an entity item" if entity_id is None else f"not {entity_id!r:.60}"
            raise self._error(
                ConfigurationError,
                None,
                f"item {item.get('id')!r} of container "
                f"{self._cosmos.container(self).id!r} holds entity {stored!r:.60}, {wanted}: a "
                "container shared with other data (or a SHA-256 collision); give the "
                "entities a container of their own",
            )
        return stored

    # ------------------------------------------------------------------ primitives

    def _load(self, ids: list[str]) -> dict[str, tuple[str, Any]]:
        doc_ids = {eid: entity_document_id(eid) for eid in ids}
        found = self._cosmos.read_many(self, list(doc_ids.values()))
        result: dict[str, tuple[str, Any]] = {}
        for eid, doc_id in doc_ids.items():
            item = found.get(doc_id)
            if item is not None:
                self._check_item(item, eid)
                result[eid] = (item["body"], str(item["_etag"]))
        return result

    def _save(self, records: list[EntityRecord]) -> dict[str, Any]:
        container = self._cosmos.container(self)
        tokens = {record.id: secrets.token_urlsafe(16) for record in records}

        def write(record: EntityRecord) -> str | None:
            """The new ``_etag``; ``None`` when refused (or answered without one)."""
            item = self._item(record, tokens[record.id])
            try:
                if record.version is None:
                    result = container.create_item(item, no_response=True)
                else:
                    result = container.replace_item(
                        item["id"],
                        item,
                        etag=record.version,
                        match_condition=MatchConditions.IfNotModified,
                        no_response=True,
                    )
            except CosmosHttpResponseError as exc:
                # 409: created by someone else; 412: changed since loaded; 404 on a
                # replace: gone (a missing container fails the read-back instead).
                if exc.status_code in (409, 412) or (
                    exc.status_code == 404 and record.version is not None
                ):
                    return None
                raise
            return _etag_of(result)

        # A version that is not an etag string (from another store) matches nothing.
        sendable = [r for r in records if r.version is None or isinstance(r.version, str)]
        etags = self._cosmos.parallel(write, sendable)
        saved = {r.id: etag for r, etag in zip(sendable, etags, strict=True) if etag}
        refused = [r.id for r, etag in zip(sendable, etags, strict=True) if not etag]
        if refused:
            # Our own write, resent by the SDK and refused the second time, is ours.
            found = self._cosmos.read_many(self, [entity_document_id(eid) for eid in refused])
            for eid in refused:
                item = found.get(entity_document_id(eid))
                if item is not None and item.get("token") == tokens[eid]:
                    self._check_item(item, eid)
                    saved[eid] = str(item["_etag"])
        return saved

    def _scan(self, segment: int, segments: int) -> Iterator[tuple[str, str, Any]]:
        container = self._cosmos.container(self)
        pages = container.query_items(
            "SELECT c.id, c.entity_id, c.body, c._etag FROM c "
            "WHERE c.pending = true AND c.bucket % @segments = @segment",
            parameters=[
                {"name": "@segments", "value": segments},
                {"name": "@segment", "value": segment},
            ],
            enable_cross_partition_query=True,
            max_item_count=_SCAN_PAGE,
        ).by_page()
        for page in pages:
            for item in page:
                yield self._check_item(item), item["body"], str(item["_etag"])
