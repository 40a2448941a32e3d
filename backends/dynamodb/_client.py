"""The DynamoDB connection layer shared by the deduplication and the entity store.

:class:`DynamoDBClient` owns what both stores of ``dynamodb://<table>`` do alike:
the URL form and the table name, the connection options, one boto3 client per
process (a new one after ``fork``), error classification, creating and checking
the table (key schema, global-table replicas), batched strongly consistent reads
with bounded retries of unprocessed keys, and conditional ``PutItem`` that tells
its own write (re-sent by botocore after a lost answer) from someone else's.
"""

from __future__ import annotations

import contextlib
import os
import re
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import boto3
import botocore.exceptions as boto_errors
from botocore.config import Config

from backends._http import cut_short
from dedupstore.calls import capped, deadline, retry, time_left
from dedupstore.client import Client, ErrorKind, ProcessLocal
from dedupstore.errors import (
    ConfigurationError,
    ConsistencyError,
    DedupStoreError,
    StoreUnavailable,
)
from dedupstore.options import (
    Option,
    Options,
    boolean,
    client_option,
    connect_timeout_option,
    retries_option,
    text,
    timeout_option,
)
from dedupstore.urls import StoreURL

if TYPE_CHECKING:
    from mypy_boto3_dynamodb.client import DynamoDBClient as Boto3DynamoDB
    from mypy_boto3_dynamodb.type_defs import (
        AttributeValueTypeDef,
        PutItemInputTypeDef,
        ScanInputTypeDef,
        ScanOutputTypeDef,
        TableDescriptionTypeDef,
    )

