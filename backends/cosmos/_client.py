"""The connection layer both Cosmos DB stores share: :class:`CosmosClientBase`.

Options, the ``cosmos://`` URL, client creation (timeouts, retries, transport), the
account's consistency check, the container check (it exists and is partitioned on
``/id``; created with ``create=true``), error classification, secret masking,
read-many and bounded parallel requests. The deduplication store
(:mod:`backends.cosmos.store`) and the entity store (:mod:`backends.cosmos.entities`)
add their item layout and their requests.
"""

from __future__ import annotations

import binascii
import contextlib
import json
import logging
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Final, TypeVar
from urllib.parse import unquote

import requests
import urllib3
from azure.core.exceptions import AzureError, HttpResponseError, ServiceResponseError
from azure.core.pipeline.transport import RequestsTransport
from azure.cosmos import CosmosClient
from azure.cosmos.documents import ConnectionPolicy
from azure.cosmos.exceptions import CosmosHttpResponseError
from urllib3.util.retry import Retry

from backends._http import cut_short
from dedupstore.calls import DeadlinePassed, executor, fan_out, time_left
from dedupstore.client import Client, ErrorKind, ProcessLocal
from dedupstore.errors import ConfigurationError, ConsistencyError, StoreUnavailable
from dedupstore.options import (
    Option,
    Options,
    boolean,
    client_option,
    connect_timeout_option,
    create_option,
    integer,
    retries_option,
    text,
    timeout_option,
)
from dedupstore.urls import StoreURL

if TYPE_CHECKING:
    from azure.cosmos import ContainerProxy

__all__ = [
    "CONNECTION_OPTIONS",
    "KEY_ENV_VAR",
    "PARTITION_KEY_PATH",
    "CosmosClientBase",
]

#: One logger for the package (``backends.cosmos``), whichever store logs.
_log = logging.getLogger("backends.cosmos")

#: Environment variable holding the account key when ``key`` is not given.
KEY_ENV_VAR: Final = "COSMOS_KEY"
#: The partition key path of both containers: the (hashed) item id.
PARTITION_KEY_PATH: Final = "/id"

#: HTTP statuses meaning "the service could not answer now" (retryable).
_UNAVAILABLE_STATUSES: Final = frozenset({0, 408, 410, 429, 449, 503})
#: Sub-statuses: 403/3 write forbidden (failover), 404/1002 session not available.
_RETRYABLE_SUB_STATUSES: Final = frozenset({(403, 3), (404, 1002)})
_FORBIDDEN_NAME_CHARS: Final = frozenset("/\\?#")

_T = TypeVar("_T")
_R = TypeVar("_R")


class _BoundedAdapter(requests.adapters.HTTPAdapter):
    """Each HTTP attempt (connecting and reading together) ends by the call's deadline.

    The SDK's timeouts apply to each attempt as before; with a deadline the
    attempt also gets urllib3's ``total`` limit: the time left. None left:
    a connection timeout, nothing sent.
    """

    def send(
        self,
        request: requests.PreparedRequest,
        stream: bool = False,
        timeout: Any = None,
        verify: bool | str = True,
        cert: Any = None,
        proxies: Mapping[str, str] | None = None,
    ) -> requests.Response:
        left = time_left()
        if left is not None:
            if left <= 0:  # a transport error the SDK reports as a timeout (an AzureError)
                raise requests.exceptions.ConnectTimeout(str(DeadlinePassed()), request=request)
            connect, read = timeout if isinstance(timeout, tuple) else (timeout, timeout)
            timeout = urllib3.Timeout(connect=connect, read=read, total=left)
        return super().send(request, stream, timeout, verify, cert, dict(proxies or {}))


