"""``redis://`` and ``rediss://``: a deduplication store on a Redis primary.

One string key per (endpoint, id): ``<key_prefix><endpoint>:<id>``, both parts
escaped (``%`` ``:`` ``{`` ``}`` become ``%25`` ``%3A`` ``%7B`` ``%7D``), so no
(endpoint, id) pair can share a key with another and no id can form a Redis
Cluster hash tag. The value is ``<token>|<expiry>`` (``<expiry>`` empty when the
record never expires). A batch is one ``EVALSHA`` of a Lua script per chunk: for
each key, record it when it is absent, expired by the caller's clock, or holds a
token of this caller; Redis runs a script atomically, so of concurrent callers
exactly one records each id. Reads are one ``MGET`` per chunk, compared with the
client's clock (never the server's). Records with a retention also get a native
TTL, only to reclaim space: relative to the write (``PX`` = retention + 60 s), so
an offset between the client's and the server's clocks never shortens a record.

Retries: every command, writes included, is retried by redis-py on connection
errors and timeouts (``retries``). Writes are safe to retry because each call
writes a random token: a retried script treats "holds my token" as "recorded by
me". When a write fails (``StoreUnavailable``), its tokens are remembered by the
store object, so retrying ``add``/``add_many`` on the SAME object still returns
``True`` for the ids the failed call may have written.

Durability: acknowledged records survive a server crash only with
``appendonly yes`` and ``appendfsync always`` (see :meth:`health_warnings`).
Replication is asynchronous; ``wait_replicas=N`` makes every write wait (``WAIT``)
for N replicas and raises ``StoreUnavailable`` when fewer acknowledged in
``wait_timeout_ms``: the records are then on the primary but their durability is
unknown, and a retry on the same store object reports them as recorded by it.
``WAIT`` narrows, but does not close, the window in which a failover loses records.

Not supported yet: Redis Cluster (refused at open; the multi-key script needs
keys grouped by slot) and replicas as the URL's host (refused at open: reads could
be stale). A server that becomes a replica later refuses writes (``StoreUnavailable``)
but would still answer reads: give an address that follows the primary.
"""

from __future__ import annotations

