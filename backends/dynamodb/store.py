"""The DynamoDB deduplication store: :class:`DynamoDBDeduplicationStore`.

Table layout (``create_table()`` makes it; infrastructure code must match it): partition key ``pk``
(S) = the message id, sort key ``sk`` (S) = the endpoint. The pair *is* the key, so (endpoint, id)
maps injectively to an item with no encoding (both are at most 1024 UTF-8 bytes, the sort-key limit;
one length-prefixed key would need up to 2054 bytes, over the 2048-byte partition-key limit), and
the writes of one busy endpoint spread over the whole table. Other attributes: ``expires_at`` (N,
the exact expiry in epoch seconds, only with a retention), ``ttl`` (N, ``ceil(expires_at +
max_clock_skew)``: native TTL deletes by the service's clock, so it waits as long as
``purge_expired`` would for a client whose clock runs behind) and ``writer`` (S, the write token of
the call that recorded the item).

Expiry is judged by the CLIENT's clock (the ``clock`` option, ``time.time`` by default): every
client of a table must keep its clock in sync (NTP). ``purge_expired`` only deletes records expired
for longer than ``max_clock_skew``, so a client whose clock runs up to that much ahead never deletes
a record another still counts as live.

Writes: ``add`` is one conditional ``PutItem``; ``add_many`` sends up to 100 conditional puts per
``TransactWriteItems`` with a ``ClientRequestToken``. Condition: ``attribute_not_exists(pk) OR
expires_at <= :now``. A cancelled transaction writes nothing: the ids whose condition failed are
already recorded, the others are sent again (conflicts and throttling back off, at most 10 rounds).
An item failing the condition that holds a token of this call (``writer``, returned by
``ReturnValuesOnConditionCheckFailure=ALL_OLD``) is this call's own write whose answer was lost (a
re-sent request, or a retry on the same object after ``StoreUnavailable``): reported as recorded,
exactly once.

Reads: ``processed_among`` uses ``BatchGetItem`` (100 keys per request, unprocessed keys asked
again, boundedly) and compares ``expires_at`` with the client's clock, so lazy native TTL (and moto,
which ignores TTL) never yields a wrong answer. ``purge_expired`` and ``count`` scan the whole table
(the endpoint is the sort key: no ``Query`` reaches one endpoint), filtered on the endpoint and
``expires_at``; ``purge_expired`` deletes the matches with conditional deletes, 100 per transaction.

Options and errors: see :mod:`.dynamodb`. After ``StoreUnavailable`` the ids in its ``unknown`` may
or may not be recorded: retry (on the same object, the ids the failed call wrote are then reported
as recorded). After ``ConfigurationError``, fix the setup: retrying does not help.
"""

from __future__ import annotations

import functools
import math
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import botocore.exceptions as boto_errors

from dedupstore.backend import (
    CLOCK,
    MAX_CLOCK_SKEW,
    Connected,
    DeduplicationStore,
    OptionSet,
    WriteRequest,
    create_option,
    retry,
)

from ._client import (
    _CONFLICT_CODES,
    _MAX_BACKOFF_ROUNDS,
    _RETRYABLE_REASONS,
    CONNECTION_OPTIONS,
    MAX_BATCH_GET_KEYS,
    MAX_TRANSACT_ITEMS,
    DynamoDBConnection,
    TableKind,
    _error_code,
    _number,
    create_table,
)

if TYPE_CHECKING:
    from mypy_boto3_dynamodb.type_defs import AttributeValueTypeDef, TransactWriteItemTypeDef

__all__ = ["DynamoDBDeduplicationStore"]

_ID, _ENDPOINT, _EXPIRES, _TTL, _WRITER = "pk", "sk", "expires_at", "ttl", "writer"
_NAMES = {"#p": _ID, "#e": _EXPIRES}
_ADD_CONDITION = "attribute_not_exists(#p) OR #e <= :now"


def _written_by(old: Mapping[str, Any], request: WriteRequest) -> bool:
    """Whether an item found in place holds a token of ``request`` (its own write)."""
    return old.get(_WRITER, {}).get("S") in request.mine


