"""The DynamoDB entity store: :class:`DynamoDBEntityStore`.

Table: partition key ``id`` (S) = the entity id, nothing else in the key (``create=true`` or
``create_table()`` makes it: on demand, no TTL). One item per entity: ``id``; ``body`` (S, the
canonical JSON of the state and the outbox); ``version`` (N, the concurrency token: 1 for a new
entity, +1 per save); ``token`` (S, random per save: tells our write from another's); ``pending``
(BOOL ``true``, present only while the outbox is not empty).

Saves: one conditional ``PutItem`` per entity (the whole item: nothing is ever half-written),
``attribute_not_exists(id)`` for a new entity, ``version = :expected`` otherwise. ``save_many`` runs
a chunk's puts (100) in parallel (at most :attr:`DynamoDBEntityStore.save_concurrency`), not as one
``TransactWriteItems``, which fails whole when one condition fails: the entities of a batch are
independent. A put whose condition fails returns the stored item (``ALL_OLD``): if it carries this
save's token, a re-sent put was applied before, and the save counts as written. If the put was
re-sent and the item is another save's holding ``expected + 1`` (or ``1`` for a new entity), that
save made the very step ours wanted, so ours never applied (a conflict); at a later version ours may
have applied and been overwritten since, so the save raises ``StoreUnavailable`` (outcome unknown)
rather than guess. Without a re-send, a failed condition is a plain conflict.

Loads: consistent ``BatchGetItem``, 100 keys per request; unprocessed keys (throttling, the 16 MB
response limit) are asked again, at most 10 rounds, then ``StoreUnavailable``.

Scan (``pending_outboxes``): DynamoDB's own consistent parallel scan, ``Segment=segment,
TotalSegments=segments`` (at most 1,000,000; more is a ``ValueError``), filtered on
``pending = true``, page by page (at most 1 MB each). Segments are DynamoDB's split of the key space
(disjoint and complete; moto splits by the first byte of an MD5 of the key), not
:func:`dedupstore.entities.bucket_of`; a scan reads every item of the segment.

Size limit: DynamoDB refuses items over 400 KB (409,600 bytes), counting attribute names and values.
The attributes other than the body take at most 1,103 bytes (a 1024-byte id, a 38-digit version, the
32-character token, the flag, the names), so :attr:`DynamoDBEntityStore.max_entity_bytes` is 400,000
bytes of JSON: under the service limit with room to spare and under moto's 405,000-byte check.

Options and errors: see :mod:`.dynamodb`; ``StoreUnavailable`` also for an ambiguous re-send, and a
``save_many`` chunk that raises keeps its successful puts (reload to see).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

from dedupstore.backend import (
    Connected,
    EntityRecord,
    EntityStore,
    OptionSet,
    StoreUnavailable,
    create_option,
    fan_out,
    write_token,
)

from ._client import (
    CONNECTION_OPTIONS,
    MAX_BATCH_GET_KEYS,
    DynamoDBConnection,
    TableKind,
    create_table,
)

if TYPE_CHECKING:
    from mypy_boto3_dynamodb.type_defs import AttributeValueTypeDef

__all__ = ["MAX_ITEM_BYTES", "MAX_SCAN_SEGMENTS", "DynamoDBEntityStore"]

_ID, _BODY, _VERSION, _TOKEN, _PENDING = "id", "body", "version", "token", "pending"
_NAMES = {"#i": _ID, "#b": _BODY, "#v": _VERSION}
#: DynamoDB's largest item: attribute names plus values, in bytes.
MAX_ITEM_BYTES = 400 * 1024
#: DynamoDB's largest ``TotalSegments`` of a parallel scan.
MAX_SCAN_SEGMENTS = 1_000_000


class DynamoDBEntityStore(EntityStore):
    """Entities in a DynamoDB table of their own (see the module), one item each, ``version`` the
    token; strongly consistent. Safe to share between threads and to pickle (by URL)."""

    _dynamodb = Connected(DynamoDBConnection)

    #: Largest encoded entity: DynamoDB's 400 KB item minus the other attributes.
    max_entity_bytes: ClassVar[int] = 400_000
    max_load_batch: ClassVar[int] = MAX_BATCH_GET_KEYS
    #: Puts of one ``save_many`` chunk in flight at once (under botocore's 10 connections).
    save_concurrency: ClassVar[int] = 8
    table_kind: ClassVar[TableKind] = TableKind("an entity table", ((_ID, "HASH"),))
    declared_options: ClassVar[OptionSet] = EntityStore.declared_options.extend(
        *CONNECTION_OPTIONS,
        create_option(False, "create the entity table (key 'id', on demand) when missing"),
    )

    def _open(self) -> None:
        self._dynamodb.open_table(self)

    create_table = create_table

    @property
    def table(self) -> str:
        """The DynamoDB table name."""
        return self.store_url.netloc

    def _load(self, ids: list[str]) -> dict[str, tuple[str, Any]]:
        items = self._dynamodb.batch_get(
            self, [{_ID: {"S": eid}} for eid in ids], "#i, #b, #v", _NAMES
        )
        return {
            str(item[_ID]["S"]): (str(item[_BODY]["S"]), int(item[_VERSION]["N"])) for item in items
        }

    def _save(self, records: list[EntityRecord]) -> dict[str, Any]:
        versions = fan_out(self._save_one, records, concurrency=self.save_concurrency)
        return {r.id: v for r, v in zip(records, versions, strict=True) if v is not None}

    def _save_one(self, record: EntityRecord) -> int | None:
        """Put ``record`` if the stored version is ``record.version``: the new version, or ``None``
        for a conflict; ``StoreUnavailable`` for an ambiguous re-send."""
        expected = record.version
        if expected is not None and (type(expected) is not int or expected < 1):
            return None  # no stored version equals it
        new = 1 if expected is None else expected + 1
        token = write_token()
        item: dict[str, AttributeValueTypeDef] = {
            _ID: {"S": record.id},
            _BODY: {"S": record.body},
            _VERSION: {"N": str(new)},
            _TOKEN: {"S": token},
        }
        if record.pending:
            item[_PENDING] = {"BOOL": True}
        if expected is None:
            outcome = self._dynamodb.conditional_put(
                self, item, "attribute_not_exists(#i)", {"#i": _ID}, {}
            )
        else:
            outcome = self._dynamodb.conditional_put(
                self, item, "#v = :expected", {"#v": _VERSION}, {":expected": {"N": str(expected)}}
            )
        if outcome.written:
            return new
        old = outcome.old
        if old.get(_TOKEN, {}).get("S") == token:
            return new  # applied by an attempt whose answer was lost
        stored = int(old[_VERSION]["N"]) if _VERSION in old else None
        if not outcome.resent or not old or stored == new:
            return None  # another save made the step from ``expected``: ours never did
        raise self.make_error(
            StoreUnavailable,
            None,
            f"save of entity {record.id!r:.80} was re-sent after a lost answer and found version "
            f"{stored} written by another save: whether this save was applied before it is "
            "unknown; reload and retry",
        )

    def _scan(self, segment: int, segments: int) -> Iterator[tuple[str, str, Any]]:
        if segments > MAX_SCAN_SEGMENTS:
            raise ValueError(
                f"DynamoDB scans in at most {MAX_SCAN_SEGMENTS} segments, got {segments}"
            )
        pages = self._dynamodb.scan(
            self,
            Segment=segment,
            TotalSegments=segments,
            FilterExpression="#p = :yes",
            ProjectionExpression="#i, #b, #v",
            ExpressionAttributeNames={**_NAMES, "#p": _PENDING},
            ExpressionAttributeValues={":yes": {"BOOL": True}},
        )
        return (
            (str(item[_ID]["S"]), str(item[_BODY]["S"]), int(item[_VERSION]["N"]))
            for page in pages
            for item in page.get("Items", [])
        )
