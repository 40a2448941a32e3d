"""``dynamodb://<table>?region=…``: Amazon DynamoDB (or a compatible endpoint).

Table layout (``create_table()`` makes it; infrastructure code must match it):
partition key ``pk`` (S) = the message id, sort key ``sk`` (S) = the endpoint. The
pair *is* the key, so no encoding is involved and (endpoint, id) maps injectively to
an item for every valid id and endpoint (ids and endpoints are at most 1024 UTF-8
bytes, the sort-key limit; a single length-prefixed string key would need up to 2054
bytes, over the 2048-byte partition-key limit). Keying the partition by id spreads
the writes of one busy endpoint over the whole table. Other attributes:
``expires_at`` (N, the exact expiry in epoch seconds, only with a retention), ``ttl``
(N, ``ceil(expires_at + max_clock_skew)``: native TTL deletes by the service's
clock, so it waits as long as ``purge_expired`` would for a client whose clock runs
behind) and ``writer`` (S, the write token of the call that recorded the item).

Consistency: every read is strongly consistent (``ConsistentRead=True``). Tables with
global-table replicas (MRSC tables included) are refused with ``ConsistencyError``
(a strongly consistent read only sees writes made in its own Region, and conditional
writes in two Regions can both succeed), unless ``allow_global_table=True`` (UNSAFE).

Expiry is judged by the CLIENT's clock (the ``clock`` option, ``time.time`` by
default): DynamoDB has no server clock usable in a condition, so every client of a
table must keep its clock in sync (NTP). ``purge_expired`` only deletes records
expired for longer than ``max_clock_skew``, so a client whose clock runs up to that
much ahead never deletes a record another client still counts as live.

Writes: ``add`` is one conditional ``PutItem``; ``add_many`` sends up to 100
conditional puts per ``TransactWriteItems`` (a transaction costs two write units per
item). Condition: ``attribute_not_exists(pk) OR expires_at <= :now``. A cancelled
transaction writes nothing: the ids whose condition failed are already recorded, the
others are sent again (conflicts and throttling back off, at most 10 rounds of up to
2 s). An item that fails the condition but holds a token of this call (``writer``,
returned with ``ReturnValuesOnConditionCheckFailure=ALL_OLD``) is this call's own
write whose answer was lost (botocore's retry, or the caller's retry on the same
store object after ``StoreUnavailable``): it is reported as recorded, exactly once.
Transactions also carry a ``ClientRequestToken``.

Reads: ``processed_among`` uses ``BatchGetItem`` (100 keys per request, unprocessed
keys retried with backoff, boundedly); expiry is judged by comparing ``expires_at``
with the client's clock, so lazy native TTL (and moto, which ignores TTL) never
yields a wrong answer. ``purge_expired`` scans the whole table (read units for every
item of every endpoint) and deletes the matches with conditional deletes, 100 per
transaction; with native TTL (``create_table`` enables it) it is rarely needed.

Options (URL query or keyword; ``clock`` and ``client`` keyword only):

======================  =========  ==================================================
``region``              chain      AWS region (else ``AWS_REGION`` / the profile)
``endpoint_url``        AWS        another endpoint (DynamoDB Local, moto)
``aws_access_key_id``   chain      with ``aws_secret_access_key`` (and optionally
                                   ``aws_session_token``); both secret. Prefer boto3's
                                   default chain (environment, profile, role)
``timeout``             10 s       one HTTP request (botocore read timeout)
``connect_timeout``     5 s        opening a connection
``retries``             4          botocore "standard" retries of a failed request
``create``              false      create the table (on demand, TTL on ``ttl``)
``allow_global_table``  false      UNSAFE: accept a table with replicas
``max_clock_skew``      60 s       purge only records expired for longer than this
``clock``               time.time  epoch-seconds callable judging expiry (tests)
``client``              none       a ready boto3 DynamoDB client (not pickled, not
                                   closed; the connection options are then unused)
======================  =========  ==================================================

One request takes at most ``(retries + 1) * (connect_timeout + timeout)`` plus
botocore's jittered backoff (at most 90 s with the defaults).

Errors, and what a caller may conclude: ``StoreUnavailable`` (connection failure,
timeout, throttling, 5xx, transaction conflicts that outlast the backoff): the ids
in its ``unknown`` may or may not be recorded; retry (on the same object, ids the
failed call wrote are then reported as recorded by the retry). ``ConfigurationError``
(rejected credentials or IAM policy, no credentials, no region, missing table,
wrong key schema, a request DynamoDB rejects as invalid): fix the setup, retrying
does not help. ``ConsistencyError``: a global table.
"""

