"""``cosmos://<host>[:port]/<database>/<container>?...``: Azure Cosmos DB (NoSQL API).

One item per (endpoint, message id). Its ``id`` is the hex SHA-256 of the
length-prefixed UTF-8 (endpoint, message id): Cosmos DB ids may not contain
``/ \\ ? #``, are limited to 255 characters and travel in request URLs, so raw
ids (up to 1024 bytes, any character) cannot be used, and a reversible escape
would need a second scheme for long ids. The hash gives one fixed-length
64-character id for every valid input; the original endpoint and message id are
stored in the item and compared on every read, so a collision would raise
``DedupStoreError`` instead of silently merging two messages.

The container's partition key path is ``/id`` (the hashed id itself): records
spread evenly over physical partitions, no endpoint is confined to one logical
partition (20 GB and per-partition throughput ceilings), and reads use the SDK's
read-many (``ContainerProxy.read_items``: one ``id IN (...)`` query per physical
partition, or a point read for a lone id).

Correctness rests on three native guarantees:

* ``create_item`` is atomic per id: 409 Conflict means the id is already there,
  so of concurrent writers exactly one creates it (first writer wins);
* an expired record is overwritten by ``replace_item`` with ``If-Match`` on the
  ``_etag`` that was read: a 412 means another writer changed it first;
* the account's default consistency is **Strong**, checked at open (weaker
  accounts raise ``ConsistencyError``); requests then ask for Strong explicitly,
  so an account weakened later makes them fail loudly rather than read stale data.

Each write carries a per-call token, so a create or replace that the transport
resent after it had already succeeded is still recognised as this call's own
write (never misreported as "already recorded").

Batches: Cosmos DB has no conditional multi-item write across partitions, so
``add_many`` sends N parallel ``create_item`` requests per chunk (at most
``max_concurrency`` in flight), then one read-many for the ids that already
existed. ``processed_among`` is one read-many per chunk.

Retention: items carry a native ``ttl`` (the retention plus a minute of slack for
clock skew) which only reclaims space; reads compare the stored ``expires_at`` with
the store's clock, so an engine that deletes late (or ignores TTL, like the
emulator) never yields a wrong answer. Records without retention carry ``ttl: -1``
(never expire, even if the container's default TTL is positive). Per-item TTL needs
the container's default TTL set (``-1``): :func:`create_container` does that.

URL options (keyword arguments override them):

``key``
    the account key (secret, masked in ``repr`` and errors); defaults to the
    ``COSMOS_KEY`` environment variable. A key taken from the environment is not
    pickled: an unpickled store reads its own ``COSMOS_KEY``.
``tls``
    ``true`` (default) for ``https://``; ``false`` for plain ``http://`` (emulators).
``endpoint_discovery``
    ``true`` (default) follows the account's regional endpoints; emulators need
    ``false`` (they advertise unreachable ``https://`` locations).
``allow_weak_consistency_for_emulator_only``
    **UNSAFE in production.** Open an account whose default consistency is weaker
    than Strong (the emulator reports "Session"); reads may then miss acknowledged
    writes and messages may be processed twice. Logs a WARNING at every open.
``create_container``
    create the database and container when missing (see :func:`create_container`).
``max_concurrency``
    parallel requests per batch (default 32).
``timeout``
    connection and read timeout per request, in seconds (SDK default otherwise).
``retry_total``
    how many times the SDK retries a failed or throttled request (SDK default
    otherwise); keep it small where failing fast matters.
"""

from __future__ import annotations

import binascii
import contextlib
import hashlib
import json
import logging
import math
import os
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar, Final, TypeVar
from urllib.parse import unquote

import requests
from azure.core import MatchConditions
from azure.core.exceptions import ServiceRequestError, ServiceResponseError
from azure.core.pipeline.transport import RequestsTransport
from azure.cosmos import CosmosClient, PartitionKey
from azure.cosmos.exceptions import CosmosClientTimeoutError, CosmosHttpResponseError
from urllib3.util.retry import Retry

from dedupstore.errors import (
    ConfigurationError,
    ConsistencyError,
    DedupStoreError,
    StoreUnavailable,
)
from dedupstore.store import Clock, DeduplicationStore
from dedupstore.urls import parse_bool, split_url

