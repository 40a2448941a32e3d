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

With a token store of the same connection (:class:`~.tokens.DynamoDBTokenStore`, ``token_joins``):
the joint load is one ``TransactGetItems`` of the entity's item and the token's (one serializable
snapshot); a joint save is one ``TransactWriteItems`` per entity (in parallel, as the puts of
``save_many``): a ``ConditionCheck`` that the required token exists, the conditional put, a ``Put``
per token created and a ``Delete`` per token deleted (at most 99 token operations:
``max_joint_tokens``). Its ``ClientRequestToken`` makes a re-send within ten minutes answer with
the first outcome; later, the put's condition cancels it and the stored item's write token tells an
earlier attempt of this save (counted as saved, its tokens not written again) from another save.

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

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from dedupstore.backend import (
    Connected,
    EntityRecord,
    EntityStore,
    OptionSet,
    StoreUnavailable,
    TokenStore,
    TokenWrites,
    create_option,
    fan_out,
    write_token,
)

from ._client import (
    CONNECTION_OPTIONS,
    MAX_BATCH_GET_KEYS,
    MAX_TRANSACT_ITEMS,
    DynamoDBConnection,
    TableKind,
    create_table,
)
from .tokens import DynamoDBTokenStore

if TYPE_CHECKING:
    from mypy_boto3_dynamodb.type_defs import (
        AttributeValueTypeDef,
        GetTypeDef,
        PutTypeDef,
        TransactWriteItemTypeDef,
    )

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
    token_joins = DynamoDBTokenStore
    #: A joint save is one transaction: the entity's put and at most 99 token operations.
    max_joint_tokens: ClassVar[int | None] = MAX_TRANSACT_ITEMS - 1
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
        put = self._put(record)
        if put is None:
            return None
        item, condition, names, values, new = put
        outcome = self._dynamodb.conditional_put(self, item, condition, names, values)
        if outcome.written:
            return new
        return self._failed(record, new, item[_TOKEN]["S"], outcome.old, outcome.resent)

    def _put(
        self, record: EntityRecord
    ) -> (
        tuple[
            dict[str, AttributeValueTypeDef],
            str,
            dict[str, str],
            dict[str, AttributeValueTypeDef],
            int,
        ]
        | None
    ):
        """The item, condition, names and values of ``record``'s conditional put, and the version
        it writes; ``None`` when no stored version can equal ``record.version`` (a conflict)."""
        expected = record.version
        if expected is not None and (type(expected) is not int or expected < 1):
            return None
        new = 1 if expected is None else expected + 1
        item: dict[str, AttributeValueTypeDef] = {
            _ID: {"S": record.id},
            _BODY: {"S": record.body},
            _VERSION: {"N": str(new)},
            _TOKEN: {"S": write_token()},
        }
        if record.pending:
            item[_PENDING] = {"BOOL": True}
        if expected is None:
            return item, "attribute_not_exists(#i)", {"#i": _ID}, {}, new
        values: dict[str, AttributeValueTypeDef] = {":expected": {"N": str(expected)}}
        return item, "#v = :expected", {"#v": _VERSION}, values, new

    def _failed(
        self, record: EntityRecord, new: int, token: str, old: Mapping[str, Any], resent: bool
    ) -> int | None:
        """A put whose condition failed on ``old`` (the stored item): ``new`` when ``old`` holds
        this put's ``token`` (an attempt whose answer was lost applied it), ``None`` for a
        conflict; ``StoreUnavailable`` when a re-sent put meets another save's later version."""
        if old.get(_TOKEN, {}).get("S") == token:
            return new  # applied by an attempt whose answer was lost
        stored = int(old[_VERSION]["N"]) if _VERSION in old else None
        if not resent or not old or stored == new:
            return None  # another save made the step from ``expected``: ours never did
        raise self.make_error(
            StoreUnavailable,
            None,
            f"save of entity {record.id!r:.80} was re-sent after a lost answer and found version "
            f"{stored} written by another save: whether this save was applied before it is "
            "unknown; reload and retry",
        )

    # ------------------------------------------------------------------ with a token store

    def _load_with_token(
        self, tokens: TokenStore, entity_id: str, token_id: str
    ) -> tuple[tuple[str, Any] | None, bool]:
        """One ``TransactGetItems`` of the entity's item and the token's: one serializable
        snapshot of both, as good as a read after the load."""
        assert isinstance(tokens, DynamoDBTokenStore)
        get: GetTypeDef = {
            "TableName": self.table,
            "Key": {_ID: {"S": entity_id}},
            "ProjectionExpression": "#i, #b, #v",
            "ExpressionAttributeNames": _NAMES,
        }
        entity, token = self._dynamodb.transact_get(
            self,
            [{"Get": get}, {"Get": tokens.getter(token_id)}],
        )
        found = None if entity is None else (str(entity[_BODY]["S"]), int(entity[_VERSION]["N"]))
        return found, token is not None and tokens.is_token(token)

    def _save_tokens(
        self,
        tokens: TokenStore,
        records: list[EntityRecord],
        writes: Mapping[str, TokenWrites],
    ) -> tuple[set[str], dict[str, Any]]:
        """One ``TransactWriteItems`` per record (in parallel, as :meth:`_save` runs its puts):
        a ``ConditionCheck`` that the required token exists, the conditional put, then a ``Put``
        per token created and a ``Delete`` per token deleted, all or nothing. A record without
        token writes is a plain put."""
        assert isinstance(tokens, DynamoDBTokenStore)

        def one(record: EntityRecord) -> tuple[str, int | None]:
            change = writes.get(record.id)
            if change is None:
                return "saved", self._save_one(record)
            return self._save_with_tokens(tokens, record, change)

        outcomes = fan_out(one, records, concurrency=self.save_concurrency)
        missing = {
            r.id for r, (what, _) in zip(records, outcomes, strict=True) if what == "missing"
        }
        saved = {
            r.id: version
            for r, (_, version) in zip(records, outcomes, strict=True)
            if version is not None
        }
        return missing, saved

    def _save_with_tokens(
        self, tokens: DynamoDBTokenStore, record: EntityRecord, change: TokenWrites
    ) -> tuple[str, int | None]:
        """``("saved", version)``, ``("missing", None)`` or ``("conflict", None)`` for one record
        and its token writes in one transaction."""
        put = self._put(record)
        if put is None:
            return "conflict", None
        item, condition, names, values, new = put
        entity: PutTypeDef = {
            "TableName": self.table,
            "Item": item,
            "ConditionExpression": condition,
            "ExpressionAttributeNames": names,
            "ReturnValuesOnConditionCheckFailure": "ALL_OLD",
        }
        if values:
            entity["ExpressionAttributeValues"] = values
        operations: list[TransactWriteItemTypeDef] = []
        if change.require is not None:
            operations.append({"ConditionCheck": tokens.required(change.require)})
        operations.append({"Put": entity})
        operations += [{"Put": tokens.put(made)} for made in change.create]
        operations += [{"Delete": tokens.deletion(tid)} for tid in change.delete]
        outcome = self._dynamodb.transaction(self, operations)
        if outcome.written:
            return "saved", new
        at = 1 if change.require is not None else 0
        reason = outcome.reasons[at]
        if str(reason.get("Code")) == "ConditionalCheckFailed":
            old = reason.get("Item") or {}
            version = self._failed(record, new, item[_TOKEN]["S"], old, outcome.resent)
            if version is not None:
                return "saved", version
        if at and str(outcome.reasons[0].get("Code")) == "ConditionalCheckFailed":
            return "missing", None
        return "conflict", None

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
