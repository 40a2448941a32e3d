"""The connection the Cosmos DB stores share: :class:`CosmosConnection` (the ``CosmosClient`` of
one account per process, the consistency and container checks, error classification, read-many,
writes, deletes, queries and parallel requests); each store describes its container in a
:class:`ContainerKind`."""

from __future__ import annotations

import binascii
import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import threading
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Final, TypeVar
from urllib.parse import unquote

import requests
import urllib3
from azure.core import MatchConditions
from azure.core.exceptions import AzureError, HttpResponseError, ServiceResponseError
from azure.core.pipeline.transport import RequestsTransport
from azure.core.utils import CaseInsensitiveDict
from azure.cosmos import CosmosClient, PartitionKey
from azure.cosmos.documents import ConnectionPolicy
from azure.cosmos.exceptions import CosmosHttpResponseError
from urllib3.util.retry import Retry

from dedupstore.backend import (
    Client,
    ConfigurationError,
    Connection,
    ConsistencyError,
    DeadlinePassed,
    EntityStore,
    EntityTooLarge,
    ErrorKind,
    Option,
    Options,
    Steps,
    StoreUnavailable,
    StoreURL,
    boolean,
    check_client,
    client_option,
    connect_timeout_option,
    create_option,
    cut_short,
    executor,
    fan,
    fan_out,
    format_error,
    integer,
    part_of,
    retries_option,
    scrub,
    text,
    time_left,
    timeout_option,
)

if TYPE_CHECKING:
    from azure.cosmos import ContainerProxy

__all__ = [
    "CONNECTION_OPTIONS",
    "KEY_ENV_VAR",
    "PARTITION_KEY_PATH",
    "ContainerKind",
    "CosmosConnection",
]

#: One logger for the package (``dedupstore.backends.cosmos``), whichever store logs.
_log = logging.getLogger("dedupstore.backends.cosmos")

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
    """Each HTTP attempt (connecting and reading together) ends by the call's deadline: besides the
    SDK's timeouts it gets urllib3's ``total`` limit, the time left (none left: a connection
    timeout, nothing sent)."""

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
    """The SDK's pauses between attempts end by the call's deadline; a reply that is not whole is a
    lost answer (:mod:`dedupstore.replies`), not an empty one."""

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


def side_by_side(client: Client, items: Iterable[Steps[_T]]) -> Steps[list[_T]]:
    """The steps ``items`` (a store's per-item requests) with up to ``client``'s
    ``max_concurrency`` in flight: threads on the sync face, tasks on the async one
    (:func:`~dedupstore.steps.fan`)."""
    return (yield from fan(fan_out, items, client.options["max_concurrency"]))


def _check_name(kind: str, name: str, url: str) -> str:
    if not name or len(name) > 255 or _FORBIDDEN_NAME_CHARS & set(name) or name != name.strip():
        raise ConfigurationError(
            f"bad Cosmos DB {kind} name {name!r} in {url!r}: expected 1-255 characters "
            "without '/', '\\', '?', '#' or surrounding spaces"
        )
    return name


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


class _ThreadsOwnHeaders:
    """``last_response_headers`` kept per thread. The SDK keeps one per client and, after every
    request, writes throttle counts into it from the thread that finished, while another thread
    whose headers are there may be reading them ("OrderedDict mutated during iteration" in a
    parallel read-many; the SDK calls the attribute not thread safe, azure-sdk-for-python#35791)."""

    def __get__(self, connection: Any, owner: type | None = None) -> Any:
        if connection is None:
            return self
        local = connection._dedupstore_headers
        if not hasattr(local, "headers"):
            local.headers = CaseInsensitiveDict()
        return local.headers

    def __set__(self, connection: Any, headers: Any) -> None:
        connection._dedupstore_headers.headers = headers


@functools.cache
def _with_headers_per_thread(cls: Any) -> type:
    return type(cls.__name__, (cls,), {"last_response_headers": _ThreadsOwnHeaders()})


def _headers_per_thread(client: CosmosClient) -> CosmosClient:
    """``client``, its connection's last response headers now kept per thread (this client only:
    its connection's class becomes a subclass that adds nothing else)."""
    connection: Any = client.client_connection
    if not hasattr(connection, "_dedupstore_headers"):
        connection._dedupstore_headers = threading.local()
        connection.__dict__.pop("last_response_headers", None)
        connection.__class__ = _with_headers_per_thread(connection.__class__)
    return client


