"""The DynamoDB token store: :class:`DynamoDBTokenStore`.

Table (``create=true`` or ``create_table()`` makes it: on demand, no TTL): partition key ``id`` (S)
= the token id, nothing else in the key; by convention named ``dedup_tokens`` (the URL names it, as
for every DynamoDB store). One item per token: ``id``; ``endpoint`` (S, the receiving endpoint,
verbatim); ``created`` (N, the mint time in epoch seconds by the minting client's clock, exact).
Nothing expires: the table has no TTL and the store never deletes a token it was not asked to.

Creates: one conditional ``PutItem`` per token, ``attribute_not_exists(id)``; a chunk's puts (100)
run in parallel (at most :attr:`DynamoDBTokenStore.write_concurrency`), as the entity store's
``save_many`` does. A failed condition means the token exists (an earlier try of the same creation,
token ids being fresh per mint): left as it is, and the create succeeds.

Reads: ``present_among`` is a consistent ``BatchGetItem``, 100 keys per request; unprocessed keys
are asked again, at most 10 rounds, then ``StoreUnavailable``.

Deletes: one unconditional ``DeleteItem`` per token (idempotent: deleting an absent item succeeds),
a chunk's deletes in parallel like the creates. The connection has no ``BatchWriteItem`` helper and
the per-item requests reuse its retries and the fan-out, so no second unprocessed-items loop.

``scan``: a consistent ``Scan`` of the table projecting the id, ``endpoint`` and ``created``, 1000
items (or 1 MB) a page, each page read as the caller reaches it; ``outstanding``: the same
``Scan``, counted client-side.

Options and errors: see :mod:`.dynamodb`. A chunk of ``create`` or ``delete`` that raises keeps
the puts or deletes that succeeded; the base class reports the chunk as ``unknown``: the same call
again completes it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from dedupstore.backend import (
    ConfigurationError,
    Connected,
    OptionSet,
    TokenRecord,
    TokenStore,
    create_option,
    fan_out,
)

from ._client import (
    CONNECTION_OPTIONS,
    MAX_BATCH_GET_KEYS,
    DynamoDBConnection,
    TableKind,
    _number,
    create_table,
)

if TYPE_CHECKING:
    from mypy_boto3_dynamodb.type_defs import (
        AttributeValueTypeDef,
        ConditionCheckTypeDef,
        DeleteTypeDef,
        GetTypeDef,
        PutTypeDef,
    )

__all__ = ["DynamoDBTokenStore"]

_ID, _ENDPOINT, _CREATED = "id", "endpoint", "created"
_CREATE_CONDITION = "attribute_not_exists(#i)"


class DynamoDBTokenStore(TokenStore):
    """Tokens in a DynamoDB table of their own (see the module), one item each; strongly
    consistent, never expiring. Safe to share between threads and to pickle (by URL)."""

    _dynamodb = Connected(DynamoDBConnection)

    # one BatchGetItem per chunk of present_among
    max_batch: ClassVar[int] = MAX_BATCH_GET_KEYS
    #: Puts or deletes of one chunk in flight at once (under botocore's 10 connections).
    write_concurrency: ClassVar[int] = 8
    table_kind: ClassVar[TableKind] = TableKind("a token table", ((_ID, "HASH"),))
    declared_options: ClassVar[OptionSet] = TokenStore.declared_options.extend(
        *CONNECTION_OPTIONS,
        create_option(False, "create the token table (key 'id', on demand, no TTL) when missing"),
    )

    def _open(self) -> None:
        self._dynamodb.open_table(self)

    create_table = create_table

    @property
    def table(self) -> str:
        """The DynamoDB table name."""
        return self.store_url.netloc

    # ------------------------------------------------------------------ joint calls

    def put(self, record: TokenRecord) -> PutTypeDef:
        """The ``Put`` of a transaction that creates ``record`` (unconditional: the entity's
        conditional put in the same transaction decides whether it is written)."""
        return {"TableName": self.table, "Item": self._item(record)}

    def deletion(self, token_id: str) -> DeleteTypeDef:
        """The ``Delete`` of a transaction that deletes token ``token_id``."""
        return {"TableName": self.table, "Key": {_ID: {"S": token_id}}}

    def required(self, token_id: str) -> ConditionCheckTypeDef:
        """The ``ConditionCheck`` of a transaction that requires token ``token_id`` to exist."""
        return {
            "TableName": self.table,
            "Key": {_ID: {"S": token_id}},
            "ConditionExpression": "attribute_exists(#i)",
            "ExpressionAttributeNames": {"#i": _ID},
        }

    def getter(self, token_id: str) -> GetTypeDef:
        """The ``Get`` of a ``TransactGetItems`` that reads token ``token_id``."""
        return {
            "TableName": self.table,
            "Key": {_ID: {"S": token_id}},
            "ProjectionExpression": "#i, #e, #c",
            "ExpressionAttributeNames": {"#i": _ID, "#e": _ENDPOINT, "#c": _CREATED},
        }

    def is_token(self, item: Mapping[str, Any]) -> bool:
        """Whether ``item`` (read by :meth:`getter`) is a token: ``ConfigurationError`` when
        it is another store's item."""
        self._checked(item)
        return True

    # ------------------------------------------------------------------ primitives

    def _item(self, record: TokenRecord) -> dict[str, AttributeValueTypeDef]:
        return {
            _ID: {"S": record.id},
            _ENDPOINT: {"S": record.endpoint},
            _CREATED: _number(record.created),
        }

    def _create(self, records: list[TokenRecord]) -> None:
        fan_out(self._create_one, records, concurrency=self.write_concurrency)

    def _create_one(self, record: TokenRecord) -> None:
        """Put ``record`` unless its token exists; a failed condition is that token, left as is."""
        item = self._item(record)
        self._dynamodb.conditional_put(self, item, _CREATE_CONDITION, {"#i": _ID}, {})

    def _present(self, ids: list[str]) -> set[str]:
        items = self._dynamodb.batch_get(
            self,
            [{_ID: {"S": tid}} for tid in ids],
            "#i, #e, #c",
            {"#i": _ID, "#e": _ENDPOINT, "#c": _CREATED},
        )
        found = set()
        for item in items:
            self._checked(item)  # an entity's item is never taken for a token
            found.add(str(item[_ID]["S"]))
        return found

    def _delete(self, ids: list[str]) -> None:
        fan_out(self._delete_one, ids, concurrency=self.write_concurrency)

    def _delete_one(self, token_id: str) -> None:
        self._dynamodb.delete_item(self, {_ID: {"S": token_id}})

    def _scan(self) -> Iterator[TokenRecord]:
        """A consistent ``Scan`` of :attr:`page_size` items (at most 1 MB) per request, each
        page asked for when the last one is used up."""
        pages = self._dynamodb.scan(
            self,
            ProjectionExpression="#i, #e, #c",
            ExpressionAttributeNames={"#i": _ID, "#e": _ENDPOINT, "#c": _CREATED},
            Limit=self.page_size,
        )
        for page in pages:
            for item in page.get("Items", []):
                endpoint, created = self._checked(item)
                yield TokenRecord(str(item[_ID]["S"]), endpoint, created)

    def _checked(self, item: Mapping[str, Any]) -> tuple[str, float]:
        """The endpoint and mint time of a token item; ``ConfigurationError`` for an item that
        is not a token (the table is another store's: an entity table has the same key)."""
        try:
            return str(item[_ENDPOINT]["S"]), float(item[_CREATED]["N"])
        except (KeyError, TypeError, ValueError):
            raise self.make_error(
                ConfigurationError,
                None,
                f"item {item.get(_ID, {}).get('S')!r} of table {self.table!r} is not a token "
                "(no endpoint and mint time): the table belongs to another store; give the "
                "token store a table of its own",
            ) from None