if TYPE_CHECKING:
    from azure.cosmos import ContainerProxy

__all__ = [
    "KEY_ENV_VAR",
    "PARTITION_KEY_PATH",
    "CosmosDeduplicationStore",
    "create_container",
    "document_id",
]

_log = logging.getLogger(__name__)

#: Environment variable holding the account key when ``key`` is not given.
KEY_ENV_VAR: Final = "COSMOS_KEY"
#: The partition key path of a deduplication container: the (hashed) item id.
PARTITION_KEY_PATH: Final = "/id"

_ID_NAMESPACE: Final = b"dedupstore/cosmos/v1\x00"
#: Native TTL is the retention plus this slack, so clock skew between the client
#: and the service never removes a record before its stored expiry.
_TTL_SLACK_SECONDS: Final = 60
_MAX_TTL_SECONDS: Final = 2**31 - 1
#: Rounds of create / read / replace before giving up on a contended id.
_MAX_ROUNDS: Final = 8
#: HTTP statuses meaning "the service could not answer now" (retryable).
_UNAVAILABLE_STATUSES: Final = frozenset({0, 408, 410, 429, 449})
_FORBIDDEN_NAME_CHARS: Final = frozenset("/\\?#")
_INDEXING_POLICY: Final[dict[str, Any]] = {
    "indexingMode": "consistent",
    "automatic": True,
    "includedPaths": [{"path": "/endpoint/?"}, {"path": "/expires_at/?"}],
    "excludedPaths": [{"path": "/*"}],
}

_T = TypeVar("_T")
_R = TypeVar("_R")


def document_id(endpoint: str, message_id: str) -> str:
    """Return the Cosmos DB item id of (``endpoint``, ``message_id``).

    Hex SHA-256 of a namespace tag, the 4-byte length of the UTF-8 endpoint, the
    endpoint and the message id: 64 characters from ``[0-9a-f]``, valid as a
    Cosmos DB id and as a URL path segment, injective up to SHA-256 collisions
    (which reads detect by comparing the stored endpoint and message id).
    """
    ep = endpoint.encode("utf-8")
    digest = hashlib.sha256(_ID_NAMESPACE + len(ep).to_bytes(4, "big") + ep)
    digest.update(message_id.encode("utf-8"))
    return digest.hexdigest()


def create_container(
    client: CosmosClient,
    database: str,
    container: str,
    *,
    offer_throughput: int | None = None,
) -> ContainerProxy:
    """Create ``database`` and ``container`` for deduplication records if missing.

    The container gets partition key path ``/id``, a default TTL of ``-1`` (per-item
    TTL enabled, nothing expires by default) and an indexing policy limited to the
    fields the store queries. ``offer_throughput`` (RU/s) applies only when the
    container is created; leave it ``None`` on serverless accounts. An existing
    container is left as it is. Raises ``CosmosHttpResponseError`` and azure-core
    errors; :class:`CosmosDeduplicationStore` translates them when it calls this.
    """
    db = client.create_database_if_not_exists(database)
    return db.create_container_if_not_exists(
        id=container,
        partition_key=PartitionKey(path=PARTITION_KEY_PATH),
        indexing_policy=_INDEXING_POLICY,
        default_ttl=-1,
        offer_throughput=offer_throughput,
    )


def _positive_int(value: str | float) -> int:
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(f"expected a positive integer, got {value!r}")
    number = int(value)
    if number < 1:
        raise ValueError(f"expected a positive integer, got {value!r}")
    return number


def _non_negative_int(value: str | float) -> int:
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(f"expected an integer >= 0, got {value!r}")
    number = int(value)
    if number < 0:
        raise ValueError(f"expected an integer >= 0, got {value!r}")
    return number


def _positive_float(value: str | float) -> float:
    number = float(value)
    if not number > 0 or math.isinf(number):
        raise ValueError(f"expected a positive number of seconds, got {value!r}")
    return number