class DynamoDBDeduplicationStore(DeduplicationStore):
    """Deduplication store in one DynamoDB table (see the module); strongly consistent, expiry by
    the client's clock. Safe to share between threads and to pickle (by URL)."""

    _dynamodb = Connected(DynamoDBConnection)

    max_write_batch: ClassVar[int] = MAX_TRANSACT_ITEMS
    max_read_batch: ClassVar[int] = MAX_BATCH_GET_KEYS
    # hides the service's latency; an id in two chunks at once meets a transaction conflict
    chunk_concurrency: ClassVar[int] = 4
    table_kind: ClassVar[TableKind] = TableKind(
        "a deduplication table", ((_ID, "HASH"), (_ENDPOINT, "RANGE")), _TTL
    )
    declared_options: ClassVar[OptionSet] = DeduplicationStore.declared_options.extend(
        CLOCK,
        MAX_CLOCK_SKEW,
        *CONNECTION_OPTIONS,
        create_option(False, "create the table (on demand, TTL on 'ttl') when missing"),
    )

    def _open(self) -> None:
        self._endpoint_value: AttributeValueTypeDef = {"S": self.endpoint}
        self._dynamodb.open_table(self)

    create_table = create_table

    @property
    def table(self) -> str:
        """The DynamoDB table name."""
        return self.store_url.netloc

    def _key(self, message_id: str) -> dict[str, AttributeValueTypeDef]:
        return {_ID: {"S": message_id}, _ENDPOINT: self._endpoint_value}

    def _item(self, message_id: str, request: WriteRequest) -> dict[str, AttributeValueTypeDef]:
        item = self._key(message_id)
        item[_WRITER] = {"S": request.token}
        if request.expires_at is not None:
            item[_EXPIRES] = _number(request.expires_at)
            item[_TTL] = {"N": str(math.ceil(request.expires_at + self.options["max_clock_skew"]))}
        return item

    def _add_new(self, request: WriteRequest) -> set[str]:
        values: dict[str, AttributeValueTypeDef] = {":now": _number(request.now)}
        if len(request.ids) == 1:
            item = self._item(request.ids[0], request)
            outcome = self._dynamodb.conditional_put(self, item, _ADD_CONDITION, _NAMES, values)
            # a failed condition on an item of ours: a write whose answer was lost
            mine = outcome.written or _written_by(outcome.old, request)
            return set(request.ids) if mine else set()
        operations: list[tuple[str, TransactWriteItemTypeDef]] = [
            (
                mid,
                {
                    "Put": {
                        "TableName": self.table,
                        "Item": self._item(mid, request),
                        "ConditionExpression": _ADD_CONDITION,
                        "ExpressionAttributeNames": _NAMES,
                        "ExpressionAttributeValues": values,
                        "ReturnValuesOnConditionCheckFailure": "ALL_OLD",
                    }
                },
            )
            for mid in request.ids
        ]
        return set(self._transact(operations, lambda old: _written_by(old, request)))

    def _transact(
        self,
        pending: Sequence[tuple[str, TransactWriteItemTypeDef]],
        counts: Callable[[Mapping[str, Any]], bool],
    ) -> list[str]:
        """Run conditional operations (at most 100) until each took effect or failed its condition;
        the ids that took effect or whose failed one ``counts`` (this call's own earlier write). A
        cancelled transaction is sent again without the failed ones (after a pause for a conflict or
        throttling); any other cancellation, or one outlasting ``_MAX_BACKOFF_ROUNDS`` pauses
        (within the deadline), is raised."""
        dynamodb, done = self._dynamodb, list[str]()
        failure: boto_errors.ClientError | None = None

        def one_round() -> bool:
            """Send transactions while they make progress; whether some stalled."""
            nonlocal pending, failure
            while pending:
                try:
                    transact = functools.partial(
                        dynamodb.client.transact_write_items,
                        TransactItems=[op for _, op in pending],
                        ClientRequestToken=str(uuid.uuid4()),  # the same for every attempt
                    )
                    dynamodb.request(self, transact)
                    done.extend(mid for mid, _ in pending)
                    return False
                except boto_errors.ClientError as exc:
                    failure = exc
                code = _error_code(failure)
                reasons: list[Mapping[str, Any]] = list(
                    failure.response.get("CancellationReasons", [])
                )
                if code in _CONFLICT_CODES:
                    return True
                if code != "TransactionCanceledException" or len(reasons) != len(pending):
                    raise failure
                again: list[tuple[str, TransactWriteItemTypeDef]] = []
                throttled = False
                for (mid, op), reason in zip(pending, reasons, strict=True):
                    reason_code = str(reason.get("Code") or "None")
                    if reason_code == "ConditionalCheckFailed":
                        if counts(reason.get("Item") or {}):
                            done.append(mid)
                    elif reason_code == "None" or reason_code in _RETRYABLE_REASONS:
                        again.append((mid, op))
                        throttled = throttled or reason_code != "None"
                    else:
                        raise failure
                stalled = throttled or len(again) == len(pending)
                pending = again
                if stalled and pending:
                    return True
            return False

        if retry(one_round, attempts=_MAX_BACKOFF_ROUNDS + 1, again=bool):
            assert failure is not None
            raise failure
        return done

    def _find(self, ids: list[str], now: float) -> set[str]:
        items = self._dynamodb.batch_get(self, [self._key(mid) for mid in ids], "#p, #e", _NAMES)
        return {str(item[_ID]["S"]) for item in items if self._alive(item, now)}

    def _contains_one(self, message_id: str, now: float) -> bool:
        dynamodb = self._dynamodb
        get = functools.partial(
            dynamodb.client.get_item,
            TableName=self.table,
            Key=self._key(message_id),
            ConsistentRead=True,
            ProjectionExpression="#p, #e",
            ExpressionAttributeNames=_NAMES,
        )
        item = dynamodb.request(self, get).get("Item")
        return item is not None and self._alive(item, now)

    @staticmethod
    def _alive(item: Mapping[str, Any], now: float) -> bool:
        """Whether a stored record counts: no expiry, or an expiry after ``now``."""
        expiry = item.get(_EXPIRES)
        return expiry is None or float(expiry["N"]) > now

    def _purge(self, now: float) -> int:
        values = {":cut": _number(now - self.options["max_clock_skew"])}
        pages = self._dynamodb.scan(
            self,
            FilterExpression="#s = :ep AND #e <= :cut",
            ProjectionExpression="#p",
            ExpressionAttributeNames={"#p": _ID, "#s": _ENDPOINT, "#e": _EXPIRES},
            ExpressionAttributeValues={**values, ":ep": self._endpoint_value},
        )
        deleted = 0
        for page in pages:
            expired = [str(item[_ID]["S"]) for item in page.get("Items", [])]
            for first in range(0, len(expired), MAX_TRANSACT_ITEMS):
                operations: list[tuple[str, TransactWriteItemTypeDef]] = [
                    (
                        mid,
                        {
                            "Delete": {
                                "TableName": self.table,
                                "Key": self._key(mid),
                                "ConditionExpression": "#e <= :cut",
                                "ExpressionAttributeNames": {"#e": _EXPIRES},
                                "ExpressionAttributeValues": values,
                            }
                        },
                    )
                    for mid in expired[first : first + MAX_TRANSACT_ITEMS]
                ]
                deleted += len(self._transact(operations, lambda old: False))
        return deleted

    def _count(self, now: float) -> int:
        """Exact: a consistent ``Scan`` of the whole table (see the module), ``Select=COUNT`` of
        this endpoint's items live by the client's clock, as :meth:`_find` judges."""
        pages = self._dynamodb.scan(
            self,
            Select="COUNT",
            FilterExpression="#s = :ep AND (attribute_not_exists(#e) OR #e > :now)",
            ExpressionAttributeNames={"#s": _ENDPOINT, "#e": _EXPIRES},
            ExpressionAttributeValues={":ep": self._endpoint_value, ":now": _number(now)},
        )
        return sum(int(page.get("Count", 0)) for page in pages)

    def _endpoints(self, now: float) -> set[str]:
        """Exact: a consistent ``Scan`` of the whole table projecting the sort key (the
        endpoint) of the items live by the client's clock, as :meth:`_find` judges."""
        pages = self._dynamodb.scan(
            self,
            ProjectionExpression="#s",
            FilterExpression="attribute_not_exists(#e) OR #e > :now",
            ExpressionAttributeNames={"#s": _ENDPOINT, "#e": _EXPIRES},
            ExpressionAttributeValues={":now": _number(now)},
        )
        return {str(item[_ENDPOINT]["S"]) for page in pages for item in page.get("Items", [])}