def _key(options: Options) -> str:
    """The account key: option ``key``, else ``COSMOS_KEY`` (``""``: none)."""
    return str(options["key"] or os.environ.get(KEY_ENV_VAR, ""))


def endpoint_of(url: StoreURL, options: Options) -> str:
    """The account's endpoint URL (``https://`` unless ``tls`` is off)."""
    return f"{'https' if options['tls'] else 'http'}://{url.netloc}/"


def account_key(url: StoreURL, options: Options) -> str:
    """The account key (:func:`_key`); ``ConfigurationError`` when there is none."""
    secret = _key(options)
    if not secret:
        raise ConfigurationError(
            f"no Cosmos DB key for {url.masked}: pass key=... or set {KEY_ENV_VAR}"
        )
    return secret


def client_settings(options: Options) -> dict[str, Any]:
    """The keyword arguments, besides endpoint, credential and transport, of the stores' own
    ``CosmosClient``, sync (:meth:`CosmosConnection._connect`) or ``azure.cosmos.aio``
    (:class:`~._aio.AsyncCosmosConnection`): timeouts, retries, endpoint discovery, compact UTF-8
    writes, Strong consistency. A new ``ConnectionPolicy`` each time (the SDK changes it)."""
    # Every request, account reads included, gets our timeouts; throttling (429) is retried as
    # often as anything else, waiting at most `timeout` in all.
    policy = ConnectionPolicy()
    policy.DBAConnectionTimeout = options["connect_timeout"]
    policy.DBAReadTimeout = options["timeout"]
    policy.RecoveryReadTimeout = min(policy.RecoveryReadTimeout, options["timeout"])
    throttle_wait = max(1, math.ceil(options["timeout"]))
    policy.RetryOptions = type(policy.RetryOptions)(options["retries"], None, throttle_wait)
    return {
        "connection_policy": policy,
        "enable_endpoint_discovery": options["endpoint_discovery"],
        "connection_timeout": options["connect_timeout"],
        "read_timeout": options["timeout"],
        "retry_total": options["retries"],
        "retry_connect": options["retries"],
        "retry_read": options["retries"],
        "retry_backoff_max": 1,
        "retry_throttle_backoff_max": throttle_wait,
        # item sizes as the service counts them (the entity store's size limit)
        "enable_compact_utf8_item_writes": True,
        # Strong on every request: on an account weakened later they fail (HTTP 400) rather
        # than read stale data; emulators (the option) cannot ask above theirs
        "consistency_level": (
            None if options["allow_weak_consistency_for_emulator_only"] else "Strong"
        ),
    }


def creation_error(url: StoreURL, secret: str, exc: BaseException) -> ConfigurationError | None:
    """The ``ConfigurationError`` for ``exc``, raised while making a ``CosmosClient`` of ``url``
    with the key ``secret`` (a key that is not base64, a value the SDK refuses); ``None`` for
    any other error (raised as it is)."""
    if isinstance(exc, binascii.Error):
        return ConfigurationError(
            f"the Cosmos DB key for {url.masked} is not valid base64: expected "
            "the account's primary or secondary key"
        )
    if isinstance(exc, ValueError | TypeError):
        detail = scrub(f"{type(exc).__name__}: {format_error(exc)}", (secret,))
        return ConfigurationError(f"cannot create a Cosmos DB client for {url.masked}: {detail}")
    return None


@dataclasses.dataclass(frozen=True)
class ContainerKind:
    """What a store keeps in its container (its public ``container_kind``): its use ("a
    deduplication container"), the function that creates one, the item properties indexed (what
    its queries filter on; nothing else is), why Strong is needed, what a weaker account risks,
    and the container's default TTL (``None``: TTL off)."""

    what: str
    function: str
    indexed: tuple[str, ...]
    strong_reason: str
    weak_risk: str
    default_ttl: int | None = None

    def create(
        self, client: CosmosClient, database: str, container: str, throughput: int | None = None
    ) -> ContainerProxy:
        """Create ``database`` and ``container`` (partitioned on ``/id``) if missing."""
        policy = {
            "indexingMode": "consistent",
            "automatic": True,
            "includedPaths": [{"path": f"/{name}/?"} for name in self.indexed],
            "excludedPaths": [{"path": "/*"}],
        }
        db = client.create_database_if_not_exists(database)
        proxy: ContainerProxy = db.create_container_if_not_exists(
            id=container,
            partition_key=PartitionKey(path=PARTITION_KEY_PATH),
            offer_throughput=throughput,
            indexing_policy=policy,
            default_ttl=self.default_ttl,
        )
        return proxy