def _check_name(kind: str, name: str, url: str) -> str:
    if not name or len(name) > 255 or _FORBIDDEN_NAME_CHARS & set(name) or name != name.strip():
        raise ConfigurationError(
            f"bad Cosmos DB {kind} name {name!r} in {url!r}: expected 1-255 characters "
            "without '/', '\\', '?', '#' or surrounding spaces"
        )
    return name


def _http_summary(exc: CosmosHttpResponseError) -> str:
    """``HTTP <status> <code>: <message>`` on one line, from a Cosmos error."""
    status = exc.status_code or 0
    raw = exc.http_error_message
    code, message = "", str(raw or "")
    with contextlib.suppress(ValueError, TypeError, AttributeError):
        body = json.loads(message)
        code, message = str(body.get("code", "")), str(body.get("message", ""))
    line = next((part.strip() for part in message.splitlines() if part.strip()), "")
    line = line.removesuffix(",")
    if len(line) > 200:
        line = line[:197] + "..."
    summary = f"HTTP {status}" + (f" {code}" if code else "")
    return f"{summary}: {line}" if line else summary


class CosmosDeduplicationStore(DeduplicationStore):
    """Deduplication store in an Azure Cosmos DB (NoSQL API) container.

    Requires an account whose default consistency is Strong (else
    ``ConsistencyError`` at open) and a container partitioned on ``/id`` (see
    :func:`create_container`). ``add_many`` costs N parallel create requests per
    chunk of 1000 ids (``max_concurrency`` in flight) plus one read-many when some
    ids already existed; ``processed_among`` one read-many per chunk. Safe to share
    between threads; pickle it (rather than fork) to use it in another process.
    """

    schemes: ClassVar[tuple[str, ...]] = ("cosmos",)
    max_write_batch: ClassVar[int] = 1000
    max_read_batch: ClassVar[int] = 1000
    url_options: ClassVar[Mapping[str, Callable[[str], Any]]] = {
        "key": str,
        "tls": parse_bool,
        "endpoint_discovery": parse_bool,
        "allow_weak_consistency_for_emulator_only": parse_bool,
        "create_container": parse_bool,
        "max_concurrency": _positive_int,
        "timeout": _positive_float,
        "retry_total": _non_negative_int,
    }

    def __init__(
        self,
        url: str,
        *,
        endpoint: str = "default",
        retention: timedelta | None = None,
        clock: Clock | None = None,
        key: str | None = None,
        tls: bool = True,
        endpoint_discovery: bool = True,
        allow_weak_consistency_for_emulator_only: bool = False,
        create_container: bool = False,
        max_concurrency: int = 32,
        timeout: float | None = None,
        retry_total: int | None = None,
        client: CosmosClient | None = None,
    ) -> None:
        """Connect, check the account's consistency and the container.

        ``allow_weak_consistency_for_emulator_only=True`` is UNSAFE in production:
        it accepts an account weaker than Strong (only for emulators, which report
        "Session"); a client cannot raise consistency above the account default,
        so such a store is not linearizable. ``client`` is a ready ``CosmosClient``
        (not pickled; ``key``, ``tls``, ``endpoint_discovery``, ``timeout`` and
        ``retry_total`` then do not apply, and requests use the client's own
        consistency setting; the account is still checked).

        Raises ``ConsistencyError`` for a weak account, ``ConfigurationError`` for
        a bad URL or option, a missing key, a rejected key, a missing database or
        container, and ``StoreUnavailable`` when the service cannot be reached.
        """
        database, container = self._parse_url(url)
        tls = self._check_flag("tls", tls)
        endpoint_discovery = self._check_flag("endpoint_discovery", endpoint_discovery)
        allow_weak_consistency_for_emulator_only = self._check_flag(
            "allow_weak_consistency_for_emulator_only", allow_weak_consistency_for_emulator_only
        )
        create_container = self._check_flag("create_container", create_container)
        max_concurrency = self._check_option("max_concurrency", max_concurrency, _positive_int)
        if timeout is not None:
            timeout = self._check_option("timeout", timeout, _positive_float)
        if retry_total is not None:
            retry_total = self._check_option("retry_total", retry_total, _non_negative_int)
        options: dict[str, Any] = {
            "key": key,
            "tls": tls,
            "endpoint_discovery": endpoint_discovery,
            "allow_weak_consistency_for_emulator_only": allow_weak_consistency_for_emulator_only,
            "create_container": create_container,
            "max_concurrency": max_concurrency,
            "timeout": timeout,
            "retry_total": retry_total,
        }
        if client is not None:
            options["client"] = client
        super().__init__(url, endpoint=endpoint, retention=retention, clock=clock, options=options)
        self._unavailable_errors = (
            ServiceRequestError,
            ServiceResponseError,
            CosmosClientTimeoutError,
        )
        self._database_name = database
        self._container_name = container
        self._max_concurrency = max_concurrency
        self._allow_weak = allow_weak_consistency_for_emulator_only
        self._pool: ThreadPoolExecutor | None = None
        self._pool_pid = 0
        self._pool_lock = threading.Lock()
        self._account_consistency = "unknown"
        self._default_ttl: int | None = None
        scheme = "https" if tls else "http"
        host = split_url(url).netloc
        self._endpoint_url = f"{scheme}://{host}/"
        self._owns_client = client is None
        secret = (key if key is not None else os.environ.get(KEY_ENV_VAR)) or ""
        if client is None and not secret:
            raise ConfigurationError(
                f"no Cosmos DB key for {self.url}: pass key=... or set {KEY_ENV_VAR}"
            )
        with self._translating_errors("open the container"), self._cosmos_errors("open"):
            if client is None:
                client = self._connect(secret, endpoint_discovery, timeout, retry_total)
            self._client: CosmosClient = client
            try:
                self._check_consistency()
                self._container = self._open_container(create_container)
            except BaseException:
                self._close()
                raise

    # ------------------------------------------------------------------ opening

    @staticmethod
    def _parse_url(url: str) -> tuple[str, str]:
        parts = split_url(url)
        if parts.scheme != "cosmos":
            raise ConfigurationError(f"not a cosmos:// URL: {url!r}")
        if "@" in parts.netloc:
            raise ConfigurationError(
                "a cosmos:// URL carries no user or password; pass the key as ?key=... "
                f"or in {KEY_ENV_VAR}"
            )
        if not parts.hostname:
            raise ConfigurationError(
                f"a cosmos:// URL names the account host: "
                f"'cosmos://<host>[:port]/<database>/<container>', got {url!r}"
            )
        segments = parts.path.split("/")[1:]
        if len(segments) != 2 or not all(segments):
            raise ConfigurationError(
                f"expected 'cosmos://<host>[:port]/<database>/<container>', got {url!r}"
            )
        return (
            _check_name("database", unquote(segments[0]), url),
            _check_name("container", unquote(segments[1]), url),
        )

    @staticmethod
    def _check_flag(name: str, value: object) -> bool:
        if isinstance(value, bool | str):
            try:
                return parse_bool(value)
            except ValueError as exc:
                raise ConfigurationError(f"bad value for option {name!r}: {exc}") from None
        raise ConfigurationError(f"option {name!r} must be a bool, got {value!r}")

    @staticmethod
    def _check_option(name: str, value: Any, convert: Callable[[Any], _T]) -> _T:
        if isinstance(value, bool):
            raise ConfigurationError(f"bad value for option {name!r}: {value!r}")
        try:
            return convert(value)
        except (TypeError, ValueError) as exc:
            raise ConfigurationError(f"bad value for option {name!r}: {exc}") from None

    def _connect(
        self,
        secret: str,
        endpoint_discovery: bool,
        timeout: float | None,
        retry_total: int | None,
    ) -> CosmosClient:
        session = requests.Session()
        adapter = requests.adapters.HTTPAdapter(
            pool_connections=4,
            pool_maxsize=self._max_concurrency + 4,
            max_retries=Retry(total=False, redirect=False, raise_on_status=False),
        )
        session.mount("http://", adapter)
        session.mount("https://", adapter)
        kwargs: dict[str, Any] = {
            "enable_endpoint_discovery": endpoint_discovery,
            "transport": RequestsTransport(session=session, session_owner=True),
        }
        if not self._allow_weak:
            # Requests then demand Strong: if the account is ever weakened, they fail
            # (HTTP 400) instead of silently reading stale data. A client cannot ask
            # for more than the account default, so this is off for emulators.
            kwargs["consistency_level"] = "Strong"
        if timeout is not None:
            kwargs["connection_timeout"] = timeout
            kwargs["read_timeout"] = timeout
        if retry_total is not None:
            kwargs.update(retry_total=retry_total, retry_connect=retry_total)
            kwargs.update(retry_read=retry_total, retry_status=retry_total)
            kwargs.update(retry_backoff_max=1, retry_fixed_interval=100)
        try:
            return CosmosClient(self._endpoint_url, credential=secret, **kwargs)
        except binascii.Error:
            session.close()
            raise ConfigurationError(
                f"the Cosmos DB key for {self.url} is not valid base64: expected the "
                "account's primary or secondary key"
            ) from None
        except (ValueError, TypeError) as exc:
            session.close()
            detail = str(exc).replace(secret, "***").splitlines()[0] if str(exc) else ""
            raise ConfigurationError(
                f"cannot create a Cosmos DB client for {self.url}: {type(exc).__name__}: {detail}"
            ) from None
        except BaseException:
            session.close()
            raise

    def _check_consistency(self) -> None:
        account = self._client.get_database_account()
        policy = account.ConsistencyPolicy or {}
        level = str(policy.get("defaultConsistencyLevel", "unknown"))
        self._account_consistency = level
        if level == "Strong":
            if self._allow_weak:
                _log.warning(
                    "%s: allow_weak_consistency_for_emulator_only=True has no effect: the "
                    "account is already Strong; remove the option",
                    self.url,
                )
            return
        if not self._allow_weak:
            raise ConsistencyError(
                f"the Cosmos DB account at {self._endpoint_url} has default consistency "
                f"{level!r}; exactly-once deduplication needs 'Strong' (set it on the account; "
                "allow_weak_consistency_for_emulator_only=True exists for emulators only)"
            )
        _log.warning(
            "UNSAFE: %s opened with allow_weak_consistency_for_emulator_only=True on an account "
            "with default consistency %r: reads may miss acknowledged writes and messages may "
            "be processed twice; never use this option in production",
            self.url,
            level,
        )

    def _open_container(self, create: bool) -> ContainerProxy:
        if create:
            create_container(self._client, self._database_name, self._container_name)
        database = self._client.get_database_client(self._database_name)
        container = database.get_container_client(self._container_name)
        try:
            properties = container.read()
        except CosmosHttpResponseError as exc:
            if exc.status_code != 404:
                raise
            try:
                database.read()
            except CosmosHttpResponseError as db_exc:
                if db_exc.status_code == 404:
                    raise ConfigurationError(
                        f"Cosmos DB database {self._database_name!r} does not exist at "
                        f"{self._endpoint_url}; create it (and the container) with "
                        "create_container() or open with create_container=True"
                    ) from None
                raise
            raise ConfigurationError(
                f"Cosmos DB container {self._container_name!r} does not exist in database "
                f"{self._database_name!r}; create it with create_container() or open with "
                "create_container=True"
            ) from None
        paths = list((properties.get("partitionKey") or {}).get("paths") or [])
        if paths != [PARTITION_KEY_PATH]:
            raise ConfigurationError(
                f"Cosmos DB container {self._container_name!r} is partitioned on {paths}; "
                f"a deduplication container needs partition key path {PARTITION_KEY_PATH!r} "
                "(create it with create_container())"
            )
        ttl = properties.get("defaultTtl")
        self._default_ttl = ttl if isinstance(ttl, int) else None
        return container

    # ------------------------------------------------------------------ errors

    @contextlib.contextmanager
    def _cosmos_errors(self, operation: str) -> Iterator[None]:
        """Translate Cosmos HTTP errors by status; transport errors pass through."""
        try:
            yield
        except CosmosHttpResponseError as exc:
            raise self._translate(exc, operation) from exc

    def _translate(self, exc: CosmosHttpResponseError, operation: str) -> DedupStoreError:
        status = exc.status_code or 0
        where = f"{type(self).__name__} at {self.url}"
        summary = _http_summary(exc)
        if status in (401, 403):
            return ConfigurationError(
                f"{where}: Cosmos DB refused the credentials ({summary.split(':')[0]}); "
                f"check the key (option 'key' or {KEY_ENV_VAR})"
            )
        if status in _UNAVAILABLE_STATUSES or status >= 500:
            return StoreUnavailable(f"{where} could not {operation}: {summary}")
        if status == 404:
            return ConfigurationError(
                f"{where} could not {operation}: database {self._database_name!r} or "
                f"container {self._container_name!r} does not exist ({summary})"
            )
        if status == 400 and "consisten" in summary.lower():
            return ConsistencyError(f"{where} could not {operation}: {summary}")
        return DedupStoreError(f"{where} could not {operation}: {summary}")

    # ------------------------------------------------------------------ items

    def _body(
        self, message_id: str, doc_id: str, now: float, expires_at: float | None, token: str
    ) -> dict[str, Any]:
        if expires_at is None:
            ttl = -1
        else:
            ttl = math.ceil(max(expires_at - now, 0.0)) + _TTL_SLACK_SECONDS
            if ttl > _MAX_TTL_SECONDS:
                ttl = -1  # beyond native TTL's range: reclaimed by purge_expired()
        return {
            "id": doc_id,
            "endpoint": self._endpoint,
            "message_id": message_id,
            "expires_at": expires_at,
            "ttl": ttl,
            "write_token": token,
        }

    def _check_item(self, item: Mapping[str, Any], message_id: str) -> None:
        if item.get("endpoint") != self._endpoint or item.get("message_id") != message_id:
            raise DedupStoreError(
                f"{type(self).__name__} at {self.url}: item {item.get('id')!r} holds "
                f"({item.get('endpoint')!r:.60}, {item.get('message_id')!r:.60}), not "
                f"({self._endpoint!r:.60}, {message_id!r:.60}): a SHA-256 collision or a "
                "container shared with other data"
            )

    @staticmethod
    def _live(item: Mapping[str, Any], now: float) -> bool:
        expires_at = item.get("expires_at")
        return expires_at is None or float(expires_at) > now

    def _read_many(self, doc_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        """Items by id; absent ids are missing from the result. Strongly consistent."""
        items = self._container.read_items(
            [(doc_id, doc_id) for doc_id in doc_ids], executor=self._executor()
        )
        return {str(item["id"]): dict(item) for item in items}

    def _executor(self) -> ThreadPoolExecutor:
        pid = os.getpid()
        with self._pool_lock:
            if self._pool is None or self._pool_pid != pid:
                self._pool = ThreadPoolExecutor(
                    max_workers=self._max_concurrency, thread_name_prefix="dedupstore-cosmos"
                )
                self._pool_pid = pid
            return self._pool

    def _parallel(self, fn: Callable[[_T], _R], items: Sequence[_T]) -> list[_R]:
        """``[fn(x) for x in items]`` with up to ``max_concurrency`` calls in flight.

        On the first failure, calls not started yet are cancelled; the running ones
        are awaited, then the first failure is raised.
        """
        if len(items) == 1:
            return [fn(items[0])]
        pool = self._executor()
        futures: list[Future[_R]] = [pool.submit(fn, item) for item in items]
        pending = wait(futures, return_when=FIRST_EXCEPTION).not_done
        if pending:
            for future in pending:
                future.cancel()
            wait(pending)
        for future in futures:
            error = None if future.cancelled() else future.exception()
            if error is not None:
                raise error
        return [future.result() for future in futures]

    # ------------------------------------------------------------------ primitives

    def _add_new(self, ids: list[str], now: float, expires_at: float | None) -> set[str]:
        token = uuid.uuid4().hex
        doc_ids = {mid: document_id(self._endpoint, mid) for mid in ids}
        container = self._container

        def create(mid: str) -> tuple[str, int]:
            body = self._body(mid, doc_ids[mid], now, expires_at, token)
            try:
                container.create_item(body, no_response=True)
            except CosmosHttpResponseError as exc:
                if exc.status_code == 409:
                    return mid, 409
                raise
            return mid, 201

        def replace(entry: tuple[str, str]) -> tuple[str, int]:
            mid, etag = entry
            body = self._body(mid, doc_ids[mid], now, expires_at, token)
            try:
                container.replace_item(
                    doc_ids[mid],
                    body,
                    etag=etag,
                    match_condition=MatchConditions.IfNotModified,
                    no_response=True,
                )
            except CosmosHttpResponseError as exc:
                if exc.status_code in (404, 412):
                    return mid, exc.status_code
                raise
            return mid, 200

        recorded: set[str] = set()
        to_create, to_read = list(ids), []
        with self._cosmos_errors("record ids"):
            for _ in range(_MAX_ROUNDS):
                for mid, status in self._parallel(create, to_create) if to_create else []:
                    if status == 201:
                        recorded.add(mid)
                    else:
                        to_read.append(mid)
                to_create, to_replace = [], []
                if to_read:
                    found = self._read_many([doc_ids[mid] for mid in to_read])
                    for mid in to_read:
                        item = found.get(doc_ids[mid])
                        if item is None:  # deleted since (purge or native TTL): create again
                            to_create.append(mid)
                            continue
                        self._check_item(item, mid)
                        if item.get("write_token") == token:  # our own write, resent
                            recorded.add(mid)
                        elif not self._live(item, now):
                            to_replace.append((mid, str(item["_etag"])))
                    to_read = []
                for mid, status in self._parallel(replace, to_replace) if to_replace else []:
                    if status == 200:
                        recorded.add(mid)
                    elif status == 412:  # changed since read: look again
                        to_read.append(mid)
                    else:
                        to_create.append(mid)
                if not to_create and not to_read:
                    return recorded
        raise StoreUnavailable(
            f"{type(self).__name__} at {self.url}: {len(to_create) + len(to_read)} id(s) "
            f"changed under every one of {_MAX_ROUNDS} attempts (heavy contention); retry"
        )

    def _find(self, ids: list[str], now: float) -> set[str]:
        doc_ids = {mid: document_id(self._endpoint, mid) for mid in ids}
        with self._cosmos_errors("read ids"):
            found = self._read_many(list(doc_ids.values()))
        result: set[str] = set()
        for mid, doc_id in doc_ids.items():
            item = found.get(doc_id)
            if item is not None:
                self._check_item(item, mid)
                if self._live(item, now):
                    result.add(mid)
        return result

    def _purge(self, now: float) -> int:
        container = self._container

        def delete(entry: tuple[str, str]) -> int:
            doc_id, etag = entry
            try:
                container.delete_item(
                    doc_id, doc_id, etag=etag, match_condition=MatchConditions.IfNotModified
                )
            except CosmosHttpResponseError as exc:
                if exc.status_code in (404, 412):  # gone already, or re-recorded since
                    return 0
                raise
            return 1

        deleted = 0
        with self._cosmos_errors("purge expired records"):
            pages = container.query_items(
                "SELECT c.id, c._etag FROM c WHERE c.endpoint = @endpoint "
                "AND IS_NUMBER(c.expires_at) AND c.expires_at <= @now",
                parameters=[
                    {"name": "@endpoint", "value": self._endpoint},
                    {"name": "@now", "value": now},
                ],
                enable_cross_partition_query=True,
                max_item_count=self.max_write_batch,
            ).by_page()
            for page in pages:
                entries = [(str(item["id"]), str(item["_etag"])) for item in page]
                if entries:
                    deleted += sum(self._parallel(delete, entries))
        return deleted

    def _health_warnings(self) -> list[str]:
        warnings = []
        if self._account_consistency != "Strong":
            warnings.append(
                f"UNSAFE: the Cosmos DB account's default consistency is "
                f"{self._account_consistency!r}, not 'Strong' "
                "(allow_weak_consistency_for_emulator_only=True): duplicates are possible"
            )
        if self._retention is not None and self._default_ttl is None:
            warnings.append(
                f"container {self._container_name!r} has no default TTL, so per-item TTL is "
                "off: expired records stay until purge_expired() (set default TTL to -1)"
            )
        return warnings

    def _close(self) -> None:
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None and self._pool_pid == os.getpid():
            pool.shutdown(wait=True)
        if self._owns_client and getattr(self, "_client", None) is not None:
            self._client.close()