from __future__ import annotations

import contextlib
import math
import random
import re
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from decimal import Decimal
from typing import TYPE_CHECKING, Any, ClassVar

import boto3
import botocore.exceptions as boto_errors
from botocore.config import Config

from dedupstore.client import ErrorKind, ProcessLocal
from dedupstore.errors import ConfigurationError, ConsistencyError, StoreUnavailable
from dedupstore.options import (
    Option,
    OptionSet,
    boolean,
    client_option,
    connect_timeout_option,
    create_option,
    retries_option,
    text,
    timeout_option,
)
from dedupstore.store import CLOCK, MAX_CLOCK_SKEW, DeduplicationStore, WriteRequest
from dedupstore.urls import StoreURL

if TYPE_CHECKING:
    from mypy_boto3_dynamodb.client import DynamoDBClient
    from mypy_boto3_dynamodb.type_defs import (
        AttributeValueTypeDef,
        ScanInputTypeDef,
        TableDescriptionTypeDef,
        TransactWriteItemTypeDef,
    )

__all__ = ["DynamoDBDeduplicationStore"]

#: Real DynamoDB limits (moto is laxer: it accepts 26-item BatchWriteItem requests).
MAX_TRANSACT_ITEMS = 100
MAX_BATCH_GET_KEYS = 100

_TABLE_NAME = re.compile(r"[A-Za-z0-9_.-]{3,255}")
_ID, _ENDPOINT, _EXPIRES, _TTL, _WRITER = "pk", "sk", "expires_at", "ttl", "writer"
_ADD_CONDITION = "attribute_not_exists(#p) OR #e <= :now"
_AUTH_ERRORS = frozenset(
    {
        "AccessDenied",
        "AccessDeniedException",
        "UnrecognizedClientException",
        "InvalidClientTokenId",
        "InvalidSignatureException",
        "SignatureDoesNotMatch",
        "IncompleteSignature",
        "IncompleteSignatureException",
        "MissingAuthenticationToken",
        "MissingAuthenticationTokenException",
        "ExpiredToken",
        "ExpiredTokenException",
    }
)
#: Cancellation reasons worth another transaction after a pause.
_RETRYABLE_REASONS = frozenset(
    {
        "TransactionConflict",
        "ThrottlingError",
        "ProvisionedThroughputExceeded",
        "RequestLimitExceeded",
    }
)
#: Cancellation reasons that no retry cures: the request or the table is wrong.
_INVALID_REASONS = frozenset({"ValidationError", "ItemCollectionSizeLimitExceeded"})
#: Error codes botocore does not retry but a new request after a pause may cure
#: (a write that met an item locked by a concurrent transaction).
_CONFLICT_CODES = frozenset({"TransactionConflictException", "TransactionInProgressException"})
#: botocore errors that a later attempt may not meet: connection, timeout, checksum.
_TRANSIENT_ERRORS = (
    boto_errors.ConnectionError,
    boto_errors.HTTPClientError,
    boto_errors.WaiterError,
    boto_errors.ChecksumError,
    boto_errors.FlexibleChecksumError,
    boto_errors.IncompleteReadError,
    boto_errors.CapacityNotAvailableError,
)
#: Rounds without progress (conflicts, throttling, unprocessed keys) before giving up.
_MAX_BACKOFF_ROUNDS = 10
_BACKOFF_BASE = 0.025
_BACKOFF_CAP = 2.0


def _number(value: float) -> AttributeValueTypeDef:
    """A DynamoDB Number holding exactly ``value`` (shortest round-trip decimal)."""
    return {"N": format(Decimal(repr(float(value))), "f")}


def _backoff(round_number: int) -> None:
    """Sleep with capped exponential backoff and full jitter."""
    time.sleep(random.uniform(0, min(_BACKOFF_CAP, _BACKOFF_BASE * 2**round_number)))