def _kind(client: Client) -> ContainerKind:
    return part_of(client, "container_kind", ContainerKind)


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


#: The statuses that refuse a write or a delete (not errors), without and with an etag.
_REFUSALS: Final[Mapping[tuple[str, bool], tuple[int, ...]]] = {
    ("write", False): (409,),  # a create: the id exists
    ("write", True): (404, 412),  # a replace: gone, or changed since
    ("delete", False): (404,),  # gone already
    ("delete", True): (404, 412),
}


def refused_status(exc: CosmosHttpResponseError, verb: str, etag: str | None) -> int:
    """The status of a refusal of a ``verb`` (``"write"`` or ``"delete"``, with ``etag`` or
    not; ``CosmosConnection.write``, ``.delete``); re-raises ``exc`` for any other error."""
    status = exc.status_code or 0
    if status in _REFUSALS[verb, etag is not None]:
        return status
    raise exc


def if_unchanged(etag: str | None) -> dict[str, Any]:
    """The SDK's keyword arguments that make a request conditional on ``etag`` (none without)."""
    if etag is None:
        return {}
    return {"etag": etag, "match_condition": MatchConditions.IfNotModified}


def written(result: Mapping[str, Any] | None, etag: str | None) -> tuple[int, str | None]:
    """A write's answer (``CosmosConnection.write``): 201 for a create (no ``etag``), 200 for a
    replace, with the new ``_etag`` from the body, which is this request's own (``None`` if
    not answered)."""
    new_etag = result.get("_etag") if result else None
    return (201 if etag is None else 200), str(new_etag) if new_etag else None