__all__ = [
    "CONNECTION_OPTIONS",
    "MAX_BATCH_GET_KEYS",
    "MAX_TRANSACT_ITEMS",
    "DynamoDBClient",
    "PutOutcome",
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
#: Error codes botocore does not retry but a new request after a pause may cure
#: (a write that met an item locked by a concurrent transaction). The request was
#: not applied, so sending it again is safe.
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
#: Error codes of requests a later attempt may get through (what botocore's
#: "standard" mode retries: throttling, transient service errors).
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
    """Raise :class:`_CutShort` before botocore parses a reply that is not whole.

    botocore reads a body without checking its length and would parse a cut one as
    an empty answer ("no item"); see :mod:`backends._http`. The ``x-amz-crc32``
    DynamoDB sends is checked too: botocore checks it only to decide on a retry
    of its own, and the store makes those (``total_max_attempts`` 1).
    """
    headers, body = response_dict["headers"], response_dict["body"]
    reason = cut_short(response_dict["status_code"], headers, len(body))
    checksum = headers.get("x-amz-crc32")
    if reason is None and checksum is not None:
        crc = zlib.crc32(body)
        if str(crc) != checksum:
            reason = f"CRC32 {crc} of {len(body)} bytes, not {checksum}"
    if reason is not None:
        raise _CutShort(reason=reason)


def _refusing_cut_replies(client: Boto3DynamoDB) -> Boto3DynamoDB:
    """``client``, with :func:`_refuse_cut_replies` on its replies (registered once)."""
    client.meta.events.register(
        "before-parse.dynamodb", _refuse_cut_replies, unique_id="dedupstore-cut-replies"
    )
    return client


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
    """An item locked by someone's transaction: nothing written, try again later."""
    return isinstance(exc, boto_errors.ClientError) and _error_code(exc) in _CONFLICT_CODES


def _cap_read_timeout(request: Any, **kwargs: Any) -> None:
    """``before-send``: this attempt's read timeout, capped by the call's time left."""
    if time_left() is not None:
        request.context["read_timeout"] = capped(request.context["dedupstore_timeout"])


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
class PutOutcome:
    """What one conditional ``PutItem`` did.

    ``written``: the condition held and the item is stored. Otherwise ``old`` is the
    item that failed the condition (empty when there is none) and ``resent`` says
    whether botocore sent the request more than once: an earlier attempt whose
    answer was lost may then have written the item before the one that failed.
    """

    written: bool
    old: Mapping[str, Any]
    resent: bool


class DynamoDBClient(Client):
    """What both stores of ``dynamodb://<table>`` share: connection, errors, table.

    Subclasses say what their table looks like (:attr:`key_schema`,
    :attr:`ttl_attribute`, :attr:`table_kind`) and add ``create`` to their options.
    Safe to share between threads (one boto3 client per process, a new one after
    ``fork``) and to pickle (by URL and options).
    """

    schemes: ClassVar[tuple[str, ...]] = ("dynamodb",)
    connection_options: ClassVar[tuple[str, ...]] = (
        "region",
        "endpoint_url",
        "aws_access_key_id",
        "aws_secret_access_key",
        "aws_session_token",
        "timeout",
        "connect_timeout",
    )
    #: ``(attribute, key type)`` of the table's key, all of type S.
    key_schema: ClassVar[tuple[tuple[str, str], ...]] = ()
    #: The attribute native TTL deletes by (enabled by ``create_table``), if any.
    ttl_attribute: ClassVar[str | None] = None
    #: What the table is, for messages ("a deduplication table").
    table_kind: ClassVar[str] = ""

    def __init__(self, url: str | StoreURL, /, **options: Any) -> None:
        """Open the table named by ``url`` and check that it is usable.

        Raises ``ConfigurationError`` (bad URL or option, no region, rejected
        credentials, missing table or wrong key schema), ``ConsistencyError`` (global
        table) and ``StoreUnavailable`` (endpoint unreachable or too slow).
        """
        super().__init__(url, **options)
        self._table = self._url.netloc
        given = self._opts["client"]
        # boto3 resolves what the options leave out (region, credentials) from the
        # environment: clients share a connection only when that agrees too.
        environment = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_")))
        self._conn: ProcessLocal[Boto3DynamoDB] = (
            ProcessLocal(lambda: _refusing_cut_replies(given))
            if given is not None
            else self._shared_connection(
                environment, self._new_client, lambda client: client.close()
            )
        )
        with self._opening(None):  # each step classifies its own errors
            if self._creates:
                self.create_table(wait=True)
            self._check_table()

    @classmethod
    def _validate(cls, url: StoreURL, options: Options) -> None:
        """The URL names a valid table and nothing else; credentials come in pairs."""
        super()._validate(url, options)
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

    # ------------------------------------------------------------------ client

    def _new_client(self) -> Boto3DynamoDB:
        """Build this process's low-level client from the connection options."""
        opts = self._opts
        config = Config(
            # retried by the store (_request), within the call's deadline
            retries={"mode": "standard", "total_max_attempts": 1},
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
            client = session.client("dynamodb", endpoint_url=opts["endpoint_url"], config=config)
        except ValueError as exc:  # e.g. a malformed endpoint_url
            raise ConfigurationError(
                self._scrub(f"cannot create the DynamoDB client: {exc}")
            ) from None
        timeout = opts["timeout"]

        def remember_timeout(context: dict[str, Any], **kwargs: Any) -> None:
            context["dedupstore_timeout"] = timeout

        client.meta.events.register("before-call.dynamodb", remember_timeout)
        client.meta.events.register("before-send.dynamodb", _cap_read_timeout)
        return _refusing_cut_replies(client)

    def _deadline_seconds(self) -> float:
        """``connect_timeout + (retries + 1) x timeout``: see :mod:`backends.dynamodb`."""
        opts = self._opts
        return float(opts["connect_timeout"] + (opts["retries"] + 1) * opts["timeout"])

    def _request(self, fn: Callable[[], T]) -> T:
        """``fn()``, one request, retried after a connection error, timeout, throttling
        or 5xx (``retries`` times, within the call's deadline).

        Attempts start, and wait for answers, only until ``connect_timeout`` before
        the call's deadline (and within ``(retries + 1) x timeout``): botocore does
        not let a request shorten its connection timeout, so a last attempt that
        must connect still ends within the deadline.
        """
        opts = self._opts
        budget = (opts["retries"] + 1) * opts["timeout"]
        left = time_left()
        if left is not None:
            budget = min(budget, left - opts["connect_timeout"])
        with deadline(budget):
            return retry(fn, attempts=opts["retries"] + 1, retry_on=_retryable)

    @property
    def _client(self) -> Boto3DynamoDB:
        return self._conn.get()

    @property
    def table(self) -> str:
        """The DynamoDB table name."""
        return self._table

    def _place(self) -> str:
        client = self._conn.peek()
        region = client.meta.region_name if client is not None else self._opts["region"]
        at = self._opts["endpoint_url"]
        return f"DynamoDB table {self._table!r} in region {region}" + (f" at {at}" if at else "")

    def _schema_text(self) -> str:
        return " and ".join(f"{name} (S, {kind})" for name, kind in self.key_schema)

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
                    f"?create=true) or with key schema {self._schema_text()}"
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

    def _cancelled(self, exc: boto_errors.ClientError) -> DedupStoreError:
        """The error for a transaction cancelled for reasons the write loop gave up on."""
        reasons = [
            str(r.get("Code") or "None") for r in exc.response.get("CancellationReasons", [])
        ]
        odd = sorted({r for r in reasons if r not in ("None", "ConditionalCheckFailed")})
        invalid = any(r in _INVALID_REASONS for r in odd)
        hint = "the request or the table is wrong" if invalid else "conflicts or throttling"
        kind = ConfigurationError if invalid else StoreUnavailable
        return self._error(
            kind,
            None,
            f"DynamoDB cancelled a transaction on "
            f"{self._table!r} ({', '.join(odd or reasons) or _error_message(exc)}): {hint}",
        )

    # ------------------------------------------------------------------ table

    def create_table(self, wait: bool = True) -> None:
        """Create the table (on-demand billing) if missing, with this store's key schema.

        A deduplication table also gets native TTL on ``ttl`` (switched on if it is
        off); an entity table has no TTL. Idempotent and safe to run from several
        processes at once; an existing table is otherwise left as it is. With
        ``wait``, returns once the table is ACTIVE (and TTL enabled); without,
        returns after requesting the creation (TTL needs an ACTIVE table: call again
        with ``wait``). Raises ``ConfigurationError`` (e.g. no permission) and
        ``StoreUnavailable``.
        """
        self._check_open()
        with self._translating_errors("create the table"):
            client = self._client
            try:
                self._describe_table()
                exists = True
            except client.exceptions.ResourceNotFoundException:
                exists = False
            if not exists:
                # ResourceInUse: another process is creating it right now
                with contextlib.suppress(client.exceptions.ResourceInUseException):
                    self._request(
                        lambda: client.create_table(
                            TableName=self._table,
                            AttributeDefinitions=[
                                {"AttributeName": name, "AttributeType": "S"}
                                for name, _ in self.key_schema
                            ],
                            KeySchema=[
                                {"AttributeName": name, "KeyType": kind}  # type: ignore[typeddict-item]
                                for name, kind in self.key_schema
                            ],
                            BillingMode="PAY_PER_REQUEST",
                        )
                    )
            if not wait:
                return
            self._wait_active()
            if self.ttl_attribute is not None:
                self._enable_ttl(self.ttl_attribute)

    def _wait_active(self) -> None:
        self._client.get_waiter("table_exists").wait(
            TableName=self._table, WaiterConfig={"Delay": 1, "MaxAttempts": 300}
        )

    def _describe_ttl(self) -> Mapping[str, Any]:
        client = self._client
        answer = self._request(lambda: client.describe_time_to_live(TableName=self._table))
        return answer["TimeToLiveDescription"]

    def _enable_ttl(self, attribute: str) -> None:
        client = self._client
        ttl = self._describe_ttl()
        if ttl.get("TimeToLiveStatus") in ("ENABLED", "ENABLING"):
            return
        try:
            self._request(
                lambda: client.update_time_to_live(
                    TableName=self._table,
                    TimeToLiveSpecification={"Enabled": True, "AttributeName": attribute},
                )
            )
        except boto_errors.ClientError as exc:
            if _error_code(exc) != "ValidationException":
                raise
            # most likely a concurrent update; fine if TTL is on now
            ttl = self._describe_ttl()
            if ttl.get("TimeToLiveStatus") not in ("ENABLED", "ENABLING"):
                raise

    def _describe_table(self) -> TableDescriptionTypeDef:
        client = self._client
        return self._request(lambda: client.describe_table(TableName=self._table))["Table"]

    def _check_table(self) -> None:
        """Probe the table: it exists, has this store's key schema and no replicas."""
        with self._translating_errors("open the table"):
            try:
                table = self._describe_table()
            except boto_errors.ClientError as exc:
                if _error_code(exc) != "ResourceNotFoundException":
                    raise
                raise self._no_such_store(
                    f"{self._place()} does not exist",
                    f"create it with create=True (URL ?create=true) or with key schema "
                    f"{self._schema_text()}",
                ) from exc
            if table.get("TableStatus") == "CREATING":
                self._wait_active()
                table = self._describe_table()
        schema = {k["AttributeName"]: k["KeyType"] for k in table.get("KeySchema", [])}
        types = {
            a["AttributeName"]: a["AttributeType"] for a in table.get("AttributeDefinitions", [])
        }
        if schema != dict(self.key_schema) or any(
            types.get(name) != "S" for name, _ in self.key_schema
        ):
            raise ConfigurationError(
                f"{self._place()} has key schema {schema}; {self.table_kind} needs "
                f"{self._schema_text()}"
            )
        replicas = sorted(str(r.get("RegionName")) for r in table.get("Replicas", []))
        if replicas and not self._opts["allow_global_table"]:
            raise ConsistencyError(
                f"DynamoDB table {self._table!r} is a global table (replicas: "
                f"{', '.join(replicas)}): strongly consistent reads and conditional writes "
                "only hold within one Region, so two Regions could both write one key; "
                "pass allow_global_table=True (UNSAFE) only if every client uses one Region"
            )

    def _health_warnings(self) -> list[str]:
        warnings = super()._health_warnings()
        if self._describe_table().get("Replicas"):
            warnings.append(
                f"table {self._table!r} has global-table replicas and allow_global_table=True: "
                "clients in different Regions can both write one key"
            )
        return warnings

    # ------------------------------------------------------------------ requests

    def _conditional_put(
        self,
        item: Mapping[str, AttributeValueTypeDef],
        condition: str,
        names: Mapping[str, str],
        values: Mapping[str, AttributeValueTypeDef],
    ) -> PutOutcome:
        """One ``PutItem`` of ``item`` if ``condition`` holds (``ALL_OLD`` on failure).

        It may be sent more than once (a timeout, a lost answer: :meth:`_request`):
        the outcome says so. Transaction conflicts (an item locked by someone's
        transaction: nothing written) are retried after a pause, at most
        ``_MAX_BACKOFF_ROUNDS`` times within the deadline, then raised like any
        other error.
        """
        request: PutItemInputTypeDef = {
            "TableName": self._table,
            "Item": item,
            "ConditionExpression": condition,
            "ExpressionAttributeNames": names,
            "ReturnValuesOnConditionCheckFailure": "ALL_OLD",
        }
        if values:  # DynamoDB refuses an empty ExpressionAttributeValues
            request["ExpressionAttributeValues"] = values
        client, resent = self._client, False

        def attempt() -> PutOutcome:
            nonlocal resent
            try:
                response = client.put_item(**request)
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

        return retry(
            lambda: self._request(attempt), attempts=_MAX_BACKOFF_ROUNDS + 1, retry_on=_conflict
        )

    def _batch_get(
        self,
        keys: Sequence[Mapping[str, AttributeValueTypeDef]],
        projection: str,
        names: Mapping[str, str],
    ) -> list[dict[str, Any]]:
        """The items of ``keys`` (at most 100) that exist; strongly consistent.

        Unprocessed keys (throttling, or the 16 MB response limit) are asked again
        after a pause; ``StoreUnavailable`` when some are still left after
        ``_MAX_BACKOFF_ROUNDS`` more rounds, or at the deadline.
        """
        client, found = self._client, list[dict[str, Any]]()
        pending: Sequence[Mapping[str, Any]] = keys

        def one_round() -> bool:
            """Ask for the pending keys; whether some are left unprocessed."""
            nonlocal pending
            asked = {
                self._table: {
                    "Keys": pending,
                    "ConsistentRead": True,
                    "ProjectionExpression": projection,
                    "ExpressionAttributeNames": names,
                }
            }
            response = self._request(lambda: client.batch_get_item(RequestItems=asked))  # type: ignore[arg-type]
            found.extend(response.get("Responses", {}).get(self._table, []))
            unprocessed = response.get("UnprocessedKeys", {}).get(self._table)
            pending = list(unprocessed["Keys"]) if unprocessed else []
            return bool(pending)

        if retry(one_round, attempts=_MAX_BACKOFF_ROUNDS + 1, again=bool):
            raise self._error(
                StoreUnavailable,
                None,
                f"DynamoDB left {len(pending)} keys of {self._table!r} unprocessed after "
                f"{_MAX_BACKOFF_ROUNDS + 1} attempts (throttled)",
            )
        return found

    def _scan_page(self, request: ScanInputTypeDef) -> ScanOutputTypeDef:
        """One page of a ``Scan`` (retried as any request)."""
        client = self._client
        return self._request(lambda: client.scan(**request))

    def _close(self) -> None:
        self._conn.close()