class _BoundedTransport(RequestsTransport):  # type: ignore[misc]
    """The SDK's pauses between attempts end by the call's deadline; a reply that is
    not whole is a lost answer (:mod:`backends._http`), not an empty one."""

    def send(self, request: Any, **kwargs: Any) -> Any:
        response = super().send(request, **kwargs)
        if not kwargs.get("stream"):  # read whole: urllib3 checked the length it was given
            raw = response.internal_response
            reason = cut_short(raw.status_code, raw.headers, raw.raw.tell())
            if reason is not None:
                raise ServiceResponseError(f"Cosmos DB's reply was cut short: {reason}")
        return response

    def sleep(self, duration: float) -> None:
        left = time_left()
        super().sleep(duration if left is None else max(0.0, min(duration, left)))


def _check_name(kind: str, name: str, url: str) -> str:
    if not name or len(name) > 255 or _FORBIDDEN_NAME_CHARS & set(name) or name != name.strip():
        raise ConfigurationError(
            f"bad Cosmos DB {kind} name {name!r} in {url!r}: expected 1-255 characters "
            "without '/', '\\', '?', '#' or surrounding spaces"
        )
    return name


def _http_summary(exc: HttpResponseError) -> str:
    """``HTTP <status> <code>: <message>`` on one line, from a Cosmos error."""
    status = exc.status_code or 0
    message = str(getattr(exc, "http_error_message", None) or exc.message or "")
    code = ""
    with contextlib.suppress(ValueError, TypeError, AttributeError):
        body = json.loads(message)
        code, message = str(body.get("code") or ""), str(body.get("message") or "")
    line = next((part.strip() for part in message.splitlines() if part.strip()), "")
    line = line.removesuffix(",")
    if len(line) > 200:
        line = line[:197] + "..."
    summary = f"HTTP {status}" + (f" {code}" if code else "")
    return f"{summary}: {line}" if line else summary


def _names(url: StoreURL) -> tuple[str, str]:
    """The database and container names of a ``cosmos://`` URL; ``ConfigurationError``."""
    if url.username is not None or url.password is not None:
        raise ConfigurationError(
            "a cosmos:// URL carries no user or password; pass the key as ?key=... "
            f"or in {KEY_ENV_VAR}"
        )
    shape = "'cosmos://<host>[:port]/<database>/<container>'"
    if not url.host:
        raise ConfigurationError(
            f"a cosmos:// URL names the account host: {shape}, got {url.masked!r}"
        )
    segments = url.path.split("/")[1:]
    if len(segments) != 2 or not all(segments):
        raise ConfigurationError(f"expected {shape}, got {url.masked!r}")
    return (
        _check_name("database", unquote(segments[0]), url.masked),
        _check_name("container", unquote(segments[1]), url.masked),
    )


#: The options of both stores, declared once (each store adds its own).
CONNECTION_OPTIONS: Final[tuple[Option, ...]] = (
    Option(
        "key",
        text(r"(?s).*\S.*", "a non-empty key"),
        None,
        f"the account key (default: the {KEY_ENV_VAR} environment variable, not pickled)",
        secret=True,
    ),
    Option("tls", boolean, True, "false: plain http:// (emulators)"),
    Option("endpoint_discovery", boolean, True, "follow regional endpoints (emulators: no)"),
    Option(
        "allow_weak_consistency_for_emulator_only",
        boolean,
        False,
        "UNSAFE: accept an account weaker than Strong (emulators only; logged)",
    ),
    create_option(False, "create the database and container"),
    Option("max_concurrency", integer(1, 1000), 32, "requests in flight per batch"),
    timeout_option(10.0, "seconds: read timeout of each request"),
    connect_timeout_option(5.0),
    retries_option(3, "SDK retries of a failed or throttled request"),
    client_option("a ready CosmosClient (key, tls, timeouts and retries are then unused)"),
)