import math
import secrets
import threading
from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.connection import ConnectionPool, parse_url
from redis.exceptions import (
    AuthenticationError,
    AuthorizationError,
    InvalidResponse,
    NoPermissionError,
    NoScriptError,
    ResponseError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from dedupstore.errors import ConfigurationError, ConsistencyError, StoreUnavailable
from dedupstore.store import Clock, DeduplicationStore
from dedupstore.urls import split_url

if TYPE_CHECKING:
    from redis.commands.core import Script

__all__ = ["RedisDeduplicationStore", "record_key"]

_ESCAPES = str.maketrans({"%": "%25", ":": "%3A", "{": "%7B", "}": "%7D"})
_GLOB_ESCAPES = str.maketrans({c: "\\" + c for c in "*?[]\\"})

#: Native TTL = retention + this margin: clock skew between clients never loses a record.
_NATIVE_TTL_GRACE_MS = 60_000
#: Ids whose last write failed, remembered (with the tokens tried) for a retry.
_MAX_PENDING_IDS = 100_000
_MAX_TOKENS_PER_ID = 32
_SCAN_COUNT = 1000
#: Option defaults, left out of ``repr`` and of the pickled options.
_DEFAULTS: dict[str, Any] = {
    "key_prefix": "dedup:",
    "socket_timeout": 5.0,
    "socket_connect_timeout": 5.0,
    "retries": 3,
    "wait_replicas": 0,
    "wait_timeout_ms": 1000,
}

# KEYS: record keys. ARGV: now, new value, native TTL in ms ('' = none), then the
# tokens that mean "written by this caller" (the new one and those of failed tries).
# Decides every key before writing any, so an error leaves nothing half-written.
_ADD_SCRIPT = """
local now = tonumber(ARGV[1])
local mine = {}
for i = 4, #ARGV do mine[ARGV[i]] = true end
local current = redis.call('MGET', unpack(KEYS))
local todo = {}
for i = 1, #KEYS do
  local value = current[i]
  if not value then
    todo[#todo + 1] = i
  else
    local sep = string.find(value, '|', 1, true)
    if not sep then
      return redis.error_reply('DEDUPSTORE a key of this store holds a foreign value')
    end
    local expiry = string.sub(value, sep + 1)
    if mine[string.sub(value, 1, sep - 1)] then
      todo[#todo + 1] = i
    elseif expiry ~= '' then
      local e = tonumber(expiry)
      if not e then
        return redis.error_reply('DEDUPSTORE a key of this store holds a foreign value')
      end
      if e <= now then todo[#todo + 1] = i end
    end
  end
end
if #todo > 0 then
  if ARGV[3] == '' then
    local pairs_ = {}
    for _, i in ipairs(todo) do
      pairs_[#pairs_ + 1] = KEYS[i]
      pairs_[#pairs_ + 1] = ARGV[2]
    end
    redis.call('MSET', unpack(pairs_))
  else
    for _, i in ipairs(todo) do
      redis.call('SET', KEYS[i], ARGV[2], 'PX', ARGV[3])
    end
  end
end
return todo
"""

# KEYS: candidate keys from SCAN. ARGV: now. Deletes those whose stored expiry <= now.
_PURGE_SCRIPT = """
local now = tonumber(ARGV[1])
local deleted = 0
for i = 1, #KEYS do
  if redis.call('TYPE', KEYS[i])['ok'] == 'string' then
    local current = redis.call('GET', KEYS[i])
    local sep = string.find(current, '|', 1, true)
    if sep then
      local e = tonumber(string.sub(current, sep + 1))
      if e and e <= now then
        redis.call('DEL', KEYS[i])
        deleted = deleted + 1
      end
    end
  end
end
return deleted
"""


def _escape(part: str) -> str:
    # str.translate with a mapping costs microseconds; most ids need no escaping at all.
    if "%" in part or ":" in part or "{" in part or "}" in part:
        return part.translate(_ESCAPES)
    return part


def record_key(key_prefix: str, endpoint: str, message_id: str) -> str:
    """Return the Redis key of (endpoint, id): injective, no ``:`` or braces in the parts."""
    return f"{key_prefix}{_escape(endpoint)}:{_escape(message_id)}"


def _positive_float_or_none(value: str | float | None) -> float | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in {"", "none"}):
        return None
    result = float(value)
    if not result > 0:
        raise ValueError(f"expected a positive number of seconds, got {value!r}")
    return result


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


