"""``cosmos://<host>[:port]/<database>/<container>?...``: Azure Cosmos DB (NoSQL API).

One item per (endpoint, message id). Its ``id`` is the hex SHA-256 of the
length-prefixed UTF-8 (endpoint, message id): Cosmos DB ids may not contain
``/ \\ ? #``, are limited to 255 characters and travel in request URLs, so raw ids
(up to 1024 bytes, any character) cannot be used. The item also holds the endpoint
and message id, compared on every read: a mismatch (a SHA-256 collision, or a
container shared with other data) raises ``ConfigurationError``, never a merge.

The partition key path is ``/id`` (the hashed id): records spread evenly over
physical partitions. Reads use the SDK's read-many (one ``id IN (...)`` query per
physical partition); a lone id is a single-partition query, which (unlike a point
read, whose 404 the SDK reports as "absent") fails loudly if the container is gone.

Correctness rests on three native guarantees:

* ``create_item`` is atomic per id: 409 Conflict means the id is already there, so
  of concurrent writers exactly one creates it (first writer wins);
* an expired record is overwritten by ``replace_item`` with ``If-Match`` on the
  ``_etag`` that was read: a 412 means another writer changed it first;
* the account's default consistency is **Strong**, checked at open (weaker accounts
  raise ``ConsistencyError``); requests then ask for Strong explicitly, so an account
  weakened later makes them fail loudly rather than read stale data.

Every item records the write token of the call that wrote it. An item holding a
token of this call (a create or replace resent by the transport, or a retry on the
same store object after ``StoreUnavailable``) is this call's own write: reported as
recorded, exactly once. ``add_many`` sends one ``create_item`` per id (at most
``max_concurrency`` in flight), then one read-many for the ids that already existed.

Expiry is judged by the CLIENT's clock (``clock``, ``time.time`` by default): every
client of a container must keep its clock in sync (NTP). Items carry ``expires_at``
(compared with the clock on every read) and a native ``ttl`` of the retention plus
``max_clock_skew``, which only reclaims space (the emulator ignores it); records
without retention carry ``ttl: -1``. Per-item TTL needs the container's default TTL
set: :func:`create_container` sets ``-1``. ``purge_expired`` deletes (``If-Match``)
only records expired for longer than ``max_clock_skew``.

Options (URL query or keyword; ``clock`` and ``client`` keyword only):

=============================================  ==========  ==========================
``key``                                        COSMOS_KEY  account key (secret; one
                                                           from the environment is
                                                           not pickled)
``tls``                                        true        false: plain ``http://``
``endpoint_discovery``                         true        follow regional endpoints
``allow_weak_consistency_for_emulator_only``   false       see below
``create``                                     false       create database, container
``max_concurrency``                            32          requests in flight
``timeout``                                    10 s        read timeout per request
``connect_timeout``                            5 s         connect timeout per request
``retries``                                    3           SDK retries per request
``max_clock_skew``                             60 s        see above
``clock``                                      time.time   epoch seconds for expiry
``client``                                     none        a ready ``CosmosClient``
                                                           (not pickled, not closed;
                                                           key, tls, timeouts and
                                                           retries then unused)
=============================================  ==========  ==========================

``allow_weak_consistency_for_emulator_only`` is **UNSAFE in production.** It opens an
account whose default consistency is weaker than Strong (the emulator reports
"Session"); reads may then miss acknowledged writes and messages may be processed
twice. Logged as a WARNING at every open.

Failures: a request that gets no answer fails after ``connect_timeout + timeout``;
connection failures, reads and throttling (429) are retried ``retries`` times (about
a second apart); a write whose answer was lost is not resent (its token settles it on
a retry). So a call gives up after about ``(retries + 1) * (connect_timeout + timeout
+ 1)`` seconds (default 64 s); with endpoint discovery, reads answered 408/5xx are
also tried once per region. ``StoreUnavailable`` (unreachable, timeout, throttling,
5xx): retry; its ``recorded`` ids were recorded by the call, its ``unknown`` ids may
have been (a retry on the same store object reports those as recorded).
``ConfigurationError``: rejected key, missing database or container, a container of
another shape or shared with other data. ``ConsistencyError``: weaker than Strong.
"""

from __future__ import annotations

import binascii
import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Final, TypeVar
from urllib.parse import unquote