class CosmosConnection(Connection):
    """The ``CosmosClient`` of one account (host, port, key) in one process, shared by the stores of
    every database and container there. Each store names it as its ``connection_class``, reaches it
    as ``self._cosmos`` and opens its container (its ``container_kind``) with
    :meth:`open_container`."""

    schemes: ClassVar[tuple[str, ...]] = ("cosmos",)
    # not the key (the address), create (each store's) nor client (keyed by identity)
    shaped_by: ClassVar[tuple[str, ...]] = tuple(
        o.name for o in CONNECTION_OPTIONS if o.name not in ("key", "create", "client")
    )

    def __init__(self, url: StoreURL, options: Options) -> None:
        """The given ``client``, or our own (the SDK reads the account as it makes one;
        ``ConfigurationError`` without a key)."""
        super().__init__(url, options)
        self.endpoint = endpoint_of(url, options)
        self._containers: dict[str, ContainerProxy] = {}
        self._given = options["client"] is not None
        client = options["client"] if self._given else self._connect()
        self.client: CosmosClient = _headers_per_thread(client)

    @classmethod
    def async_twin(cls, url: StoreURL, options: Options) -> Any:
        """A :class:`~._aio.AsyncCosmosConnection` (``azure.cosmos.aio``) of the same account
        (no I/O: it connects at its first call, on the running loop)."""
        from ._aio import AsyncCosmosConnection

        return AsyncCosmosConnection(url, options)

    @classmethod
    def address(cls, url: StoreURL, options: Options) -> Hashable:
        """The account: host, port and key (the database and container are the stores')."""
        return url.netloc, _key(options)

    @classmethod
    def validate(cls, url: StoreURL, options: Options) -> None:
        """The URL names a host, a database and a container; ``client`` is a CosmosClient."""
        _names(url)
        check_client(options, CosmosClient, "an azure.cosmos.CosmosClient")

    def _connect(self) -> CosmosClient:
        secret = account_key(self.url, self.options)
        session = requests.Session()
        adapter = _BoundedAdapter(
            pool_connections=4,
            pool_maxsize=self.options["max_concurrency"] + 4,
            max_retries=Retry(total=False, redirect=False, raise_on_status=False),
        )
        session.mount("http://", adapter)
        session.mount("https://", adapter)
        try:
            return CosmosClient(
                self.endpoint,
                credential=secret,
                transport=_BoundedTransport(session=session, session_owner=True),
                **client_settings(self.options),
            )
        except BaseException as exc:
            session.close()
            error = creation_error(self.url, secret, exc)
            if error is not None:
                raise error from None
            raise

    def open_container(self, client: Client) -> Mapping[str, Any]:
        """Check the account's consistency (``ConsistencyError``) and ``client``'s container
        (created first if ``client`` creates; missing or not partitioned on ``/id``:
        ``ConfigurationError``); return the container's properties."""
        kind = _kind(client)
        level = self._consistency()
        if level == "Strong":
            if self.options["allow_weak_consistency_for_emulator_only"]:
                _log.warning(
                    "%s: allow_weak_consistency_for_emulator_only=True has no effect: the "
                    "account is already Strong; remove the option",
                    client.url,
                )
        elif not self.options["allow_weak_consistency_for_emulator_only"]:
            raise ConsistencyError(
                f"the Cosmos DB account at {self.endpoint} has default consistency "
                f"{level!r}; {kind.strong_reason} needs 'Strong' (set it on the account; "
                "allow_weak_consistency_for_emulator_only=True exists for emulators only)"
            )
        else:
            _log.warning(
                "UNSAFE: %s opened with allow_weak_consistency_for_emulator_only=True on an "
                "account with default consistency %r: %s; never use this option in production",
                client.url,
                level,
                kind.weak_risk,
            )
        database_name, container_name = _names(client.store_url)
        if client.creates:
            kind.create(self.client, database_name, container_name)
        fix = f"create it with {kind.function} or open with create=true"
        try:
            properties: Mapping[str, Any] = self.container(client).read()
        except CosmosHttpResponseError as exc:
            if exc.status_code != 404:
                raise
            try:
                self.client.get_database_client(database_name).read()
            except CosmosHttpResponseError as db_exc:
                if db_exc.status_code == 404:
                    raise client.no_such_store(
                        f"Cosmos DB database {database_name!r} does not exist at {self.endpoint}",
                        f"{fix} (it creates the container too)",
                    ) from None
                raise
            raise client.no_such_store(
                f"Cosmos DB container {container_name!r} does not exist in database "
                f"{database_name!r}",
                fix,
            ) from None
        paths = list((properties.get("partitionKey") or {}).get("paths") or [])
        if paths != [PARTITION_KEY_PATH]:
            raise ConfigurationError(
                f"Cosmos DB container {container_name!r} is partitioned on {paths}; "
                f"{kind.what} needs partition key path "
                f"{PARTITION_KEY_PATH!r} (create it with {kind.function})"
            )
        return properties

    def container(self, client: Client) -> ContainerProxy:
        """The proxy of ``client``'s container (no I/O; one per container and process)."""
        path = client.store_url.path
        proxy = self._containers.get(path)
        if proxy is None:
            database_name, container_name = _names(client.store_url)
            database = self.client.get_database_client(database_name)
            proxy = self._containers[path] = database.get_container_client(container_name)
        return proxy

    def read_many(self, client: Client, doc_ids: Mapping[str, str]) -> dict[str, Any]:
        """The items of ``client``'s container with ids ``doc_ids.values()``, under their keys in
        ``doc_ids``; absent items are missing from the result. Strongly consistent. Never a point
        read: the SDK reports a point read's 404 as "absent" whether the item or the container is
        missing (and cosmosdb-server answers 500). A lone id is a single-partition query; several
        are the SDK's read-many (one ``id IN (...)`` query per physical partition, in parallel).
        Both fail loudly (404) when the container is gone."""
        ids = list(doc_ids.values())
        if not ids:
            return {}
        if len(ids) == 1:
            items: Any = self.container(client).query_items(
                "SELECT * FROM c WHERE c.id = @id",
                parameters=[{"name": "@id", "value": ids[0]}],
                partition_key=ids[0],
            )
        else:
            items = self.container(client).read_items([(d, d) for d in ids], executor=executor())
        found = {str(item["id"]): item for item in items}
        return {key: found[d] for key, d in doc_ids.items() if d in found}

    def write(
        self, client: Client, item: dict[str, Any], etag: str | None = None
    ) -> tuple[int, str | None]:
        """Create ``item`` (no ``etag``; 201) or replace it if its ``_etag`` is still ``etag``
        (200): that status and the new ``_etag`` (``None`` if not answered), or the status of a
        refusal and ``None``: 409 on a create (the id exists), 412 (changed since) or 404 (gone; a
        missing container fails the next read) on a replace. Other errors propagate."""
        container = self.container(client)
        try:
            if etag is None:
                result = container.create_item(item)
            else:
                result = container.replace_item(item["id"], item, **if_unchanged(etag))
        except CosmosHttpResponseError as exc:
            return refused_status(exc, "write", etag), None
        return written(result, etag)

    def delete(self, client: Client, doc_id: str, etag: str | None = None) -> int:
        """Delete the item ``doc_id`` of ``client``'s container (with ``etag``: only if its
        ``_etag`` is still that): 204, or the status of a refusal: 404 (no such item, gone already;
        a missing container fails the next read) or 412 (changed since). Other errors propagate."""
        try:
            self.container(client).delete_item(doc_id, doc_id, **if_unchanged(etag))
        except CosmosHttpResponseError as exc:
            return refused_status(exc, "delete", etag)
        return 204

    def query(
        self, client: Client, sql: str, page_size: int | None = None, /, **params: Any
    ) -> Any:
        """A cross-partition query of ``client``'s container, ``@<name>`` bound to each keyword;
        pages of at most ``page_size`` items (by default the service's)."""
        return self.container(client).query_items(
            sql,
            parameters=[{"name": f"@{name}", "value": value} for name, value in params.items()],
            enable_cross_partition_query=True,
            max_item_count=page_size,
        )

    def parallel(self, fn: Callable[[_T], _R], items: Iterable[_T]) -> list[_R]:
        """:func:`~dedupstore.calls.fan_out` with up to ``max_concurrency`` calls in flight."""
        return fan_out(fn, items, concurrency=self.options["max_concurrency"])

    @classmethod
    def describe_error(cls, client: Client, exc: BaseException) -> str | None:
        """A Cosmos DB answer as ``HTTP <status> <code>: <message>`` on one line, scrubbed; ``None``
        for any other error."""
        if not isinstance(exc, HttpResponseError):
            return None
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
        return client.scrub(f"{summary}: {line}" if line else summary)

    @classmethod
    def secrets(cls, options: Options) -> set[str]:
        """The account key, also from ``COSMOS_KEY``."""
        return {_key(options)} - {""}

    @classmethod
    def classify_error(cls, client: Client, exc: BaseException) -> ErrorKind:
        """Cosmos DB's answers by status; the transport's failures: ``StoreUnavailable``."""
        if isinstance(exc, HttpResponseError):
            status = exc.status_code or 0
            sub_status = getattr(exc, "sub_status", None) or 0
            summary = client.describe_error(exc)
            if (
                status in _UNAVAILABLE_STATUSES
                or status >= 500
                or (status, sub_status) in _RETRYABLE_SUB_STATUSES
            ):
                return StoreUnavailable
            if status in (401, 403):
                return client.make_error(
                    ConfigurationError,
                    None,
                    f"Cosmos DB refused the credentials ({summary}); "
                    f"check the key (option 'key' or {KEY_ENV_VAR})",
                )
            if status == 404:
                database_name, container_name = _names(client.store_url)
                return client.make_error(
                    ConfigurationError,
                    None,
                    f"database {database_name!r} or container {container_name!r} does not "
                    f"exist ({summary}); create it with {_kind(client).function} or open with "
                    "create=true",
                )
            if status == 413 and isinstance(client, EntityStore):
                return client.make_error(
                    EntityTooLarge,
                    None,
                    f"Cosmos DB refused an item as too large ({summary}) "
                    "although its entity was within max_entity_bytes; that entity was not "
                    "written (others of the same save_many may have been)",
                )
            if status == 400 and "consisten" in summary.lower():
                return ConsistencyError
            if 400 <= status < 500:
                return ConfigurationError
            return StoreUnavailable  # a garbled answer (e.g. an undecodable body)
        # the transport failed or gave up (ServiceRequestError, CosmosClientTimeoutError, ...)
        if isinstance(exc, AzureError | requests.RequestException):
            return StoreUnavailable
        return None

    def _consistency(self) -> str:
        """The account's default consistency, read now (one request)."""
        policy = self.client.get_database_account().ConsistencyPolicy or {}
        return str(policy.get("defaultConsistencyLevel", "unknown"))

    def health_warnings(self, client: Client) -> list[str]:
        """An account weaker than Strong (opened with the unsafe option), read now."""
        level = self._consistency()
        if level == "Strong":
            return []
        return [
            f"UNSAFE: the Cosmos DB account's default consistency is {level!r}, not 'Strong' "
            f"(allow_weak_consistency_for_emulator_only=True): {_kind(client).weak_risk}"
        ]

    def close(self) -> None:
        """Close our own ``CosmosClient`` (not a given one)."""
        if not self._given:
            self.client.close()
