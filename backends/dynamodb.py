"""``dynamodb://<table>?region=…&endpoint_url=…``: Amazon DynamoDB (or a compatible endpoint).

Table layout (``create_table()`` makes it; infrastructure code must match it):
partition key ``pk`` (S) = the message id, sort key ``sk`` (S) = the endpoint. The
pair *is* the key, so no encoding is involved and (endpoint, id) maps injectively to
an item for every valid id and endpoint (ids and endpoints are at most 1024 UTF-8
bytes, the sort-key limit; a single length-prefixed string key would need up to 2054
bytes, over the 2048-byte partition-key limit). Keying the partition by id spreads
the writes of one busy endpoint over the whole table. Other attributes:
``expires_at`` (N, the exact expiry in epoch seconds, only with a retention), ``ttl``
(N, ``ceil(expires_at)``: native TTL reclaims space at the stored expiry, never
earlier) and ``writer`` (B, 16 random bytes naming the call that recorded the item).

Consistency: every read is strongly consistent (``ConsistentRead=True``); there is no
eventually consistent mode. Tables with global-table replicas are refused with
``ConsistencyError`` (a strongly consistent read only sees writes made in its own
Region, and conditional writes in two Regions can both succeed), unless the unsafe
override ``allow_global_table=True`` is passed. Multi-Region strong consistency
(MRSC) tables are refused too: this backend has not been validated on them.

Writes: ``add`` is one conditional ``PutItem``; ``add_many`` sends up to 100
conditional puts per ``TransactWriteItems`` (one round trip per chunk when most ids
are fresh; a transaction costs two write units per item). Condition:
``attribute_not_exists(pk) OR expires_at <= :now``. A cancelled transaction writes
nothing: the ids whose condition failed are already recorded; the others are sent
again in a new transaction (conflicts and throttling back off, boundedly). If a
write committed but its response was lost and botocore retried it, the retry finds
the item already there: the ``writer`` tag (returned with
``ReturnValuesOnConditionCheckFailure=ALL_OLD``) shows it is this call's own write, so
the id is still reported as recorded by this call. Transactions also carry a
``ClientRequestToken`` (real DynamoDB then answers a retry within 10 minutes with
success without writing again; moto ignores the token, the tag covers it).

Reads: ``processed_among`` uses ``BatchGetItem`` (100 keys per request, unprocessed
keys retried with exponential backoff, boundedly); expiry is judged on the client
by comparing ``expires_at`` with the store's clock, so lazy native TTL (and moto,
which ignores TTL) never yields a wrong answer.

``purge_expired`` scans the whole table (strongly consistent ``Scan`` filtered on the
endpoint and ``expires_at <= now``: read units for every item of every endpoint) and
deletes the matches with conditional deletes, up to 100 per transaction (two write
units per item), so a record re-recorded meanwhile is never deleted. With native TTL
enabled (``create_table`` enables it) there is rarely a reason to call it.

Errors: connection failures, timeouts, throttling and 5xx answers (after botocore's
"standard" retries) raise ``StoreUnavailable`` with the botocore error chained;
rejected credentials, a missing region or a missing table raise ``ConfigurationError``.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from decimal import Decimal
from typing import TYPE_CHECKING, Any, ClassVar

import boto3
import botocore.exceptions
from botocore.config import Config

from dedupstore.errors import (
    ConfigurationError,
    ConsistencyError,
    DedupStoreError,
    StoreUnavailable,
)
from dedupstore.store import Clock, DeduplicationStore
from dedupstore.urls import parse_bool, split_url

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
#: Error codes botocore does not retry but a new request after a pause may cure
#: (a write that met an item locked by a concurrent transaction).
_CONFLICT_CODES = frozenset({"TransactionConflictException", "TransactionInProgressException"})
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


def _error_code(exc: botocore.exceptions.ClientError) -> str:
    code = str(exc.response.get("Error", {}).get("Code", ""))
    if code.isdigit():  # an XML error body (a proxy, or moto's IAM emulation)
        found = re.search(r"<Code>([^<]*)</Code>", _raw_message(exc))
        return found.group(1) if found else code
    return code


def _raw_message(exc: botocore.exceptions.ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Message", "")).strip()


def _error_message(exc: botocore.exceptions.ClientError) -> str:
    message = _raw_message(exc)
    if message.startswith("<"):
        found = re.search(r"<Message>([^<]*)</Message>", message)
        message = found.group(1) if found else ""
    return message.splitlines()[0] if message else ""


def _is_auth_error(exc: botocore.exceptions.ClientError) -> bool:
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return _error_code(exc) in _AUTH_ERRORS or status in (401, 403)


def _table_from_url(url: str) -> str:
    parts = split_url(url)
    if parts.scheme != "dynamodb":
        raise ConfigurationError(f"not a dynamodb:// URL: {parts.scheme}://")
    if parts.path not in ("", "/") or parts.username or parts.password or parts.port:
        raise ConfigurationError(
            "a DynamoDB store URL is 'dynamodb://<table>?region=...&endpoint_url=...', "
            f"got a path, port or user in {parts.scheme}://{parts.hostname or ''}..."
        )
    return parts.netloc


class DynamoDBDeduplicationStore(DeduplicationStore):
    """Deduplication store in one DynamoDB table; strongly consistent reads only.

    Safe to share between threads (one low-level boto3 client per process) and to
    pickle (by URL and options; an unpickled copy makes its own client).
    """

    schemes: ClassVar[tuple[str, ...]] = ("dynamodb",)
    max_write_batch: ClassVar[int] = MAX_TRANSACT_ITEMS
    max_read_batch: ClassVar[int] = MAX_BATCH_GET_KEYS
    # Chunks in flight at once: hides the request latency of the service; an id in
    # two chunks at once is settled by DynamoDB's transaction conflict check.
    chunk_concurrency: ClassVar[int] = 4
    url_options: ClassVar[dict[str, Any]] = {
        "region": str,
        "region_name": str,
        "endpoint_url": str,
        "aws_access_key_id": str,
        "aws_secret_access_key": str,
        "aws_session_token": str,
        "connect_timeout": float,
        "read_timeout": float,
        "max_attempts": int,
        "create_table": parse_bool,
        "allow_global_table": parse_bool,
    }

    def __init__(
        self,
        url: str,
        *,
        endpoint: str = "default",
        retention: timedelta | None = None,
        clock: Clock | None = None,
        region: str | None = None,
        region_name: str | None = None,
        endpoint_url: str | None = None,
        aws_access_key_id: str | None = None,
        aws_secret_access_key: str | None = None,
        aws_session_token: str | None = None,
        connect_timeout: float = 5.0,
        read_timeout: float = 10.0,
        max_attempts: int = 5,
        create_table: bool = False,
        allow_global_table: bool = False,
        client: DynamoDBClient | None = None,
    ) -> None:
        """Open the table named by ``url`` and check that it is usable.

        Credentials come from the options or, preferably, from boto3's default chain
        (environment, profile, instance role). ``connect_timeout`` / ``read_timeout``
        (seconds) and ``max_attempts`` (botocore "standard" retry mode, first try
        included) bound how long a call may take before ``StoreUnavailable``.
        ``create_table=True`` creates the table (on-demand billing, TTL on ``ttl``)
        when it is missing. ``allow_global_table=True`` is UNSAFE: it accepts a table
        with replicas in other Regions, whose reads and conditional writes are only
        consistent within one Region. ``client`` is a ready low-level DynamoDB client
        (not pickled; the connection options are then unused).

        Raises ``ConfigurationError`` (bad URL or option, no region, rejected
        credentials, missing table or wrong key schema), ``ConsistencyError`` (global
        table) and ``StoreUnavailable`` (endpoint unreachable).
        """
        self._table = _table_from_url(url)
        if not _TABLE_NAME.fullmatch(self._table):
            raise ConfigurationError(
                "a DynamoDB table name has 3 to 255 characters among A-Z a-z 0-9 _ . -, "
                f"got {self._table!r}"
            )
        if (aws_access_key_id is None) != (aws_secret_access_key is None) or (
            aws_session_token is not None and aws_access_key_id is None
        ):
            raise ConfigurationError(
                "aws_access_key_id and aws_secret_access_key must be given together "
                "(aws_session_token only with both); or leave all three to the default "
                "credential chain"
            )
        if region and region_name and region != region_name:
            raise ConfigurationError(
                f"region={region!r} and region_name={region_name!r} disagree; give one"
            )
        for name, value in (("connect_timeout", connect_timeout), ("read_timeout", read_timeout)):
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ConfigurationError(f"{name} must be a positive number, got {value!r}")
        if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
            raise ConfigurationError(f"max_attempts must be an integer >= 1, got {max_attempts!r}")
        given: dict[str, Any] = {
            "region": region or region_name,
            "endpoint_url": endpoint_url,
            "aws_access_key_id": aws_access_key_id,
            "aws_secret_access_key": aws_secret_access_key,
            "aws_session_token": aws_session_token,
            "connect_timeout": connect_timeout,
            "read_timeout": read_timeout,
            "max_attempts": max_attempts,
            "create_table": create_table,
            "allow_global_table": allow_global_table,
        }
        super().__init__(
            url,
            endpoint=endpoint,
            retention=retention,
            clock=clock,
            options={k: v for k, v in given.items() if v != _DEFAULTS.get(k)},
        )
        self._unavailable_errors = (
            botocore.exceptions.ConnectionError,
            botocore.exceptions.HTTPClientError,
        )
        self._connection = {k: v for k, v in given.items() if k in _CONNECTION_OPTIONS}
        self._allow_global_table = allow_global_table
        self._client_lock = threading.Lock()
        self._own_client = client is None
        self._client_pid = os.getpid()
        self._client_obj: DynamoDBClient = client if client is not None else self._new_client()
        self._region = str(self._client_obj.meta.region_name)
        self._endpoint_value: AttributeValueTypeDef = {"S": self._endpoint}
        try:
            if create_table:
                self.create_table(wait=True)
            self._check_table()
        except BaseException:
            self._close()
            raise

    # ------------------------------------------------------------------ client

    def _new_client(self) -> DynamoDBClient:
        """Build a low-level client from the connection options."""
        c = self._connection
        config = Config(
            retries={"mode": "standard", "max_attempts": int(c["max_attempts"])},
            connect_timeout=c["connect_timeout"],
            read_timeout=c["read_timeout"],
            user_agent_extra="dedupstore",
            # the requests are built here, not by users; validating 100-item
            # transactions client-side costs more CPU than the round trip
            parameter_validation=False,
        )
        try:
            session = boto3.session.Session(
                aws_access_key_id=c["aws_access_key_id"],
                aws_secret_access_key=c["aws_secret_access_key"],
                aws_session_token=c["aws_session_token"],
                region_name=c["region"],
            )
            return session.client("dynamodb", endpoint_url=c["endpoint_url"], config=config)
        except botocore.exceptions.NoRegionError:
            raise ConfigurationError(
                f"no AWS region for DynamoDB table {self._table!r}: add ?region=... to the URL "
                "or set AWS_REGION / AWS_DEFAULT_REGION"
            ) from None
        except ValueError as exc:  # e.g. a malformed endpoint_url
            raise ConfigurationError(f"cannot create the DynamoDB client: {exc}") from None

    @property
    def _client(self) -> DynamoDBClient:
        """This process's client (a new one after ``fork``, unless given by the caller)."""
        if self._own_client and self._client_pid != os.getpid():
            with self._client_lock:
                if self._client_pid != os.getpid():
                    self._client_obj = self._new_client()
                    self._client_pid = os.getpid()
        return self._client_obj

    @property
    def table(self) -> str:
        """The DynamoDB table name."""
        return self._table

    # ------------------------------------------------------------------ table

    def create_table(self, wait: bool = True) -> None:
        """Create the table (on-demand billing) if missing and enable TTL on ``ttl``.

        Idempotent and safe to run from several processes at once; an existing table
        is left as it is (only TTL is switched on if it is off). With ``wait``,
        returns once the table is ACTIVE and TTL enabled; without, returns after
        requesting the creation (TTL needs an ACTIVE table: call again with ``wait``).
        Raises ``ConfigurationError`` (e.g. no permission) and ``StoreUnavailable``.
        """
        client = self._client
        with self._aws_errors("create the table"):
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
            except botocore.exceptions.ClientError as exc:
                if _error_code(exc) != "ValidationException":
                    raise
                # most likely a concurrent update; fine if TTL is on now
                ttl = client.describe_time_to_live(TableName=self._table)["TimeToLiveDescription"]
                if ttl.get("TimeToLiveStatus") not in ("ENABLED", "ENABLING"):
                    raise

    def _describe_table(self) -> TableDescriptionTypeDef:
        try:
            return self._client.describe_table(TableName=self._table)["Table"]
        except botocore.exceptions.ClientError as exc:
            if _error_code(exc) == "ResourceNotFoundException":
                raise ConfigurationError(
                    f"DynamoDB table {self._table!r} does not exist in region {self._region}"
                    f"{self._where()}; create it with create_table=True (URL "
                    f"?create_table=true) or with key schema {_ID} (S, HASH), "
                    f"{_ENDPOINT} (S, RANGE)"
                ) from None
            raise

    def _check_table(self) -> None:
        """Probe the table: it exists, has our key schema and no global replicas."""
        with self._aws_errors("open the table"):
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
                f"DynamoDB table {self._table!r} in region {self._region} has key schema "
                f"{schema}; a deduplication table needs {_ID} (S, HASH) and {_ENDPOINT} "
                "(S, RANGE)"
            )
        replicas = sorted(str(r.get("RegionName")) for r in table.get("Replicas", []))
        if replicas and not self._allow_global_table:
            raise ConsistencyError(
                f"DynamoDB table {self._table!r} is a global table (replicas: "
                f"{', '.join(replicas)}): strongly consistent reads and conditional writes "
                "only hold within one Region, so two Regions could both record an id; "
                "pass allow_global_table=True (UNSAFE) only if every client uses one Region"
            )

    def _where(self) -> str:
        url = self._connection.get("endpoint_url")
        return f" at {url}" if url else ""

    # ------------------------------------------------------------------ errors

    @contextlib.contextmanager
    def _aws_errors(self, operation: str) -> Iterator[None]:
        """Translate botocore errors into ``StoreUnavailable`` / ``ConfigurationError``."""
        try:
            yield
        except DedupStoreError:
            raise
        except botocore.exceptions.ClientError as exc:
            code, message = _error_code(exc), _error_message(exc)
            if _is_auth_error(exc):
                raise ConfigurationError(
                    f"DynamoDB refused the credentials for table {self._table!r} in region "
                    f"{self._region}{self._where()} ({code}: {message}); check the "
                    "credentials (environment, profile or options) and the IAM policy"
                ) from exc
            if code == "ResourceNotFoundException":
                raise ConfigurationError(
                    f"DynamoDB table {self._table!r} does not exist in region "
                    f"{self._region}{self._where()} (it was deleted?): cannot {operation}"
                ) from exc
            raise StoreUnavailable(
                f"{type(self).__name__} at {self.url} could not {operation}: {code}: {message}"
            ) from exc
        except (
            botocore.exceptions.NoCredentialsError,
            botocore.exceptions.PartialCredentialsError,
        ) as exc:
            raise ConfigurationError(
                f"no usable AWS credentials for DynamoDB table {self._table!r}: {exc}; set "
                "them in the environment, a profile or the options"
            ) from exc
        except (
            botocore.exceptions.ConnectionError,
            botocore.exceptions.HTTPClientError,
            botocore.exceptions.WaiterError,
        ) as exc:
            text = str(exc).strip()
            raise StoreUnavailable(
                f"{type(self).__name__} at {self.url} could not {operation}: "
                f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
            ) from exc

    # ------------------------------------------------------------------ primitives

    def _key(self, message_id: str) -> dict[str, AttributeValueTypeDef]:
        return {_ID: {"S": message_id}, _ENDPOINT: self._endpoint_value}

    def _item(
        self, message_id: str, expires_at: float | None, writer: bytes
    ) -> dict[str, AttributeValueTypeDef]:
        item = self._key(message_id)
        item[_WRITER] = {"B": writer}
        if expires_at is not None:
            item[_EXPIRES] = _number(expires_at)
            item[_TTL] = {"N": str(math.ceil(expires_at))}
        return item

    def _add_one(self, message_id: str, now: float, expires_at: float | None) -> bool:
        writer = uuid.uuid4().bytes
        item = self._item(message_id, expires_at, writer)
        values: dict[str, AttributeValueTypeDef] = {":now": _number(now)}
        with self._aws_errors("add"):
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
                except botocore.exceptions.ClientError as exc:
                    code = _error_code(exc)
                    if code == "ConditionalCheckFailedException":
                        old: Mapping[str, Any] = exc.response.get("Item") or {}  # type: ignore[assignment]
                        # our own write, committed by an attempt whose answer was lost
                        return bool(old.get(_WRITER, {}).get("B") == writer)
                    if code not in _CONFLICT_CODES or round_number == _MAX_BACKOFF_ROUNDS:
                        raise
                _backoff(round_number)
        raise AssertionError("unreachable")  # pragma: no cover

    def _add_new(self, ids: list[str], now: float, expires_at: float | None) -> set[str]:
        if len(ids) == 1:
            return set(ids) if self._add_one(ids[0], now, expires_at) else set()
        writer = uuid.uuid4().bytes
        values: dict[str, AttributeValueTypeDef] = {":now": _number(now)}
        operations: list[TransactWriteItemTypeDef] = [
            {
                "Put": {
                    "TableName": self._table,
                    "Item": self._item(mid, expires_at, writer),
                    "ConditionExpression": _ADD_CONDITION,
                    "ExpressionAttributeNames": {"#p": _ID, "#e": _EXPIRES},
                    "ExpressionAttributeValues": values,
                    "ReturnValuesOnConditionCheckFailure": "ALL_OLD",
                }
            }
            for mid in ids
        ]

        def mine(old: Mapping[str, Any]) -> bool:
            return bool(old.get(_WRITER, {}).get("B") == writer)

        with self._aws_errors("add_many"):
            done = self._transact(list(zip(ids, operations, strict=True)), mine)
        return set(done)

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
            except botocore.exceptions.ClientError as exc:
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
                elif reason_code == "None":
                    retry.append((mid, op))
                elif reason_code in _RETRYABLE_REASONS:
                    retry.append((mid, op))
                    throttled = True
                else:
                    raise DedupStoreError(
                        f"{type(self).__name__} at {self.url}: DynamoDB cancelled a "
                        f"transaction on {self._table!r}: {reason_code}: "
                        f"{reason.get('Message', '')}"
                    ) from error
            if throttled or len(retry) == len(pending):
                if stalled >= _MAX_BACKOFF_ROUNDS:
                    raise StoreUnavailable(
                        f"{type(self).__name__} at {self.url}: DynamoDB transactions on "
                        f"{self._table!r} kept being cancelled (conflicts or throttling) "
                        f"after {_MAX_BACKOFF_ROUNDS} attempts"
                    ) from error
                _backoff(stalled)
                stalled += 1
            pending = retry
        return done

    def _find(self, ids: list[str], now: float) -> set[str]:
        found: set[str] = set()
        keys = [self._key(mid) for mid in ids]
        stalled = 0
        with self._aws_errors("read"):
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
        with self._aws_errors("read"):
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
        values: dict[str, AttributeValueTypeDef] = {":now": _number(now)}
        deleted = 0
        start: Mapping[str, Any] | None = None
        with self._aws_errors("purge expired records"):
            while True:
                request: ScanInputTypeDef = {
                    "TableName": self._table,
                    "ConsistentRead": True,
                    "FilterExpression": "#s = :ep AND #e <= :now",
                    "ProjectionExpression": "#p",
                    "ExpressionAttributeNames": {"#p": _ID, "#s": _ENDPOINT, "#e": _EXPIRES},
                    "ExpressionAttributeValues": {**values, ":ep": self._endpoint_value},
                }
                if start:
                    request["ExclusiveStartKey"] = start
                page = self._client.scan(**request)
                expired = [str(item[_ID]["S"]) for item in page.get("Items", [])]
                for first in range(0, len(expired), MAX_TRANSACT_ITEMS):
                    chunk = expired[first : first + MAX_TRANSACT_ITEMS]
                    operations: list[tuple[str, TransactWriteItemTypeDef]] = [
                        (
                            mid,
                            {
                                "Delete": {
                                    "TableName": self._table,
                                    "Key": self._key(mid),
                                    "ConditionExpression": "#e <= :now",
                                    "ExpressionAttributeNames": {"#e": _EXPIRES},
                                    "ExpressionAttributeValues": values,
                                }
                            },
                        )
                        for mid in chunk
                    ]
                    deleted += len(self._transact(operations, lambda old: False))
                start = page.get("LastEvaluatedKey")
                if not start:
                    return deleted

    def _health_warnings(self) -> list[str]:
        warnings: list[str] = []
        with self._aws_errors("check the table"):
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
        if self._own_client:
            self._client_obj.close()


#: Constructor options that shape the client (unused when a ``client`` is given).
_CONNECTION_OPTIONS = frozenset(
    {
        "region",
        "endpoint_url",
        "aws_access_key_id",
        "aws_secret_access_key",
        "aws_session_token",
        "connect_timeout",
        "read_timeout",
        "max_attempts",
    }
)
#: Option values left out of ``repr`` and of the pickled options (they are the defaults).
_DEFAULTS: dict[str, Any] = {
    "region": None,
    "endpoint_url": None,
    "aws_access_key_id": None,
    "aws_secret_access_key": None,
    "aws_session_token": None,
    "connect_timeout": 5.0,
    "read_timeout": 10.0,
    "max_attempts": 5,
    "create_table": False,
    "allow_global_table": False,
}