class RedisDeduplicationStore(DeduplicationStore):
    """Deduplication store on a Redis primary; safe across threads and processes.

    Needs a standalone Redis primary (not Cluster, not a replica); durable only
    with ``appendonly yes`` + ``appendfsync always``. Raises ``StoreUnavailable``
    (the redis-py error chained) whenever Redis cannot answer.
    """

    schemes: ClassVar[tuple[str, ...]] = ("redis", "rediss")
    # The script unpack()s 2 values per key: Lua's stack allows about 8000.
    max_write_batch: ClassVar[int] = 1000
    max_read_batch: ClassVar[int] = 2000
    # Two chunks in flight: Python builds and parses one while the server runs the
    # other (each script runs atomically, so first-writer-wins is unaffected).
    chunk_concurrency: ClassVar[int] = 2
    url_options: ClassVar[Mapping[str, Any]] = {
        "key_prefix": str,
        "socket_timeout": _positive_float_or_none,
        "socket_connect_timeout": _positive_float_or_none,
        "retries": int,
        "max_connections": int,
        "wait_replicas": int,
        "wait_timeout_ms": int,
        "username": str,
        "password": str,
        "ssl_ca_certs": str,
        "ssl_cert_reqs": str,
    }

    def __init__(
        self,
        url: str,
        *,
        endpoint: str = "default",
        retention: timedelta | None = None,
        clock: Clock | None = None,
        key_prefix: str = "dedup:",
        socket_timeout: float | None = 5.0,
        socket_connect_timeout: float | None = 5.0,
        retries: int = 3,
        max_connections: int | None = None,
        wait_replicas: int = 0,
        wait_timeout_ms: int = 1000,
        username: str | None = None,
        password: str | None = None,
        ssl_ca_certs: str | None = None,
        ssl_cert_reqs: str | None = None,
        client: redis.Redis | None = None,
    ) -> None:
        """Connect to the Redis primary named by ``url`` and check it (``PING``).

        ``url`` is ``redis[s]://[[user]:password@]host[:port][/db]``; its query holds
        the options below. ``key_prefix`` (``''`` or ending with ``:``) namespaces the
        keys. ``retries`` is how often redis-py retries a command after a connection
        error or timeout (with jittered exponential backoff). ``wait_replicas`` > 0
        makes every write wait for that many replicas, at most ``wait_timeout_ms``
        (which must be shorter than ``socket_timeout``). ``client`` is a ready
        ``redis.Redis`` (its own timeouts and retries apply; not closed by
        :meth:`close`, not pickled).

        Raises ``ConfigurationError`` for bad options, a wrong password or missing
        permissions, or a Redis Cluster; ``ConsistencyError`` when the server is a
        replica; ``StoreUnavailable`` when the server cannot be reached.
        """
        if not isinstance(key_prefix, str) or not (key_prefix == "" or key_prefix.endswith(":")):
            raise ConfigurationError(
                f"key_prefix must be '' or end with ':' (so that two prefixes never share "
                f"keys), got {key_prefix!r}"
            )
        try:
            key_prefix.encode("utf-8")
        except UnicodeEncodeError:
            raise ConfigurationError("key_prefix must be valid Unicode text") from None
        for name, value in (("retries", retries), ("wait_replicas", wait_replicas)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigurationError(f"{name} must be an integer >= 0, got {value!r}")
        if isinstance(wait_timeout_ms, bool) or not isinstance(wait_timeout_ms, int):
            raise ConfigurationError(f"wait_timeout_ms must be an integer, got {wait_timeout_ms!r}")
        if wait_timeout_ms <= 0:
            raise ConfigurationError(
                f"wait_timeout_ms must be > 0 (0 would wait forever), got {wait_timeout_ms}"
            )
        try:
            socket_timeout = _positive_float_or_none(socket_timeout)
            socket_connect_timeout = _positive_float_or_none(socket_connect_timeout)
        except (TypeError, ValueError) as exc:
            raise ConfigurationError(f"bad socket timeout: {exc}") from None
        if (
            wait_replicas
            and socket_timeout is not None
            and wait_timeout_ms >= socket_timeout * 1000
        ):
            raise ConfigurationError(
                f"wait_timeout_ms ({wait_timeout_ms}) must be shorter than socket_timeout "
                f"({socket_timeout} s), or the WAIT would time out the connection"
            )
        if max_connections is not None and (
            isinstance(max_connections, bool)
            or not isinstance(max_connections, int)
            or max_connections < 1
        ):
            raise ConfigurationError(f"max_connections must be >= 1, got {max_connections!r}")
        parts = split_url(url)
        if parts.scheme not in self.schemes:
            raise ConfigurationError(f"not a redis:// or rediss:// URL: {parts.scheme}://")
        given: dict[str, Any] = {
            "key_prefix": key_prefix,
            "socket_timeout": socket_timeout,
            "socket_connect_timeout": socket_connect_timeout,
            "retries": retries,
            "max_connections": max_connections,
            "wait_replicas": wait_replicas,
            "wait_timeout_ms": wait_timeout_ms,
            "username": username,
            "password": password,
            "ssl_ca_certs": ssl_ca_certs,
            "ssl_cert_reqs": ssl_cert_reqs,
            "client": client,
        }
        super().__init__(
            url,
            endpoint=endpoint,
            retention=retention,
            clock=clock,
            options={name: value for name, value in given.items() if value != _DEFAULTS.get(name)},
        )
        self._unavailable_errors = (
            RedisConnectionError,
            RedisTimeoutError,
            ResponseError,
            InvalidResponse,
        )
        self._key_base = f"{key_prefix}{_escape(self._endpoint)}:"
        self._scan_pattern = self._key_base.translate(_GLOB_ESCAPES) + "*"
        self._wait_replicas = wait_replicas
        self._wait_timeout_ms = wait_timeout_ms
        self._pending: dict[str, list[str]] = {}
        self._pending_lock = threading.Lock()
        self._owns_client = client is None
        if client is None:
            client = self._connect(
                parts.scheme,
                socket_timeout=socket_timeout,
                socket_connect_timeout=socket_connect_timeout,
                retries=retries,
                max_connections=max_connections,
                username=username,
                password=password,
                ssl_ca_certs=ssl_ca_certs,
                ssl_cert_reqs=ssl_cert_reqs,
            )
        self._client: redis.Redis = client
        self._add_script: Script = client.register_script(_ADD_SCRIPT)
        self._purge_script: Script = client.register_script(_PURGE_SCRIPT)
        try:
            self._probe()
        except BaseException:
            if self._owns_client:
                self._client.connection_pool.disconnect()
            raise

    # ------------------------------------------------------------------ opening

    def _connect(
        self,
        scheme: str,
        *,
        socket_timeout: float | None,
        socket_connect_timeout: float | None,
        retries: int,
        max_connections: int | None,
        username: str | None,
        password: str | None,
        ssl_ca_certs: str | None,
        ssl_cert_reqs: str | None,
    ) -> redis.Redis:
        """Build a client with its own pool from the URL (query removed) and options."""
        parts = urlsplit(self._url)
        try:
            kwargs: dict[str, Any] = parse_url(  # type: ignore[no-untyped-call]
                urlunsplit(parts._replace(query="", fragment=""))
            )
        except ValueError as exc:
            raise ConfigurationError(f"bad Redis URL {self.url}: {exc}") from None
        if parts.path not in ("", "/") and "db" not in kwargs:
            raise ConfigurationError(
                f"bad Redis URL {self.url}: the path must be a database number such as /0"
            )
        if username is not None:
            kwargs["username"] = username
        if password is not None:
            kwargs["password"] = password
        if scheme == "rediss":
            if ssl_ca_certs is not None:
                kwargs["ssl_ca_certs"] = ssl_ca_certs
            if ssl_cert_reqs is not None:
                kwargs["ssl_cert_reqs"] = ssl_cert_reqs
        elif ssl_ca_certs is not None or ssl_cert_reqs is not None:
            raise ConfigurationError("ssl_ca_certs and ssl_cert_reqs need a rediss:// URL")
        retry = Retry(ExponentialWithJitterBackoff(cap=1.0, base=0.05), retries)
        pool = ConnectionPool(
            **kwargs,
            socket_timeout=socket_timeout,
            socket_connect_timeout=socket_connect_timeout,
            max_connections=max_connections,
            retry=retry,
        )
        return redis.Redis(connection_pool=pool)

    def _probe(self) -> None:
        """``PING`` and check the server: a primary, not a cluster, scripts allowed."""
        try:
            with self._translating_errors("connect"):
                pipe = self._client.pipeline(transaction=False)
                pipe.ping()
                pipe.script_load(_ADD_SCRIPT)
                pipe.script_load(_PURGE_SCRIPT)
                pipe.info("replication")
                pipe.info("cluster")
                _, _, _, replication, cluster = pipe.execute()
        except StoreUnavailable as exc:
            cause = exc.__cause__
            if isinstance(cause, AuthenticationError | AuthorizationError | NoPermissionError):
                raise ConfigurationError(
                    f"{type(self).__name__} cannot log in to {self.url} (wrong or missing "
                    "username/password, or an ACL user without the needed commands): "
                    f"{type(cause).__name__}: {_first_line(cause)}"
                ) from cause
            raise
        if isinstance(cluster, Mapping) and str(cluster.get("cluster_enabled", "0")) == "1":
            raise ConfigurationError(
                f"{self.url} is a Redis Cluster node; RedisDeduplicationStore needs a standalone "
                "primary (Redis Cluster is not supported yet)"
            )
        if isinstance(replication, Mapping) and replication.get("role") not in (None, "master"):
            raise ConsistencyError(
                f"{self.url} is a read-only replica (role {replication.get('role')!r}): its reads "
                "can be stale; point the store at the primary"
            )

    # ------------------------------------------------------------------ primitives

    def _add_new(self, ids: list[str], now: float, expires_at: float | None) -> set[str]:
        """One script run (plus ``WAIT`` when configured) for the whole chunk."""
        token = secrets.token_urlsafe(12)
        with self._pending_lock:
            earlier = [t for mid in ids if mid in self._pending for t in self._pending.pop(mid)]
        value = f"{token}|{'' if expires_at is None else repr(float(expires_at))}"
        ttl = (
            ""
            if expires_at is None
            else str(math.ceil((expires_at - now) * 1000) + _NATIVE_TTL_GRACE_MS)
        )
        keys = [self._key_base + _escape(mid) for mid in ids]
        args = [repr(float(now)), value, ttl, token, *dict.fromkeys(earlier)]
        try:
            indexes = self._run_add(keys, args)
        except BaseException:
            self._remember(ids, [*earlier, token])
            raise
        return {ids[i - 1] for i in indexes}

    def _run_add(self, keys: list[str], args: list[str]) -> list[int]:
        try:
            if not self._wait_replicas:
                return list(self._add_script(keys=keys, args=args))
            try:
                indexes, acknowledged = self._add_and_wait(keys, args)
            except NoScriptError:  # the server restarted or flushed its scripts
                self._client.script_load(_ADD_SCRIPT)
                indexes, acknowledged = self._add_and_wait(keys, args)
        except ResponseError as exc:
            if str(exc).startswith("DEDUPSTORE"):
                raise self._foreign_value_error() from exc
            raise
        if int(acknowledged) < self._wait_replicas:
            raise StoreUnavailable(
                f"{type(self).__name__} at {self.url}: only {acknowledged} of "
                f"{self._wait_replicas} replicas acknowledged the write within "
                f"{self._wait_timeout_ms} ms; the records are on the primary but their "
                "durability is unknown (retrying on this store object reports them as "
                "recorded by it)"
            )
        return list(indexes)

    def _add_and_wait(self, keys: list[str], args: list[str]) -> tuple[list[int], int]:
        """The script then ``WAIT``, pipelined on one connection (``WAIT`` counts its writes)."""
        pipe = self._client.pipeline(transaction=False)
        pipe.evalsha(self._add_script.sha, len(keys), *keys, *args)
        pipe.wait(self._wait_replicas, self._wait_timeout_ms)
        indexes, acknowledged = pipe.execute()
        return list(indexes), int(acknowledged)

    def _foreign_value_error(self) -> ConfigurationError:
        return ConfigurationError(
            f"{type(self).__name__} at {self.url}: a key under {self._key_base!r} holds a "
            "value dedupstore did not write; the key_prefix must be reserved for this store"
        )

    def _remember(self, ids: list[str], tokens: list[str]) -> None:
        """Keep the tokens a failed write may have stored, for a retry of these ids."""
        with self._pending_lock:
            for mid in ids:
                known = self._pending.pop(mid, [])
                known.extend(t for t in tokens if t not in known)
                if len(known) > _MAX_TOKENS_PER_ID:
                    known = known[:1] + known[-(_MAX_TOKENS_PER_ID - 1) :]
                self._pending[mid] = known
            while len(self._pending) > _MAX_PENDING_IDS:
                del self._pending[next(iter(self._pending))]

    def _find(self, ids: list[str], now: float) -> set[str]:
        """One ``MGET``; a record counts when its stored expiry is empty or ``> now``."""
        values = self._client.mget([self._key_base + _escape(mid) for mid in ids])
        found: set[str] = set()
        for mid, value in zip(ids, values, strict=True):
            if value is None:
                continue
            raw = value if isinstance(value, bytes) else str(value).encode("utf-8")
            _, sep, expiry = raw.partition(b"|")
            try:
                if not sep:
                    raise ValueError("no separator")
                if not expiry or float(expiry) > now:
                    found.add(mid)
            except ValueError:
                raise self._foreign_value_error() from None
        return found

    def _purge(self, now: float) -> int:
        """``SCAN`` this endpoint's keys; a script deletes those expired by ``now``."""
        base = self._key_base.encode("utf-8")
        deleted = 0
        cursor: int = 0
        while True:
            cursor, keys = self._client.scan(cursor, match=self._scan_pattern, count=_SCAN_COUNT)
            mine = [
                key
                for key in (k if isinstance(k, bytes) else str(k).encode("utf-8") for k in keys)
                if key.startswith(base) and b":" not in key[len(base) :]
            ]
            if mine:
                deleted += int(self._purge_script(keys=mine, args=[repr(float(now))]))
            if int(cursor) == 0:
                return deleted

    def _health_warnings(self) -> list[str]:
        """Warn about settings that can lose acknowledged records."""
        warnings: list[str] = []
        config: dict[str, str] = {}
        pipe = self._client.pipeline(transaction=False)
        for name in ("appendonly", "appendfsync", "maxmemory", "maxmemory-policy"):
            pipe.config_get(name)
        pipe.info("persistence")
        pipe.info("replication")
        *answers, persistence, replication = pipe.execute(raise_on_error=False)
        for answer in answers:
            if isinstance(answer, Exception):
                if isinstance(answer, ResponseError):
                    config.clear()
                    warnings.append(
                        "could not check appendfsync and maxmemory-policy: CONFIG GET is not "
                        f"allowed ({_first_line(answer)}); acknowledged records survive a crash "
                        "only with appendonly yes and appendfsync always, and eviction must be "
                        "off (maxmemory-policy noeviction)"
                    )
                    break
                raise answer
            config.update({_text(k): _text(v) for k, v in dict(answer).items()})
        if isinstance(persistence, Exception):
            raise persistence
        if isinstance(replication, Exception):
            raise replication
        aof = config.get(
            "appendonly", "yes" if str(persistence.get("aof_enabled")) == "1" else "no"
        )
        if aof != "yes":
            warnings.append(
                "the server has no append-only file (appendonly no): acknowledged records "
                "are lost when Redis crashes or restarts; set appendonly yes and "
                "appendfsync always"
            )
        elif "appendfsync" in config and config["appendfsync"] != "always":
            warnings.append(
                f"appendfsync is {config['appendfsync']!r}, not 'always': records acknowledged "
                "in the last second or so are lost if the server crashes"
            )
        policy = config.get("maxmemory-policy")
        if policy is not None and policy != "noeviction":
            warnings.append(
                f"maxmemory-policy is {policy!r} (maxmemory {config.get('maxmemory')}): when "
                "memory is full Redis may evict records, silently forgetting processed ids; "
                "use noeviction"
            )
        replicas = int(replication.get("connected_slaves", 0))
        if replicas and not self._wait_replicas:
            warnings.append(
                f"the primary has {replicas} replica(s) and replication is asynchronous: after a "
                "failover, acknowledged records can be missing; set wait_replicas"
            )
        return warnings

    def _close(self) -> None:
        if self._owns_client:
            self._client.connection_pool.disconnect()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""