def _error_code(exc: boto_errors.ClientError) -> str:
    code = str(exc.response.get("Error", {}).get("Code", ""))
    if code.isdigit():  # an XML error body (a proxy, or moto's IAM emulation)
        found = re.search(r"<Code>([^<]*)</Code>", _raw_message(exc))
        return found.group(1) if found else code
    return code


def _raw_message(exc: boto_errors.ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Message", "")).strip()


def _error_message(exc: boto_errors.ClientError) -> str:
    message = _raw_message(exc)
    if message.startswith("<"):
        found = re.search(r"<Message>([^<]*)</Message>", message)
        message = found.group(1) if found else ""
    return message.splitlines()[0] if message else ""


def _written_by(old: Mapping[str, Any], request: WriteRequest) -> bool:
    """Whether an item found in place holds a token of ``request`` (its own write)."""
    return old.get(_WRITER, {}).get("S") in request.mine


def _text(pattern: str, what: str) -> Callable[[object], str | None]:
    """A string matching ``pattern`` (an empty one is refused), or ``None``: not set."""
    convert = text(pattern, what)
    return lambda value: None if value is None else convert(value)


_REGION = _text(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?", "an AWS region (us-east-1)")
_NONEMPTY = _text(r"\S+", "a non-empty string without spaces")


class DynamoDBDeduplicationStore(DeduplicationStore):
    """Deduplication store in one DynamoDB table; strongly consistent reads only.

    Expiry is judged by the client's clock: clients of one table must keep their
    clocks in sync. Safe to share between threads (one boto3 client per process,
    a new one after ``fork``) and to pickle (by URL and options).
    """

    schemes: ClassVar[tuple[str, ...]] = ("dynamodb",)
    max_write_batch: ClassVar[int] = MAX_TRANSACT_ITEMS
    max_read_batch: ClassVar[int] = MAX_BATCH_GET_KEYS
    # Chunks in flight at once: hides the request latency of the service; an id in
    # two chunks at once is settled by DynamoDB's transaction conflict check.
    chunk_concurrency: ClassVar[int] = 4
    declared_options: ClassVar[OptionSet] = DeduplicationStore.declared_options.extend(
        CLOCK,
        MAX_CLOCK_SKEW,
        Option(
            "region",
            _REGION,
            None,
            "AWS region (default: AWS_REGION, the profile)",
            formerly=("region_name",),
        ),
        Option(
            "endpoint_url",
            _text(r"https?://\S+", "an http(s):// URL"),
            None,
            "another endpoint (DynamoDB Local, moto)",
        ),
        Option("aws_access_key_id", _NONEMPTY, None, "with aws_secret_access_key; default: chain"),
        Option("aws_secret_access_key", _NONEMPTY, None, "the secret access key", secret=True),
        Option("aws_session_token", _NONEMPTY, None, "a session token", secret=True),
        timeout_option(
            10.0, "seconds one request may take (read timeout)", formerly=("read_timeout",)
        ),
        connect_timeout_option(5.0),
        retries_option(
            4, "botocore 'standard' retries of a failed request", formerly=("max_attempts",)
        ),
        create_option(
            False,
            "create the table (on demand, TTL on 'ttl') when missing",
            formerly=("create_table",),
        ),
        Option("allow_global_table", boolean, False, "UNSAFE: accept a table with replicas"),
        client_option("a ready boto3 DynamoDB client (the connection options are then unused)"),
    )

    def __init__(self, url: str | StoreURL, /, **options: Any) -> None:
        """Open the table named by ``url`` and check that it is usable.

        Raises ``ConfigurationError`` (bad URL or option, no region, rejected
        credentials, missing table or wrong key schema), ``ConsistencyError`` (global
        table) and ``StoreUnavailable`` (endpoint unreachable or too slow).
        """
        super().__init__(url, **options)
        self._table = self._url.netloc
        if (
            self._url.path not in ("", "/")
            or self._url.fragment
            or not _TABLE_NAME.fullmatch(self._table)
        ):
            raise ConfigurationError(
                "a DynamoDB store URL is 'dynamodb://<table>?region=...', the table name 3 "
                f"to 255 characters among A-Z a-z 0-9 _ . -; got {self.url!r}"
            )
        opts = self._opts
        if (opts["aws_access_key_id"] is None) != (opts["aws_secret_access_key"] is None) or (
            opts["aws_session_token"] is not None and opts["aws_access_key_id"] is None
        ):
            raise ConfigurationError(
                "aws_access_key_id and aws_secret_access_key must be given together "
                "(aws_session_token only with both), or none of them"
            )
        given = opts["client"]
        self._clients: ProcessLocal[DynamoDBClient] = ProcessLocal(
            self._new_client if given is None else lambda: given,
            (lambda client: client.close()) if given is None else None,
        )
        self._endpoint_value: AttributeValueTypeDef = {"S": self._endpoint}
        try:
            if opts["create"]:
                self.create_table(wait=True)
            self._check_table()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ client

    def _new_client(self) -> DynamoDBClient:
        """Build this process's low-level client from the connection options."""
        opts = self._opts
        config = Config(
            # botocore's own "max_attempts" key counts retries only; this one the first try too
            retries={"mode": "standard", "total_max_attempts": opts["retries"] + 1},
            connect_timeout=opts["connect_timeout"],
            read_timeout=opts["timeout"],
            user_agent_extra="dedupstore",
            # the requests are built here, not by users; validating 100-item
            # transactions client-side costs more CPU than the round trip
            parameter_validation=False,
        )
        session = boto3.session.Session(
            aws_access_key_id=opts["aws_access_key_id"],
            aws_secret_access_key=opts["aws_secret_access_key"],
            aws_session_token=opts["aws_session_token"],
            region_name=opts["region"],
        )
        try:
            return session.client("dynamodb", endpoint_url=opts["endpoint_url"], config=config)
        except ValueError as exc:  # e.g. a malformed endpoint_url
            raise ConfigurationError(
                self._scrub(f"cannot create the DynamoDB client: {exc}")
            ) from None

    @property
    def _client(self) -> DynamoDBClient:
        return self._clients.get()

    @property
    def table(self) -> str:
        """The DynamoDB table name."""
        return self._table

    def _place(self) -> str:
        client = self._clients.peek()
        region = client.meta.region_name if client is not None else self._opts["region"]
        at = self._opts["endpoint_url"]
        return f"DynamoDB table {self._table!r} in region {region}" + (f" at {at}" if at else "")

    # ------------------------------------------------------------------ errors

    def _classify_error(self, exc: BaseException) -> ErrorKind:
        if isinstance(exc, boto_errors.ClientError):
            code, message = _error_code(exc), _error_message(exc)
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in _AUTH_ERRORS or status in (401, 403):
                return ConfigurationError(
                    self._scrub(
                        f"DynamoDB refused the credentials for {self._place()} ({code}: "
                        f"{message}); check the credentials (environment, profile or "
                        "options) and the IAM policy"
                    )
                )
            if code == "ResourceNotFoundException":
                return ConfigurationError(
                    f"{self._place()} does not exist; create it with create=True (URL "
                    f"?create=true) or with key schema {_ID} (S, HASH), {_ENDPOINT} (S, RANGE)"
                )
            if code == "TransactionCanceledException":
                return self._cancelled(exc)
            if code == "ValidationException":
                return ConfigurationError
            # throttling, 5xx, conflicts that outlast the backoff, anything else
            return StoreUnavailable
        if isinstance(exc, _TRANSIENT_ERRORS):
            return StoreUnavailable
        if isinstance(exc, boto_errors.NoRegionError):
            return ConfigurationError(
                f"no AWS region for DynamoDB table {self._table!r}: add ?region=... to the "
                "URL or set AWS_REGION / AWS_DEFAULT_REGION"
            )
        if isinstance(exc, boto_errors.BotoCoreError):  # credentials, profile, config
            return ConfigurationError(
                f"cannot use {self._place()}: {self._describe_error(exc)}; check the AWS "
                "credentials and configuration (environment, profile or options)"
            )
        return super()._classify_error(exc)

    def _cancelled(self, exc: boto_errors.ClientError) -> ConfigurationError | StoreUnavailable:
        """The error for a transaction cancelled for reasons the write loop gave up on."""
        reasons = [
            str(r.get("Code") or "None") for r in exc.response.get("CancellationReasons", [])
        ]
        odd = sorted({r for r in reasons if r not in ("None", "ConditionalCheckFailed")})
        invalid = any(r in _INVALID_REASONS for r in odd)
        hint = "the request or the table is wrong" if invalid else "conflicts or throttling"
        kind = ConfigurationError if invalid else StoreUnavailable
        return kind(
            f"{type(self).__name__} at {self.url}: DynamoDB cancelled a transaction on "
            f"{self._table!r} ({', '.join(odd or reasons) or _error_message(exc)}): {hint}"
        )

    # ------------------------------------------------------------------ table

    def create_table(self, wait: bool = True) -> None:
        """Create the table (on-demand billing) if missing and enable TTL on ``ttl``.

        Idempotent and safe to run from several processes at once; an existing table
        is left as it is (only TTL is switched on if it is off). With ``wait``,
        returns once the table is ACTIVE and TTL enabled; without, returns after
        requesting the creation (TTL needs an ACTIVE table: call again with ``wait``).
        Raises ``ConfigurationError`` (e.g. no permission) and ``StoreUnavailable``.
        """
        self._check_open()
        with self._translating_errors("create the table"):
            client = self._client
            try:
                client.describe_table(TableName=self._table)
                exists = True
            except client.exceptions.ResourceNotFoundException:
                exists = False
            if not exists:
                # ResourceInUse: another process is creating it right now
                with contextlib.suppress(client.exceptions.ResourceInUseException):
                    client.create_table(
                        TableName=self._table,
                        AttributeDefinitions=[
                            {"AttributeName": _ID, "AttributeType": "S"},
                            {"AttributeName": _ENDPOINT, "AttributeType": "S"},
                        ],
                        KeySchema=[
                            {"AttributeName": _ID, "KeyType": "HASH"},
                            {"AttributeName": _ENDPOINT, "KeyType": "RANGE"},
                        ],
                        BillingMode="PAY_PER_REQUEST",
                    )
            if not wait:
                return
            client.get_waiter("table_exists").wait(
                TableName=self._table, WaiterConfig={"Delay": 1, "MaxAttempts": 300}
            )
            ttl = client.describe_time_to_live(TableName=self._table)["TimeToLiveDescription"]
            if ttl.get("TimeToLiveStatus") in ("ENABLED", "ENABLING"):
                return
            try:
                client.update_time_to_live(
                    TableName=self._table,
                    TimeToLiveSpecification={"Enabled": True, "AttributeName": _TTL},
                )
            except boto_errors.ClientError as exc:
                if _error_code(exc) != "ValidationException":
                    raise
                # most likely a concurrent update; fine if TTL is on now
                ttl = client.describe_time_to_live(TableName=self._table)["TimeToLiveDescription"]
                if ttl.get("TimeToLiveStatus") not in ("ENABLED", "ENABLING"):
                    raise

    def _describe_table(self) -> TableDescriptionTypeDef:
        return self._client.describe_table(TableName=self._table)["Table"]

    def _check_table(self) -> None:
        """Probe the table: it exists, has our key schema and no global replicas."""
        with self._translating_errors("open the table"):
            table = self._describe_table()
            if table.get("TableStatus") == "CREATING":
                self._client.get_waiter("table_exists").wait(
                    TableName=self._table, WaiterConfig={"Delay": 1, "MaxAttempts": 300}
                )
                table = self._describe_table()
        schema = {k["AttributeName"]: k["KeyType"] for k in table.get("KeySchema", [])}
        types = {
            a["AttributeName"]: a["AttributeType"] for a in table.get("AttributeDefinitions", [])
        }
        if schema != {_ID: "HASH", _ENDPOINT: "RANGE"} or any(
            types.get(name) != "S" for name in (_ID, _ENDPOINT)
        ):
            raise ConfigurationError(
                f"{self._place()} has key schema {schema}; a deduplication table needs "
                f"{_ID} (S, HASH) and {_ENDPOINT} (S, RANGE)"
            )
        replicas = sorted(str(r.get("RegionName")) for r in table.get("Replicas", []))
        if replicas and not self._opts["allow_global_table"]:
            raise ConsistencyError(
                f"DynamoDB table {self._table!r} is a global table (replicas: "
                f"{', '.join(replicas)}): strongly consistent reads and conditional writes "
                "only hold within one Region, so two Regions could both record an id; "
                "pass allow_global_table=True (UNSAFE) only if every client uses one Region"
            )

    # ------------------------------------------------------------------ primitives

    def _key(self, message_id: str) -> dict[str, AttributeValueTypeDef]:
        return {_ID: {"S": message_id}, _ENDPOINT: self._endpoint_value}

    def _item(self, message_id: str, request: WriteRequest) -> dict[str, AttributeValueTypeDef]:
        item = self._key(message_id)
        item[_WRITER] = {"S": request.token}
        if request.expires_at is not None:
            item[_EXPIRES] = _number(request.expires_at)
            # native TTL deletes by the service's clock: leave the same slack as purge_expired
            slack = self._opts["max_clock_skew"]
            item[_TTL] = {"N": str(math.ceil(request.expires_at + slack))}
        return item

    def _add_one(self, request: WriteRequest) -> bool:
        item = self._item(request.ids[0], request)
        values: dict[str, AttributeValueTypeDef] = {":now": _number(request.now)}
        for round_number in range(_MAX_BACKOFF_ROUNDS + 1):
            try:
                self._client.put_item(
                    TableName=self._table,
                    Item=item,
                    ConditionExpression=_ADD_CONDITION,
                    ExpressionAttributeNames={"#p": _ID, "#e": _EXPIRES},
                    ExpressionAttributeValues=values,
                    ReturnValuesOnConditionCheckFailure="ALL_OLD",
                )
                return True
            except boto_errors.ClientError as exc:
                code = _error_code(exc)
                if code == "ConditionalCheckFailedException":
                    # our own write, committed by an attempt whose answer was lost
                    return _written_by(exc.response.get("Item") or {}, request)  # type: ignore[arg-type]
                if code not in _CONFLICT_CODES or round_number == _MAX_BACKOFF_ROUNDS:
                    raise
            _backoff(round_number)
        raise AssertionError("unreachable")  # pragma: no cover

    def _add_new(self, request: WriteRequest) -> set[str]:
        if len(request.ids) == 1:
            return set(request.ids) if self._add_one(request) else set()
        values: dict[str, AttributeValueTypeDef] = {":now": _number(request.now)}
        operations: list[tuple[str, TransactWriteItemTypeDef]] = [
            (
                mid,
                {
                    "Put": {
                        "TableName": self._table,
                        "Item": self._item(mid, request),
                        "ConditionExpression": _ADD_CONDITION,
                        "ExpressionAttributeNames": {"#p": _ID, "#e": _EXPIRES},
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
        """Run conditional operations (at most 100) until each succeeded or failed its
        condition; return the ids whose operation took effect.

        A cancelled transaction changes nothing: operations that failed their
        condition are dropped (reported as done when ``counts(old_item)`` says the
        item is this call's own earlier write), the rest go out again in a new
        transaction, after a pause if the cancellation was a conflict or throttling.
        Any other cancellation, or one that outlasts the backoff, is raised (the
        error hook classifies it).
        """
        done: list[str] = []
        stalled = 0
        while pending:
            try:
                self._client.transact_write_items(
                    TransactItems=[op for _, op in pending],
                    ClientRequestToken=str(uuid.uuid4()),
                )
                done.extend(mid for mid, _ in pending)
                return done
            except boto_errors.ClientError as exc:
                error = exc
            code = _error_code(error)
            reasons: list[Mapping[str, Any]] = list(error.response.get("CancellationReasons", []))
            if code in _CONFLICT_CODES and stalled < _MAX_BACKOFF_ROUNDS:
                _backoff(stalled)
                stalled += 1
                continue
            if code != "TransactionCanceledException" or len(reasons) != len(pending):
                raise error
            retry: list[tuple[str, TransactWriteItemTypeDef]] = []
            throttled = False
            for (mid, op), reason in zip(pending, reasons, strict=True):
                reason_code = str(reason.get("Code") or "None")
                if reason_code == "ConditionalCheckFailed":
                    if counts(reason.get("Item") or {}):
                        done.append(mid)
                elif reason_code == "None" or reason_code in _RETRYABLE_REASONS:
                    retry.append((mid, op))
                    throttled = throttled or reason_code != "None"
                else:
                    raise error
            if throttled or len(retry) == len(pending):
                if stalled >= _MAX_BACKOFF_ROUNDS:
                    raise error
                _backoff(stalled)
                stalled += 1
            pending = retry
        return done

    def _find(self, ids: list[str], now: float) -> set[str]:
        found: set[str] = set()
        keys = [self._key(mid) for mid in ids]
        stalled = 0
        while keys:
            response = self._client.batch_get_item(
                RequestItems={
                    self._table: {
                        "Keys": keys,
                        "ConsistentRead": True,
                        "ProjectionExpression": "#p, #e",
                        "ExpressionAttributeNames": {"#p": _ID, "#e": _EXPIRES},
                    }
                }
            )
            for item in response.get("Responses", {}).get(self._table, []):
                if self._alive(item, now):
                    found.add(str(item[_ID]["S"]))
            unprocessed = response.get("UnprocessedKeys", {}).get(self._table)
            left = list(unprocessed["Keys"]) if unprocessed else []
            if left:
                if stalled >= _MAX_BACKOFF_ROUNDS:
                    raise StoreUnavailable(
                        f"{type(self).__name__} at {self.url}: DynamoDB left {len(left)} "
                        f"keys of {self._table!r} unprocessed after {_MAX_BACKOFF_ROUNDS} "
                        "attempts (throttled)"
                    )
                _backoff(stalled)
                stalled += 1
            keys = left
        return found

    def _contains_one(self, message_id: str, now: float) -> bool:
        response = self._client.get_item(
            TableName=self._table,
            Key=self._key(message_id),
            ConsistentRead=True,
            ProjectionExpression="#p, #e",
            ExpressionAttributeNames={"#p": _ID, "#e": _EXPIRES},
        )
        item = response.get("Item")
        return item is not None and self._alive(item, now)

    @staticmethod
    def _alive(item: Mapping[str, Any], now: float) -> bool:
        """Whether a stored record counts: no expiry, or an expiry after ``now``."""
        expiry = item.get(_EXPIRES)
        return expiry is None or float(expiry["N"]) > now

    def _purge(self, now: float) -> int:
        # Only records expired for longer than max_clock_skew: a client whose clock
        # runs ahead must not delete a record that others still count as live.
        values: dict[str, AttributeValueTypeDef] = {
            ":cut": _number(now - self._opts["max_clock_skew"])
        }
        deleted = 0
        start: Mapping[str, Any] | None = None
        while True:
            request: ScanInputTypeDef = {
                "TableName": self._table,
                "ConsistentRead": True,
                "FilterExpression": "#s = :ep AND #e <= :cut",
                "ProjectionExpression": "#p",
                "ExpressionAttributeNames": {"#p": _ID, "#s": _ENDPOINT, "#e": _EXPIRES},
                "ExpressionAttributeValues": {**values, ":ep": self._endpoint_value},
            }
            if start:
                request["ExclusiveStartKey"] = start
            page = self._client.scan(**request)
            expired = [str(item[_ID]["S"]) for item in page.get("Items", [])]
            for first in range(0, len(expired), MAX_TRANSACT_ITEMS):
                operations: list[tuple[str, TransactWriteItemTypeDef]] = [
                    (
                        mid,
                        {
                            "Delete": {
                                "TableName": self._table,
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
            start = page.get("LastEvaluatedKey")
            if not start:
                return deleted

    def _health_warnings(self) -> list[str]:
        warnings: list[str] = []
        table = self._describe_table()
        ttl = self._client.describe_time_to_live(TableName=self._table)["TimeToLiveDescription"]
        if table.get("Replicas"):
            warnings.append(
                f"table {self._table!r} has global-table replicas and allow_global_table=True: "
                "an id may be recorded twice by clients in different Regions"
            )
        if ttl.get("TimeToLiveStatus") not in ("ENABLED", "ENABLING"):
            warnings.append(
                f"TTL is not enabled on table {self._table!r}: expired records stay until "
                f"purge_expired() (enable TTL on attribute {_TTL!r})"
            )
        elif ttl.get("AttributeName") != _TTL:
            warnings.append(
                f"TTL on table {self._table!r} uses attribute {ttl.get('AttributeName')!r}, "
                f"not {_TTL!r}: expired records stay until purge_expired()"
            )
        return warnings

    def _close(self) -> None:
        self._clients.close()
