"""The connection both DynamoDB stores hold (:class:`DynamoDBConnection`) and what they do alike:
URL, deadline, errors, retries, tables (:class:`TableKind`), reads, conditional puts."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import uuid
import zlib
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, cast

import boto3
import botocore.exceptions as boto_errors
from botocore.client import BaseClient
from botocore.config import Config

from dedupstore.backend import (
    Client,
    ConfigurationError,
    Connection,
    ConsistencyError,
    DedupStoreError,
    ErrorKind,
    Option,
    Options,
    StoreUnavailable,
    StoreURL,
    boolean,
    capped,
    check_client,
    client_option,
    connect_timeout_option,
    cut_short,
    deadline,
    part_of,
    retries_option,
    retry,
    scrub,
    text,
    time_left,
    timeout_option,
)

if TYPE_CHECKING:
    from mypy_boto3_dynamodb.client import DynamoDBClient as Boto3DynamoDB
    from mypy_boto3_dynamodb.type_defs import (
        AttributeValueTypeDef,
        PutItemInputTypeDef,
        ScanOutputTypeDef,
        TableDescriptionTypeDef,
        TransactGetItemTypeDef,
        TransactWriteItemTypeDef,
    )

__all__ = [
    "CONNECTION_OPTIONS",
    "MAX_BATCH_GET_KEYS",
    "MAX_TRANSACT_ITEMS",
    "DynamoDBConnection",
    "PutOutcome",
    "TableKind",
    "TransactOutcome",
    "create_table",
]

#: Real DynamoDB limits (moto is laxer: it accepts 26-item BatchWriteItem requests).
MAX_TRANSACT_ITEMS = 100
MAX_BATCH_GET_KEYS = 100

_TABLE_NAME = re.compile(r"[A-Za-z0-9_.-]{3,255}")
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
#: Error codes botocore does not retry but a new request after a pause may cure (a write that met an
#: item locked by a concurrent transaction). Not applied, so safe to send again.
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
#: Error codes of requests a later attempt may get through (what botocore's "standard" mode retries:
#: throttling, transient service errors).
_RETRYABLE_CODES = frozenset(
    {
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottledException",
        "TooManyRequestsException",
        "ProvisionedThroughputExceededException",
        "TransactionInProgressException",
        "RequestLimitExceeded",
        "BandwidthLimitExceeded",
        "LimitExceededException",
        "RequestThrottled",
        "SlowDown",
        "PriorRequestNotComplete",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalServerError",
        "ServiceUnavailable",
    }
)
#: Rounds without progress (conflicts, throttling, unprocessed keys) before giving up.
_MAX_BACKOFF_ROUNDS = 10

T = TypeVar("T")


class _CutShort(boto_errors.IncompleteReadError):
    """A reply that is not whole: retried as a lost answer (:data:`_TRANSIENT_ERRORS`)."""

    fmt = "DynamoDB's reply was cut short: {reason}"


def _refuse_cut_replies(response_dict: Mapping[str, Any], **kwargs: Any) -> None:
    """Raise :class:`_CutShort` before botocore parses a reply that is not whole
    (:mod:`dedupstore.replies`) or fails its ``x-amz-crc32``: botocore checks that only to decide
    on a retry of its own, and the store makes those (``total_max_attempts`` 1)."""
    headers, body = response_dict["headers"], response_dict["body"]
    reason = cut_short(response_dict["status_code"], headers, len(body))
    checksum = headers.get("x-amz-crc32")
    if reason is None and checksum is not None:
        crc = zlib.crc32(body)
        if str(crc) != checksum:
            reason = f"CRC32 {crc} of {len(body)} bytes, not {checksum}"
    if reason is not None:
        raise _CutShort(reason=reason)


def _number(value: float) -> AttributeValueTypeDef:
    """A DynamoDB Number holding exactly ``value`` (shortest round-trip decimal)."""
    return {"N": format(Decimal(repr(float(value))), "f")}


def _retryable(exc: BaseException) -> bool:
    """A failed request that another attempt may get through (it may have been applied)."""
    if isinstance(exc, boto_errors.ClientError):
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        return _error_code(exc) in _RETRYABLE_CODES or int(status) >= 500
    return isinstance(exc, _TRANSIENT_ERRORS)


def _conflict(exc: BaseException) -> bool:
    """An item locked by someone's transaction, or a transaction cancelled only for
    conflicts or throttling: nothing written, try again later."""
    if not isinstance(exc, boto_errors.ClientError):
        return False
    code = _error_code(exc)
    if code == "TransactionCanceledException":
        cancelled = exc.response.get("CancellationReasons", [])
        reasons = {str(r.get("Code") or "None") for r in cancelled}
        return bool(reasons & _RETRYABLE_REASONS) and reasons <= _RETRYABLE_REASONS | {"None"}
    return code in _CONFLICT_CODES


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


def _retry_attempts(response: Mapping[str, Any]) -> int:
    """How often botocore re-sent the request that got ``response``."""
    return int(response.get("ResponseMetadata", {}).get("RetryAttempts") or 0)


def _text(pattern: str, what: str) -> Callable[[object], str | None]:
    """A string matching ``pattern`` (an empty one is refused), or ``None``: not set."""
    convert = text(pattern, what)
    return lambda value: None if value is None else convert(value)


_REGION = _text(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?", "an AWS region (us-east-1)")
_NONEMPTY = _text(r"\S+", "a non-empty string without spaces")

#: The options of every ``dynamodb://`` client (each store adds ``create`` and its own).
CONNECTION_OPTIONS: tuple[Option, ...] = (
    Option("region", _REGION, None, "AWS region (default: AWS_REGION, the profile)"),
    Option(
        "endpoint_url",
        _text(r"https?://\S+", "an http(s):// URL"),
        None,
        "another endpoint (DynamoDB Local, moto)",
    ),
    Option("aws_access_key_id", _NONEMPTY, None, "with aws_secret_access_key; default: chain"),
    Option("aws_secret_access_key", _NONEMPTY, None, "the secret access key", secret=True),
    Option("aws_session_token", _NONEMPTY, None, "a session token", secret=True),
    timeout_option(10.0, "seconds one request may take (read timeout)"),
    connect_timeout_option(5.0),
    retries_option(4, "retries of a failed or throttled request"),
    Option("allow_global_table", boolean, False, "UNSAFE: accept a table with replicas"),
    client_option("a ready boto3 DynamoDB client (the connection options are then unused)"),
)


@dataclass(frozen=True)
class TransactOutcome:
    """What one ``TransactWriteItems`` did: ``written``, or else the ``reasons`` it was cancelled
    for (one per operation: ``None`` or ``ConditionalCheckFailed``, with ``Item``, the stored item,
    where the operation asked for it), and ``resent`` as for :class:`PutOutcome`."""

    written: bool
    reasons: list[Mapping[str, Any]]
    resent: bool


@dataclass(frozen=True)
class PutOutcome:
    """What one conditional ``PutItem`` did: ``written``, or else ``old``, the item that failed the
    condition (empty if none), and ``resent``: the request went out more than once, so an attempt
    whose answer was lost may have written before the one that failed."""

    written: bool
    old: Mapping[str, Any]
    resent: bool


@dataclass(frozen=True)
class TableKind:
    """What a store's table looks like: each store's ``table_kind``."""

    #: What the table is, for messages ("a deduplication table").
    what: str
    #: ``(attribute, key type)`` of the table's key, all of type S.
    key_schema: tuple[tuple[str, str], ...]
    #: The attribute native TTL deletes by (enabled by ``create_table``), if any.
    ttl_attribute: str | None = None

    def schema_text(self) -> str:
        return " and ".join(f"{name} (S, {kind})" for name, kind in self.key_schema)


def _kind(client: Client) -> TableKind:
    return part_of(client, "table_kind", TableKind)


class DynamoDBConnection(Connection):
    """This process's boto3 client for one endpoint and set of credentials, shared by the stores of
    every table there (``self._dynamodb``). Per-table calls take the store: the table from its URL,
    its shape from its ``table_kind``, ``retries`` from its options."""

    schemes: ClassVar[tuple[str, ...]] = ("dynamodb",)
    shaped_by: ClassVar[tuple[str, ...]] = (
        "region",
        "endpoint_url",
        "aws_access_key_id",
        "aws_secret_access_key",
        "aws_session_token",
        "timeout",
        "connect_timeout",
    )

    def __init__(self, url: StoreURL, options: Options) -> None:
        """The given ``client``, or one of our own from the options (no I/O)."""
        super().__init__(url, options)
        given = options["client"]
        self._given = given is not None
        self.client: Boto3DynamoDB = given if self._given else self._new_client()
        self.client.meta.events.register(
            "before-parse.dynamodb", _refuse_cut_replies, unique_id="dedupstore-cut-replies"
        )

    @classmethod
    def address(cls, url: StoreURL, options: Options) -> Hashable:
        """Not the table: the ``AWS_*`` environment, from which boto3 resolves what the options
        leave out (region, credentials)."""
        return tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_")))

    @classmethod
    def validate(cls, url: StoreURL, options: Options) -> None:
        """The URL names a valid table and nothing else; credentials come in pairs; ``client``
        is a boto3 DynamoDB client."""
        if url.path not in ("", "/") or url.fragment or not _TABLE_NAME.fullmatch(url.netloc):
            raise ConfigurationError(
                "a DynamoDB store URL is 'dynamodb://<table>?region=...', the table name 3 "
                f"to 255 characters among A-Z a-z 0-9 _ . -; got {url.masked!r}"
            )
        if (options["aws_access_key_id"] is None) != (options["aws_secret_access_key"] is None) or (
            options["aws_session_token"] is not None and options["aws_access_key_id"] is None
        ):
            raise ConfigurationError(
                "aws_access_key_id and aws_secret_access_key must be given together "
                "(aws_session_token only with both), or none of them"
            )
        check_client(
            options,
            BaseClient,
            "a boto3 DynamoDB client (boto3.client('dynamodb'), not a resource)",
            fits=lambda given: given.meta.service_model.service_name == "dynamodb",
        )

    def _new_client(self) -> Boto3DynamoDB:
        opts = self.options
        config = Config(
            # retried by the store (request), within the call's deadline
            retries={"mode": "standard", "total_max_attempts": 1},
            connect_timeout=opts["connect_timeout"],
            read_timeout=opts["timeout"],
            user_agent_extra="dedupstore",
            # our own requests: validating 100-item transactions costs more than the round trip
            parameter_validation=False,
        )
        session = boto3.session.Session(
            aws_access_key_id=opts["aws_access_key_id"],
            aws_secret_access_key=opts["aws_secret_access_key"],
            aws_session_token=opts["aws_session_token"],
            region_name=opts["region"],
        )
        try:
            client = session.client("dynamodb", endpoint_url=opts["endpoint_url"], config=config)
        except ValueError as exc:  # e.g. a malformed endpoint_url
            raise ConfigurationError(
                scrub(
                    f"cannot create the DynamoDB client: {exc}",
                    (opts["aws_secret_access_key"], opts["aws_session_token"]),
                )
            ) from None

        def cap_read_timeout(request: Any, **kwargs: Any) -> None:
            """``before-send``: this attempt's read timeout, capped by the call's time left."""
            if time_left() is not None:
                request.context["read_timeout"] = capped(opts["timeout"])

        client.meta.events.register("before-send.dynamodb", cap_read_timeout)
        return client

    def request(self, client: Client, fn: Callable[[], T]) -> T:
        """``fn()``, one request of ``client``, retried (its ``retries`` times) after a connection
        error, timeout, throttling or 5xx, until ``connect_timeout`` before the deadline (botocore
        cannot shorten a connection timeout): see :mod:`.dynamodb`."""
        opts = client.options
        budget = (opts["retries"] + 1) * opts["timeout"]
        left = time_left()
        if left is not None:
            budget = min(budget, left - opts["connect_timeout"])
        with deadline(budget):
            return retry(fn, attempts=opts["retries"] + 1, retry_on=_retryable)

    @classmethod
    def _place(cls, client: Client) -> str:
        """``client``'s table, its region (boto3's, once the connection is made) and endpoint."""
        made = client.made_connection
        region = made.client.meta.region_name if isinstance(made, cls) else client.options["region"]
        at = client.options["endpoint_url"]
        place = f"DynamoDB table {client.store_url.netloc!r} in region {region}"
        return place + (f" at {at}" if at else "")

    @classmethod
    def classify_error(cls, client: Client, exc: BaseException) -> ErrorKind:
        if isinstance(exc, boto_errors.ClientError):
            code, message = _error_code(exc), _error_message(exc)
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in _AUTH_ERRORS or status in (401, 403):
                return ConfigurationError(
                    client.scrub(
                        f"DynamoDB refused the credentials for {cls._place(client)} ({code}: "
                        f"{message}); check the credentials (environment, profile or "
                        "options) and the IAM policy"
                    )
                )
            if code == "ResourceNotFoundException":
                return ConfigurationError(
                    f"{cls._place(client)} does not exist; create it with create=True (URL "
                    f"?create=true) or with key schema {_kind(client).schema_text()}"
                )
            if code == "TransactionCanceledException":
                return cls._cancelled(client, exc)
            if code == "ValidationException":
                return ConfigurationError
            # throttling, 5xx, conflicts that outlast the backoff, anything else
            return StoreUnavailable
        if isinstance(exc, _TRANSIENT_ERRORS):
            return StoreUnavailable
        if isinstance(exc, boto_errors.NoRegionError):
            return ConfigurationError(
                f"no AWS region for DynamoDB table {client.store_url.netloc!r}: add ?region=... to "
                "the URL or set AWS_REGION / AWS_DEFAULT_REGION"
            )
        if isinstance(exc, boto_errors.BotoCoreError):  # credentials, profile, config
            return ConfigurationError(
                f"cannot use {cls._place(client)}: {client.describe_error(exc)}; check the AWS "
                "credentials and configuration (environment, profile or options)"
            )
        return None

    @staticmethod
    def _cancelled(client: Client, exc: boto_errors.ClientError) -> DedupStoreError:
        """The error for a transaction cancelled for reasons the write loop gave up on."""
        reasons = [
            str(r.get("Code") or "None") for r in exc.response.get("CancellationReasons", [])
        ]
        odd = sorted({r for r in reasons if r not in ("None", "ConditionalCheckFailed")})
        invalid = any(r in _INVALID_REASONS for r in odd)
        hint = "the request or the table is wrong" if invalid else "conflicts or throttling"
        kind = ConfigurationError if invalid else StoreUnavailable
        return client.make_error(
            kind,
            None,
            f"DynamoDB cancelled a transaction on {client.store_url.netloc!r} "
            f"({', '.join(odd or reasons) or _error_message(exc)}): {hint}",
        )

    def open_table(self, client: Client) -> None:
        """A store's ``_open``: :meth:`create_table` if it creates, then :meth:`check_table`."""
        if client.creates:
            self.create_table(client, wait=True)
        self.check_table(client)

    def create_table(self, client: Client, wait: bool) -> None:
        """Create ``client``'s table if missing: see :func:`create_table`."""
        dynamodb, table, kind = self.client, client.store_url.netloc, _kind(client)
        try:
            self._describe_table(client)
            exists = True
        except dynamodb.exceptions.ResourceNotFoundException:
            exists = False
        if not exists:
            create = functools.partial(
                dynamodb.create_table,
                TableName=table,
                AttributeDefinitions=[
                    {"AttributeName": name, "AttributeType": "S"} for name, _ in kind.key_schema
                ],
                KeySchema=[
                    {"AttributeName": name, "KeyType": key}  # type: ignore[typeddict-item]
                    for name, key in kind.key_schema
                ],
                BillingMode="PAY_PER_REQUEST",
            )
            # ResourceInUse: another process is creating it right now
            with contextlib.suppress(dynamodb.exceptions.ResourceInUseException):
                self.request(client, create)
        if wait:
            self._wait_active(table)
            if kind.ttl_attribute is not None:
                self._enable_ttl(client, kind.ttl_attribute)

    def _wait_active(self, table: str) -> None:
        self.client.get_waiter("table_exists").wait(
            TableName=table, WaiterConfig={"Delay": 1, "MaxAttempts": 300}
        )

    def _describe_ttl(self, client: Client) -> Mapping[str, Any]:
        table = client.store_url.netloc
        answer = self.request(client, lambda: self.client.describe_time_to_live(TableName=table))
        return answer["TimeToLiveDescription"]

    def _enable_ttl(self, client: Client, attribute: str) -> None:
        if self._describe_ttl(client).get("TimeToLiveStatus") in ("ENABLED", "ENABLING"):
            return
        update = functools.partial(
            self.client.update_time_to_live,
            TableName=client.store_url.netloc,
            TimeToLiveSpecification={"Enabled": True, "AttributeName": attribute},
        )
        try:
            self.request(client, update)
        except boto_errors.ClientError as exc:
            if _error_code(exc) != "ValidationException":
                raise
            # most likely a concurrent update; fine if TTL is on now
            if self._describe_ttl(client).get("TimeToLiveStatus") not in ("ENABLED", "ENABLING"):
                raise

    def _describe_table(self, client: Client) -> TableDescriptionTypeDef:
        table = client.store_url.netloc
        return self.request(client, lambda: self.client.describe_table(TableName=table))["Table"]

    def check_table(self, client: Client) -> None:
        """Probe ``client``'s table: it exists, has its key schema and no replicas."""
        kind = _kind(client)
        try:
            table = self._describe_table(client)
        except boto_errors.ClientError as exc:
            if _error_code(exc) != "ResourceNotFoundException":
                raise
            raise client.no_such_store(
                f"{self._place(client)} does not exist",
                f"create it with create=True (URL ?create=true) or with key schema "
                f"{kind.schema_text()}",
            ) from exc
        if table.get("TableStatus") == "CREATING":
            self._wait_active(client.store_url.netloc)
            table = self._describe_table(client)
        schema = {k["AttributeName"]: k["KeyType"] for k in table.get("KeySchema", [])}
        typed = {
            (a["AttributeName"], a["AttributeType"]) for a in table.get("AttributeDefinitions", [])
        }
        if schema != dict(kind.key_schema) or any((name, "S") not in typed for name in schema):
            raise ConfigurationError(
                f"{self._place(client)} has key schema {schema}; {kind.what} needs "
                f"{kind.schema_text()}"
            )
        replicas = sorted(str(r.get("RegionName")) for r in table.get("Replicas", []))
        if replicas and not client.options["allow_global_table"]:
            raise ConsistencyError(
                f"DynamoDB table {client.store_url.netloc!r} is a global table (replicas: "
                f"{', '.join(replicas)}): strongly consistent reads and conditional writes "
                "only hold within one Region, so two Regions could both write one key; "
                "pass allow_global_table=True (UNSAFE) only if every client uses one Region"
            )

    def health_warnings(self, client: Client) -> list[str]:
        """Replicas (allowed by ``allow_global_table``); TTL off or on another attribute."""
        table, warnings = client.store_url.netloc, []
        if self._describe_table(client).get("Replicas"):
            warnings.append(
                f"table {table!r} has global-table replicas and allow_global_table=True: "
                "clients in different Regions can both write one key"
            )
        attribute = _kind(client).ttl_attribute
        if attribute is None:
            return warnings
        ttl = self._describe_ttl(client)
        if ttl.get("TimeToLiveStatus") not in ("ENABLED", "ENABLING"):
            warnings.append(
                f"TTL is not enabled on table {table!r}: expired records stay until "
                f"purge_expired() (enable TTL on attribute {attribute!r})"
            )
        elif ttl.get("AttributeName") != attribute:
            warnings.append(
                f"TTL on table {table!r} uses attribute {ttl.get('AttributeName')!r}, "
                f"not {attribute!r}: expired records stay until purge_expired()"
            )
        return warnings

    def conditional_put(
        self,
        client: Client,
        item: Mapping[str, AttributeValueTypeDef],
        condition: str,
        names: Mapping[str, str],
        values: Mapping[str, AttributeValueTypeDef],
    ) -> PutOutcome:
        """One ``PutItem`` of ``item`` if ``condition`` holds, maybe sent more than once (the
        outcome says so). Transaction conflicts (nothing written) are retried after a pause, at most
        ``_MAX_BACKOFF_ROUNDS`` times within the deadline, then raised."""
        request: PutItemInputTypeDef = {
            "TableName": client.store_url.netloc,
            "Item": item,
            "ConditionExpression": condition,
            "ExpressionAttributeNames": names,
            "ReturnValuesOnConditionCheckFailure": "ALL_OLD",
        }
        if values:  # DynamoDB refuses an empty ExpressionAttributeValues
            request["ExpressionAttributeValues"] = values
        resent = False

        def attempt() -> PutOutcome:
            nonlocal resent
            try:
                response = self.client.put_item(**request)
                return PutOutcome(True, {}, resent or _retry_attempts(response) > 0)
            except boto_errors.ClientError as exc:
                resent = resent or _retry_attempts(exc.response) > 0  # a given client's retries
                if _error_code(exc) == "ConditionalCheckFailedException":
                    return PutOutcome(False, exc.response.get("Item") or {}, resent)  # type: ignore[arg-type]
                resent = resent or _retryable(exc)
                raise
            except _TRANSIENT_ERRORS:
                resent = True  # the request may have reached DynamoDB
                raise

        return self.conflicts_retried(client, attempt)

    def transaction(
        self, client: Client, operations: Sequence[TransactWriteItemTypeDef]
    ) -> TransactOutcome:
        """One ``TransactWriteItems`` of ``operations`` (at most 100), with one
        ``ClientRequestToken`` for every attempt (DynamoDB answers a re-send within ten minutes
        with the first outcome), maybe sent more than once (the outcome says so). A cancellation
        for conditions only is returned with its reasons; conflicts and throttling (nothing
        written) are sent again after a pause, as for :meth:`conditional_put`, then raised."""
        request_token = str(uuid.uuid4())
        resent = False

        def attempt() -> TransactOutcome:
            nonlocal resent
            try:
                response = self.client.transact_write_items(
                    TransactItems=list(operations), ClientRequestToken=request_token
                )
                return TransactOutcome(True, [], resent or _retry_attempts(response) > 0)
            except boto_errors.ClientError as exc:
                resent = resent or _retry_attempts(exc.response) > 0
                if _error_code(exc) == "TransactionCanceledException":
                    reasons = list(exc.response.get("CancellationReasons", []))
                    codes = {str(r.get("Code") or "None") for r in reasons}
                    if len(reasons) == len(operations) and codes <= {
                        "None",
                        "ConditionalCheckFailed",
                    }:
                        return TransactOutcome(False, reasons, resent)  # type: ignore[arg-type]
                resent = resent or _retryable(exc)
                raise
            except _TRANSIENT_ERRORS:
                resent = True  # the request may have reached DynamoDB
                raise

        return self.conflicts_retried(client, attempt)

    def transact_get(
        self, client: Client, gets: Sequence[TransactGetItemTypeDef]
    ) -> list[dict[str, Any] | None]:
        """One ``TransactGetItems`` (at most 100): each item, or ``None`` where there is none, read
        as one serializable snapshot; a cancellation for conflicts is asked again after a pause,
        as for :meth:`conditional_put`."""
        response = self.conflicts_retried(
            client, lambda: self.client.transact_get_items(TransactItems=list(gets))
        )
        return [cast("dict[str, Any] | None", r.get("Item")) for r in response["Responses"]]

    def conflicts_retried(self, client: Client, attempt: Callable[[], T]) -> T:
        """``attempt`` (a write) through :meth:`request`; transaction conflicts (nothing written)
        retried after a pause, at most ``_MAX_BACKOFF_ROUNDS`` times within the deadline."""
        once = functools.partial(self.request, client, attempt)
        return retry(once, attempts=_MAX_BACKOFF_ROUNDS + 1, retry_on=_conflict)

    def delete_item(self, client: Client, key: Mapping[str, AttributeValueTypeDef]) -> None:
        """One unconditional ``DeleteItem`` of ``key`` in ``client``'s table (an absent item is
        no error, so a re-sent delete is safe); conflicts retried as for :meth:`conditional_put`."""
        table = client.store_url.netloc
        self.conflicts_retried(
            client, functools.partial(self.client.delete_item, TableName=table, Key=key)
        )

    def batch_get(
        self,
        client: Client,
        keys: Sequence[Mapping[str, AttributeValueTypeDef]],
        projection: str,
        names: Mapping[str, str],
    ) -> list[dict[str, Any]]:
        """The items of ``keys`` (at most 100) that exist; strongly consistent. Unprocessed keys are
        asked again after a pause; ``StoreUnavailable`` when some are still left after
        ``_MAX_BACKOFF_ROUNDS`` more rounds, or at the deadline."""
        table, found = client.store_url.netloc, list[dict[str, Any]]()
        pending: Sequence[Mapping[str, Any]] = keys

        def one_round() -> bool:
            """Ask for the pending keys; whether some are left unprocessed."""
            nonlocal pending
            asked = {
                table: {
                    "Keys": pending,
                    "ConsistentRead": True,
                    "ProjectionExpression": projection,
                    "ExpressionAttributeNames": names,
                }
            }
            response = self.request(client, lambda: self.client.batch_get_item(RequestItems=asked))  # type: ignore[arg-type]
            found.extend(response.get("Responses", {}).get(table, []))
            unprocessed = response.get("UnprocessedKeys", {}).get(table)
            pending = list(unprocessed["Keys"]) if unprocessed else []
            return bool(pending)

        if retry(one_round, attempts=_MAX_BACKOFF_ROUNDS + 1, again=bool):
            raise client.make_error(
                StoreUnavailable,
                None,
                f"DynamoDB left {len(pending)} keys of {table!r} unprocessed after "
                f"{_MAX_BACKOFF_ROUNDS + 1} attempts (throttled)",
            )
        return found

    def scan(self, client: Client, **request: Any) -> Iterator[ScanOutputTypeDef]:
        """The pages of a strongly consistent ``Scan`` of ``client``'s table (``request``: the other
        parameters), each read when it is needed (and retried as any request)."""
        request.update(TableName=client.store_url.netloc, ConsistentRead=True)
        while True:
            page = self.request(client, lambda: self.client.scan(**request))
            yield page
            if not page.get("LastEvaluatedKey"):
                return
            request["ExclusiveStartKey"] = page["LastEvaluatedKey"]

    def close(self) -> None:
        """Close the boto3 client (not a given ``client``)."""
        if not self._given:
            self.client.close()


def create_table(client: Client, wait: bool = True) -> None:
    """Create the table if missing (on demand, the store's key schema, all of type S) and switch TTL
    on on the store's TTL attribute, if it has one. Idempotent, safe in several processes at once;
    an existing table is otherwise left as it is. With ``wait``, return once it is ACTIVE (and TTL
    is on); without, once its creation is requested (TTL needs an ACTIVE table: call again with
    ``wait``). Raises ``ConfigurationError`` (e.g. no permission) and ``StoreUnavailable``."""
    client.check_open()
    with client.translating_errors("create the table"):
        cast(DynamoDBConnection, client.connection).create_table(client, wait)
