"""The Cosmos DB entity store: :class:`CosmosEntityStore`, one item per entity.

The URL names the ENTITY container (:func:`create_entity_container`, or ``create=true``). An item:
``id`` (:func:`entity_document_id` of the entity id), ``entity_id`` (as given), ``body`` (the
canonical JSON of state and outbox, as a string), ``bucket`` (``bucket_of(entity id)``, 0..4095),
``pending`` (true when the outbox is not empty) and ``token`` (random, new on every save).

* ``body`` is JSON text, not a nested object: Cosmos DB keeps numbers as IEEE doubles, so an integer
  beyond 2**53 in the state would not round-trip.
* Token: the item's ``_etag``. A new entity is written with ``create_item`` (409: someone created it
  first: a conflict); a loaded one with ``replace_item`` and ``If-Match: <version>`` (412, or 404
  when gone: a conflict). Each write is atomic: nothing is half-written.
* ``save_many`` sends one request per entity (``max_concurrency`` in flight), not a transactional
  batch, which fails as a whole on one conflict. A refused write (409/412) is read back: an item
  carrying this save's ``token`` is this save's own write, resent by the SDK after its first attempt
  succeeded: reported as saved with its ``_etag``. The SDK resends only requests never sent and
  answers meaning "not done" (429, 449, 410, 503 with endpoint discovery), never a write whose
  answer was lost; so the one case left, a resend finding our write already replaced by a third
  writer, is a conflict (a reload shows both).
* ``pending_outboxes(segment, segments)`` is a cross-partition query ``WHERE c.pending = true AND
  c.bucket % @segments = @segment``, page by page (at most 100 items a page): segments follow the
  stored bucket, so they are disjoint and complete for any count (the emulator exposes one feed
  range, so feed ranges cannot be the segments). The container indexes ``/pending`` and ``/bucket``.

Size limit: Cosmos DB refuses a request over 2 MiB of JSON as sent (413). The body travels as a JSON
string inside the item, where every ``"`` and ``\\`` doubles, provided the client writes compact
UTF-8 (``enable_compact_utf8_item_writes``, as the store's own client does; else non-ASCII text
travels as ``\\uXXXX``). Hence ``max_entity_bytes`` = (2 MiB - 16 KiB) // 2 = 1,040,384 bytes of
canonical JSON (a larger entity raises ``EntityTooLarge`` before any I/O), 16 KiB being room for the
id, the entity id (up to 6 KiB escaped), bucket, pending, token and the system properties.
cosmosdb-server (the test emulator) does not enforce the limit; the tests check the item's size.

``_load`` and ``_save`` are written as steps (:mod:`dedupstore.steps`): on the async face they run
on the store's ``azure.cosmos.aio`` twin (:mod:`._aio`), a ``save_many``'s writes as tasks on the
loop; the scan (``pending_outboxes``) stays blocking.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Final

from azure.cosmos import CosmosClient

from dedupstore.backend import (
    ConfigurationError,
    Connected,
    EntityRecord,
    EntityStore,
    Options,
    OptionSet,
    Steps,
    StoreURL,
    client_option,
    io,
    write_token,
)

from ._client import CONNECTION_OPTIONS, ContainerKind, CosmosConnection, side_by_side

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


def entity_document_id(entity_id: str) -> str:
    """The Cosmos DB item id of an entity: the hex SHA-256 of a namespace tag (not the deduplication
    store's) and the UTF-8 entity id."""
    return hashlib.sha256(_ID_NAMESPACE + entity_id.encode("utf-8")).hexdigest()


def create_entity_container(
    client: CosmosClient, database: str, container: str, *, offer_throughput: int | None = None
) -> ContainerProxy:
    """Create ``database`` and an entity ``container`` if missing: no TTL, only what the scan
    filters on (``/pending``, ``/bucket``) indexed. See :mod:`.cosmos` for
    ``offer_throughput`` and errors."""
    return CosmosEntityStore.container_kind.create(client, database, container, offer_throughput)


class CosmosEntityStore(EntityStore):
    """Entities in an Azure Cosmos DB (NoSQL API) container, one item each, versioned by its
    ``_etag`` (:mod:`.cosmos.entities`)."""

    _cosmos = Connected(CosmosConnection)
    max_entity_bytes: ClassVar[int] = (MAX_REQUEST_BYTES - ITEM_OVERHEAD_BYTES) // 2
    max_load_batch: ClassVar[int] = 100
    declared_options: ClassVar[OptionSet] = EntityStore.declared_options.extend(
        *CONNECTION_OPTIONS,
        client_option(  # replaces the connection's, with what this store needs of a client
            "a ready CosmosClient created with enable_compact_utf8_item_writes=True "
            "(key, tls, timeouts and retries are then unused)"
        ),
    )
    container_kind: ClassVar[ContainerKind] = ContainerKind(
        "an entity container",
        "create_entity_container()",
        ("pending", "bucket"),
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
            raise self.make_error(
                ConfigurationError,
                None,
                f"item {item.get('id')!r} of container "
                f"{self._cosmos.container(self).id!r} holds entity {stored!r:.60}, {wanted}: a "
                "container shared with other data (or a SHA-256 collision); give the "
                "entities a container of their own",
            )
        return stored

    def _load(self, ids: list[str]) -> Steps[dict[str, tuple[str, Any]]]:
        found: dict[str, Any] = yield from io(
            self._cosmos.read_many, self, {eid: entity_document_id(eid) for eid in ids}
        )
        for eid, item in found.items():
            self._check_item(item, eid)
        return {eid: (item["body"], str(item["_etag"])) for eid, item in found.items()}

    def _save(self, records: list[EntityRecord]) -> Steps[dict[str, Any]]:
        tokens = {record.id: write_token() for record in records}

        def write(record: EntityRecord) -> Steps[str | None]:
            """The new ``_etag``; ``None`` when refused (or answered without one)."""
            item = self._item(record, tokens[record.id])
            return (yield from io(self._cosmos.write, self, item, record.version))[1]

        # A version that is not an etag string (from another store) matches nothing.
        sendable = [r for r in records if r.version is None or isinstance(r.version, str)]
        etags: list[str | None] = yield from side_by_side(self, (write(r) for r in sendable))
        saved = {r.id: etag for r, etag in zip(sendable, etags, strict=True) if etag}
        refused = [r.id for r, etag in zip(sendable, etags, strict=True) if not etag]
        # Our own write, resent by the SDK and refused the second time, is ours.
        found: dict[str, Any] = yield from io(
            self._cosmos.read_many, self, {eid: entity_document_id(eid) for eid in refused}
        )
        for eid, item in found.items():
            if item.get("token") == tokens[eid]:
                self._check_item(item, eid)
                saved[eid] = str(item["_etag"])
        return saved

    def _scan(self, segment: int, segments: int) -> Iterator[tuple[str, str, Any]]:
        pages = self._cosmos.query(
            self,
            "SELECT c.id, c.entity_id, c.body, c._etag FROM c "
            "WHERE c.pending = true AND c.bucket % @segments = @segment",
            _SCAN_PAGE,
            segments=segments,
            segment=segment,
        ).by_page()
        for page in pages:
            for item in page:
                yield self._check_item(item), item["body"], str(item["_etag"])