import requests
from azure.core import MatchConditions
from azure.core.exceptions import AzureError, HttpResponseError
from azure.core.pipeline.transport import RequestsTransport
from azure.cosmos import CosmosClient, PartitionKey
from azure.cosmos.documents import ConnectionPolicy
from azure.cosmos.exceptions import CosmosHttpResponseError
from urllib3.util.retry import Retry

from dedupstore.client import ErrorKind, ProcessLocal
from dedupstore.errors import (
    ConfigurationError,
    ConsistencyError,
    StoreUnavailable,
)
from dedupstore.options import (
    Option,
    OptionSet,
    boolean,
    client_option,
    connect_timeout_option,
    create_option,
    integer,
    retries_option,
    text,
    timeout_option,
)
from dedupstore.store import CLOCK, MAX_CLOCK_SKEW, DeduplicationStore, WriteRequest
from dedupstore.urls import StoreURL

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
_MAX_TTL_SECONDS: Final = 2**31 - 1
#: Rounds of create / read / replace before giving up on a contended id.
_MAX_ROUNDS: Final = 8
#: HTTP statuses meaning "the service could not answer now" (retryable).
_UNAVAILABLE_STATUSES: Final = frozenset({0, 408, 410, 429, 449, 503})
#: Sub-statuses: 403/3 write forbidden (failover), 404/1002 session not available.
_RETRYABLE_SUB_STATUSES: Final = frozenset({(403, 3), (404, 1002)})
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


def _cosmos_client(value: object) -> object:
    if value is not None and not isinstance(value, CosmosClient):
        raise TypeError(f"expected an azure.cosmos.CosmosClient, got {type(value).__name__}")
    return value


@dataclass(frozen=True)
class _Connection:
    """This process's client and container proxy; ``owned``: we close the client."""

    client: CosmosClient
    container: ContainerProxy
    owned: bool


def _close_connection(connection: _Connection) -> None:
    if connection.owned:
        connection.client.close()