class CosmosClientBase(Client):
    """What both Cosmos DB stores share: connection, checks, errors, parallel requests.

    A mixin placed first among the bases (``class S(CosmosClientBase,
    DeduplicationStore)``); named so as not to shadow ``azure.cosmos.CosmosClient``.
    Opening connects (one client per process, made again after ``fork``), checks
    that the account's default consistency is Strong and that the container exists
    and is partitioned on ``/id`` (creating it with ``create=true``). Every request
    has the ``connect_timeout`` + ``timeout`` bound and ``retries`` SDK retries.
    """

    #: What the container is, for error messages ("a deduplication container").
    _container_kind: ClassVar[str] = ""
    #: The function that creates such a container, for error messages.
    _create_function: ClassVar[str] = ""
    #: Why Strong is needed, and what a weaker account risks (messages, warnings).
    _strong_reason: ClassVar[str] = ""
    _weak_risk: ClassVar[str] = ""
    connection_options: ClassVar[tuple[str, ...]] = (
        "tls",
        "endpoint_discovery",
        "allow_weak_consistency_for_emulator_only",
        "max_concurrency",
        "timeout",
        "connect_timeout",
        "retries",
    )

    def __init__(self, url: str | StoreURL, /, **options: Any) -> None:
        """Resolve the options, connect, check the account's consistency and the container.

        Raises ``ConsistencyError`` for an account weaker than Strong (unless
        ``allow_weak_consistency_for_emulator_only``), ``ConfigurationError`` for a
        bad URL or option, a missing or rejected key, a missing database or
        container, and ``StoreUnavailable`` when the service cannot be reached.
        """
        super().__init__(url, **options)
        self._database_name, self._container_name = _names(self._url)
        opts = self._opts
        self._account_consistency = "unknown"
        self._endpoint_url = f"{'https' if opts['tls'] else 'http'}://{self._url.netloc}/"
        self._secret: str = opts["key"] or os.environ.get(KEY_ENV_VAR, "")
        if opts["client"] is None and not self._secret:
            raise ConfigurationError(
                f"no Cosmos DB key for {self.url}: pass key=... or set {KEY_ENV_VAR}"
            )
        given: CosmosClient | None = opts["client"]
        self._conn: ProcessLocal[CosmosClient] = (
            ProcessLocal(lambda: given)
            if given is not None
            else self._shared_connection(
                (self._endpoint_url, self._secret), self._new_client, CosmosClient.close
            )
        )
        self._containers = ProcessLocal(self._container_proxy)
        with self._opening("open"):
            client = self._conn.get()
            self._check_consistency(client)
            self._check_container(client)

    @classmethod
    def _validate(cls, url: StoreURL, options: Options) -> None:
        """The URL names a host, a database and a container; ``client`` is a CosmosClient."""
        super()._validate(url, options)
        _names(url)
        client = options["client"]
        if client is not None and not isinstance(client, CosmosClient):
            raise ConfigurationError(
                f"client must be an azure.cosmos.CosmosClient, got {type(client).__name__}"
            )

    # ------------------------------------------------------------------ for the stores

    def _create_container(self, client: CosmosClient) -> None:
        """Create the database and the container if missing (``create=true``)."""
        raise NotImplementedError

    def _container_checked(self, properties: Mapping[str, Any]) -> None:
        """Called at open with the container's properties (after the common checks)."""

    # ------------------------------------------------------------------ opening

    def _container_proxy(self) -> ContainerProxy:
        """This process's proxy of the store's container (no I/O)."""
        database = self._conn.get().get_database_client(self._database_name)
        return database.get_container_client(self._container_name)

    @property
    def _container(self) -> ContainerProxy:
        return self._containers.get()

    def _new_client(self) -> CosmosClient:
        opts = self._opts
        session = requests.Session()
        adapter = _BoundedAdapter(
            pool_connections=4,
            pool_maxsize=opts["max_concurrency"] + 4,
            max_retries=Retry(total=False, redirect=False, raise_on_status=False),
        )
        session.mount("http://", adapter)
        session.mount("https://", adapter)
        # Every request, account reads included, gets our timeouts; throttling (429)
        # is retried as often as anything else, waiting at most `timeout` in all.
        policy = ConnectionPolicy()
        for name, value in (
            ("DBAConnectionTimeout", opts["connect_timeout"]),
            ("DBAReadTimeout", opts["timeout"]),
            ("RecoveryReadTimeout", min(policy.RecoveryReadTimeout, opts["timeout"])),
        ):
            setattr(policy, name, value)
        throttle_wait = max(1, math.ceil(opts["timeout"]))
        policy.RetryOptions = type(policy.RetryOptions)(opts["retries"], None, throttle_wait)
        kwargs: dict[str, Any] = {
            "connection_policy": policy,
            "transport": _BoundedTransport(session=session, session_owner=True),
            "enable_endpoint_discovery": opts["endpoint_discovery"],
            "connection_timeout": opts["connect_timeout"],
            "read_timeout": opts["timeout"],
            "retry_total": opts["retries"],
            "retry_connect": opts["retries"],
            "retry_read": opts["retries"],
            "retry_backoff_max": 1,
            "retry_throttle_backoff_max": throttle_wait,
            # item sizes as the service counts them (the entity store's size limit)
            "enable_compact_utf8_item_writes": True,
        }
        if not opts["allow_weak_consistency_for_emulator_only"]:
            # Requests then demand Strong: if the account is ever weakened, they fail
            # (HTTP 400) instead of silently reading stale data. A client cannot ask
            # for more than the account default, so this is off for emulators.
            kwargs["consistency_level"] = "Strong"
        try:
            return CosmosClient(self._endpoint_url, credential=self._secret, **kwargs)
        except binascii.Error:
            session.close()
            raise ConfigurationError(
                f"the Cosmos DB key for {self.url} is not valid base64: expected the "
                "account's primary or secondary key"
            ) from None
        except (ValueError, TypeError) as exc:
            session.close()
            raise ConfigurationError(
                f"cannot create a Cosmos DB client for {self.url}: {self._describe_error(exc)}"
            ) from None
        except BaseException:
            session.close()
            raise

    def _check_consistency(self, client: CosmosClient) -> None:
        policy = client.get_database_account().ConsistencyPolicy or {}
        level = str(policy.get("defaultConsistencyLevel", "unknown"))
        self._account_consistency = level
        allow_weak = self._opts["allow_weak_consistency_for_emulator_only"]
        if level == "Strong":
            if allow_weak:
                _log.warning(
                    "%s: allow_weak_consistency_for_emulator_only=True has no effect: the "
                    "account is already Strong; remove the option",
                    self.url,
                )
            return
        if not allow_weak:
            raise ConsistencyError(
                f"the Cosmos DB account at {self._endpoint_url} has default consistency "
                f"{level!r}; {self._strong_reason} needs 'Strong' (set it on the account; "
                "allow_weak_consistency_for_emulator_only=True exists for emulators only)"
            )
        _log.warning(
            "UNSAFE: %s opened with allow_weak_consistency_for_emulator_only=True on an account "
            "with default consistency %r: %s; never use this option in production",
            self.url,
            level,
            self._weak_risk,
        )

    def _check_container(self, client: CosmosClient) -> None:
        if self._creates:
            self._create_container(client)
        database = client.get_database_client(self._database_name)
        fix = f"create it with {self._create_function} or open with create=true"
        try:
            properties = database.get_container_client(self._container_name).read()
        except CosmosHttpResponseError as exc:
            if exc.status_code != 404:
                raise
            try:
                database.read()
            except CosmosHttpResponseError as db_exc:
                if db_exc.status_code == 404:
                    raise self._no_such_store(
                        f"Cosmos DB database {self._database_name!r} does not exist at "
                        f"{self._endpoint_url}",
                        f"{fix} (it creates the container too)",
                    ) from None
                raise
            raise self._no_such_store(
                f"Cosmos DB container {self._container_name!r} does not exist in database "
                f"{self._database_name!r}",
                fix,
            ) from None
        paths = list((properties.get("partitionKey") or {}).get("paths") or [])
        if paths != [PARTITION_KEY_PATH]:
            raise ConfigurationError(
                f"Cosmos DB container {self._container_name!r} is partitioned on {paths}; "
                f"{self._container_kind} needs partition key path "
                f"{PARTITION_KEY_PATH!r} (create it with {self._create_function})"
            )
        self._container_checked(properties)

    # ------------------------------------------------------------------ errors

    def _classify_error(self, exc: BaseException) -> ErrorKind:
        if isinstance(exc, HttpResponseError):
            status = exc.status_code or 0
            sub_status = getattr(exc, "sub_status", None) or 0
            summary = self._describe_error(exc)
            if (
                status in _UNAVAILABLE_STATUSES
                or status >= 500
                or (status, sub_status) in _RETRYABLE_SUB_STATUSES
            ):
                return StoreUnavailable
            if status in (401, 403):
                return self._error(
                    ConfigurationError,
                    None,
                    f"Cosmos DB refused the credentials ({summary}); "
                    f"check the key (option 'key' or {KEY_ENV_VAR})",
                )
            if status == 404:
                return self._error(
                    ConfigurationError,
                    None,
                    f"database {self._database_name!r} or container "
                    f"{self._container_name!r} does not exist ({summary}); "
                    f"create it with {self._create_function} or open with create=true",
                )
            if status == 400 and "consisten" in summary.lower():
                return ConsistencyError
            if 400 <= status < 500:
                return ConfigurationError
            return StoreUnavailable  # a garbled answer (e.g. an undecodable body)
        # ServiceRequestError, ServiceResponseError, CosmosClientTimeoutError, ...:
        # the transport failed or gave up (connection, timeout).
        if isinstance(exc, AzureError | requests.RequestException):
            return StoreUnavailable
        return super()._classify_error(exc)

    def _describe_error(self, exc: BaseException) -> str:
        if isinstance(exc, HttpResponseError):
            return self._scrub(_http_summary(exc))
        return super()._describe_error(exc)

    def _secret_values(self) -> set[str]:
        """Also the key taken from the environment (not an option value)."""
        return super()._secret_values() | {getattr(self, "_secret", "")} - {""}

    def _health_warnings(self) -> list[str]:
        if self._account_consistency == "Strong":
            return []
        return [
            f"UNSAFE: the Cosmos DB account's default consistency is "
            f"{self._account_consistency!r}, not 'Strong' "
            f"(allow_weak_consistency_for_emulator_only=True): {self._weak_risk}"
        ]

    # ------------------------------------------------------------------ requests

    def _read_many(self, container: ContainerProxy, doc_ids: Sequence[str]) -> dict[str, Any]:
        """Items by id; absent ids are missing from the result. Strongly consistent.

        Never a point read: the SDK reports a point read's 404 as "absent" whether
        the item or the container is missing (and cosmosdb-server answers 500). A
        lone id is a single-partition query; several are the SDK's read-many (one
        ``id IN (...)`` query per physical partition, in parallel). Both fail loudly
        (404) when the container is gone.
        """
        if not doc_ids:
            return {}
        if len(doc_ids) == 1:
            items: Any = container.query_items(
                "SELECT * FROM c WHERE c.id = @id",
                parameters=[{"name": "@id", "value": doc_ids[0]}],
                partition_key=doc_ids[0],
            )
        else:
            items = container.read_items([(d, d) for d in doc_ids], executor=executor())
        return {str(item["id"]): item for item in items}

    def _parallel(self, fn: Callable[[_T], _R], items: Sequence[_T]) -> list[_R]:
        """``[fn(x) for x in items]`` with up to ``max_concurrency`` calls in flight.

        :func:`~dedupstore.calls.fan_out`: after a failure no new call starts, the
        running ones are awaited, then the first failure in input order is raised.
        """
        return fan_out(fn, items, concurrency=self._opts["max_concurrency"])

    def _deadline_seconds(self) -> float:
        """``connect_timeout + (retries + 1) x timeout``: see :mod:`backends.cosmos`."""
        opts = self._opts
        return float(opts["connect_timeout"] + (opts["retries"] + 1) * opts["timeout"])

    def _close(self) -> None:
        self._containers.close()
        self._conn.close()