class CosmosDeduplicationStore(DeduplicationStore):
    """Deduplication store in an Azure Cosmos DB (NoSQL API) container.

    Linearizable on an account whose default consistency is Strong (else
    ``ConsistencyError`` at open) with a container partitioned on ``/id`` (see
    :func:`create_container`). Expiry is judged by the client's clock: keep the
    clients' clocks in sync. ``add_many`` costs one create request per id
    (``max_concurrency`` in flight) plus one read-many when some ids existed;
    ``processed_among`` one read-many per chunk of 1000. Raises ``StoreUnavailable``
    (retry), ``ConfigurationError`` (key, database, container), ``ConsistencyError``,
    ``StoreClosed``. Thread-safe; after ``fork`` a child opens its own client.
    """

    schemes: ClassVar[tuple[str, ...]] = ("cosmos",)
    max_write_batch: ClassVar[int] = 1000
    max_read_batch: ClassVar[int] = 1000
    declared_options: ClassVar[OptionSet] = DeduplicationStore.declared_options.extend(
        CLOCK,
        MAX_CLOCK_SKEW,
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
        create_option(False, "create the database and container", formerly=("create_container",)),
        Option("max_concurrency", integer(1, 1000), 32, "requests in flight per batch"),
        timeout_option(10.0, "seconds: read timeout of each request"),
        connect_timeout_option(5.0),
        retries_option(
            3, "SDK retries of a failed or throttled request", formerly=("retry_total",)
        ),
        dataclasses.replace(
            client_option("a ready CosmosClient (key, tls, timeouts and retries are then unused)"),
            convert=_cosmos_client,
        ),
    )

    def __init__(self, url: str | StoreURL, /, **options: Any) -> None:
        """Connect, check the account's consistency and the container.

        ``allow_weak_consistency_for_emulator_only=True`` is UNSAFE in production:
        it accepts an account weaker than Strong (only for emulators, which report
        "Session"); a client cannot raise consistency above the account default, so
        such a store is not linearizable. ``client`` is a ready ``CosmosClient`` (not
        pickled, not closed, shared with forked children; requests use its own
        consistency setting; the account is still checked).

        Raises ``ConsistencyError`` for a weak account, ``ConfigurationError`` for a
        bad URL or option, a missing or rejected key, a missing database or
        container, and ``StoreUnavailable`` when the service cannot be reached.
        """
        super().__init__(url, **options)
        self._database_name, self._container_name = self._names()
        opts = self._opts
        self._max_skew: float = opts["max_clock_skew"]
        self._account_consistency = "unknown"
        self._default_ttl: int | None = None
        self._endpoint_url = f"{'https' if opts['tls'] else 'http'}://{self._url.netloc}/"
        self._secret: str = opts["key"] or os.environ.get(KEY_ENV_VAR, "")
        if opts["client"] is None and not self._secret:
            raise ConfigurationError(
                f"no Cosmos DB key for {self.url}: pass key=... or set {KEY_ENV_VAR}"
            )
        self._pool: ProcessLocal[ThreadPoolExecutor] = ProcessLocal(
            lambda: ThreadPoolExecutor(
                max_workers=opts["max_concurrency"], thread_name_prefix="dedupstore-cosmos"
            ),
            lambda pool: pool.shutdown(wait=True),
        )
        self._conn: ProcessLocal[_Connection] = ProcessLocal(self._connect, _close_connection)
        try:
            with self._translating_errors("open"):
                client = self._conn.get().client
                self._check_consistency(client)
                self._check_container(client)
        except BaseException:
            self._close()
            raise

    # ------------------------------------------------------------------ opening

    def _names(self) -> tuple[str, str]:
        url = self._url
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

    def _connect(self) -> _Connection:
        """This process's client (the given one, or a new one) and container proxy."""
        client = self._opts["client"]
        owned = client is None
        if client is None:
            client = self._new_client()
        database = client.get_database_client(self._database_name)
        return _Connection(client, database.get_container_client(self._container_name), owned)

    def _new_client(self) -> CosmosClient:
        opts = self._opts
        session = requests.Session()
        adapter = requests.adapters.HTTPAdapter(
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
            "transport": RequestsTransport(session=session, session_owner=True),
            "enable_endpoint_discovery": opts["endpoint_discovery"],
            "connection_timeout": opts["connect_timeout"],
            "read_timeout": opts["timeout"],
            "retry_total": opts["retries"],
            "retry_connect": opts["retries"],
            "retry_read": opts["retries"],
            "retry_backoff_max": 1,
            "retry_throttle_backoff_max": throttle_wait,
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

    def _check_container(self, client: CosmosClient) -> None:
        if self._opts["create"]:
            create_container(client, self._database_name, self._container_name)
        database = client.get_database_client(self._database_name)
        fix = "create it with create_container() or open with create=true"
        try:
            properties = database.get_container_client(self._container_name).read()
        except CosmosHttpResponseError as exc:
            if exc.status_code != 404:
                raise
            try:
                database.read()
            except CosmosHttpResponseError as db_exc:
                if db_exc.status_code == 404:
                    raise ConfigurationError(
                        f"Cosmos DB database {self._database_name!r} does not exist at "
                        f"{self._endpoint_url}; {fix} (it creates the container too)"
                    ) from None
                raise
            raise ConfigurationError(
                f"Cosmos DB container {self._container_name!r} does not exist in database "
                f"{self._database_name!r}; {fix}"
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

    # ------------------------------------------------------------------ errors

    def _classify_error(self, exc: BaseException) -> ErrorKind:
        where = f"{type(self).__name__} at {self.url}"
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
                return ConfigurationError(
                    f"{where}: Cosmos DB refused the credentials ({summary}); "
                    f"check the key (option 'key' or {KEY_ENV_VAR})"
                )
            if status == 404:
                return ConfigurationError(
                    f"{where}: database {self._database_name!r} or container "
                    f"{self._container_name!r} does not exist ({summary}); "
                    "create it with create_container() or open with create=true"
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

    # ------------------------------------------------------------------ items

    def _body(self, message_id: str, doc_id: str, request: WriteRequest) -> dict[str, Any]:
        ttl = -1
        if request.expires_at is not None:
            ttl = math.ceil(max(request.expires_at - request.now, 0.0) + self._max_skew)
            if ttl > _MAX_TTL_SECONDS:
                ttl = -1  # beyond native TTL's range: reclaimed by purge_expired()
        return {
            "id": doc_id,
            "endpoint": self._endpoint,
            "message_id": message_id,
            "expires_at": request.expires_at,
            "ttl": ttl,
            "write_token": request.token,
        }

    def _check_item(self, item: Mapping[str, Any], message_id: str) -> None:
        if item.get("endpoint") != self._endpoint or item.get("message_id") != message_id:
            raise ConfigurationError(
                f"{type(self).__name__} at {self.url}: item {item.get('id')!r} holds "
                f"({item.get('endpoint')!r:.60}, {item.get('message_id')!r:.60}), not "
                f"({self._endpoint!r:.60}, {message_id!r:.60}): a container shared with "
                "other data (or a SHA-256 collision); use a container of its own"
            )

    @staticmethod
    def _live(item: Mapping[str, Any], now: float) -> bool:
        expires_at = item.get("expires_at")
        return expires_at is None or float(expires_at) > now

    def _read_many(self, container: ContainerProxy, doc_ids: Sequence[str]) -> dict[str, Any]:
        """Items by id; absent ids are missing from the result. Strongly consistent."""
        if len(doc_ids) == 1:  # not a point read: the SDK reports its 404 as "absent"
            items: Any = container.query_items(
                "SELECT * FROM c WHERE c.id = @id",
                parameters=[{"name": "@id", "value": doc_ids[0]}],
                partition_key=doc_ids[0],
            )
        else:
            items = container.read_items([(d, d) for d in doc_ids], executor=self._pool.get())
        return {str(item["id"]): item for item in items}

    def _parallel(self, fn: Callable[[_T], _R], items: Sequence[_T]) -> list[_R]:
        """``[fn(x) for x in items]`` with up to ``max_concurrency`` calls in flight.

        On the first failure, calls not started yet are cancelled; the running ones
        are awaited, then the first failure is raised.
        """
        if len(items) == 1:
            return [fn(items[0])]
        pool = self._pool.get()
        futures: list[Future[_R]] = [pool.submit(fn, item) for item in items]
        pending = wait(futures, return_when=FIRST_EXCEPTION).not_done
        for future in pending:
            future.cancel()
        wait(pending)
        for future in futures:
            error = None if future.cancelled() else future.exception()
            if error is not None:
                raise error
        return [future.result() for future in futures]

    # ------------------------------------------------------------------ primitives

    def _add_new(self, request: WriteRequest) -> set[str]:
        now, container = request.now, self._conn.get().container
        doc_ids = {mid: document_id(self._endpoint, mid) for mid in request.ids}

        def create(mid: str) -> tuple[str, int]:
            try:
                container.create_item(self._body(mid, doc_ids[mid], request), no_response=True)
            except CosmosHttpResponseError as exc:
                if exc.status_code == 409:
                    return mid, 409
                raise
            return mid, 201

        def replace(entry: tuple[str, str]) -> tuple[str, int]:
            mid, etag = entry
            try:
                container.replace_item(
                    doc_ids[mid],
                    self._body(mid, doc_ids[mid], request),
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
        to_create, to_read = list(request.ids), list[str]()
        for _ in range(_MAX_ROUNDS):
            for mid, status in self._parallel(create, to_create) if to_create else []:
                (recorded.add if status == 201 else to_read.append)(mid)
            to_create, to_replace = [], []
            if to_read:
                found = self._read_many(container, [doc_ids[mid] for mid in to_read])
                for mid in to_read:
                    item = found.get(doc_ids[mid])
                    if item is None:  # deleted since (purge or native TTL): create again
                        to_create.append(mid)
                        continue
                    self._check_item(item, mid)
                    if not self._live(item, now):
                        to_replace.append((mid, str(item["_etag"])))
                    elif item.get("write_token") in request.mine:  # this call's own write
                        recorded.add(mid)
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
        found = self._read_many(self._conn.get().container, list(doc_ids.values()))
        result: set[str] = set()
        for mid, doc_id in doc_ids.items():
            item = found.get(doc_id)
            if item is not None:
                self._check_item(item, mid)
                if self._live(item, now):
                    result.add(mid)
        return result

    def _purge(self, now: float) -> int:
        container = self._conn.get().container

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

        # Only records expired for longer than max_clock_skew: a client whose clock
        # runs up to that much ahead never deletes a record others count as live.
        pages = container.query_items(
            "SELECT c.id, c._etag FROM c WHERE c.endpoint = @endpoint "
            "AND IS_NUMBER(c.expires_at) AND c.expires_at <= @cutoff",
            parameters=[
                {"name": "@endpoint", "value": self._endpoint},
                {"name": "@cutoff", "value": now - self._max_skew},
            ],
            enable_cross_partition_query=True,
            max_item_count=self.max_write_batch,
        ).by_page()
        deleted = 0
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
        self._pool.close()
        self._conn.close()
