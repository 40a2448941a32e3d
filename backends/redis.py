"""``redis://`` and ``rediss://``: a deduplication store on a Redis primary.

One string key per (endpoint, id): ``<key_prefix><endpoint>:<id>``, both parts
escaped (``%`` ``:`` ``{`` ``}`` become ``%25`` ``%3A`` ``%7B`` ``%7D``), so no two
pairs share a key and no id forms a Redis Cluster hash tag. The value is
``dsv1:<token>``, the write token of the call that recorded it.

Writes: one ``EVALSHA`` per chunk of 1000 ids (two chunks in flight). Redis runs a
script atomically: for each key, absent -> ``SET``; holding a token of this call
(``request.mine``) -> ``SET`` again and reported as recorded; else left alone. A key
under the prefix that dedupstore did not write (another value or another type)
makes the whole chunk fail with ``ConfigurationError`` before anything is written.
Reads: one ``MGET`` per chunk of 2000 ids (``MGET`` sees a key of another type as
absent; ``has_been_processed`` refuses it).

Expiry is Redis's own (``expiry_clock = "server"``): a record with a retention is
``SET`` with ``PX`` = the retention in ms, and Redis never returns an expired key,
so the clients' clocks do not matter. ``purge_expired`` returns 0: Redis deletes
expired keys itself.

Options (URL query or keywords): ``key_prefix`` (``dedup:``; ``''`` or ending with
``:``), ``timeout`` (5 s per command; was ``socket_timeout``), ``connect_timeout``
(5 s; was ``socket_connect_timeout``), ``retries`` (3: redis-py retries a command
after a connection error or timeout, with jittered exponential backoff),
``max_connections`` (pool size, redis-py's default), ``wait_replicas`` (0) and
``wait_timeout_ms`` (1000, shorter than ``timeout``), ``username``, ``password``
(override the URL's), ``ssl_ca_certs``, ``ssl_cert_reqs`` (``rediss://`` only), and
keyword-only ``client`` (a ready ``redis.Redis``: its own settings apply; neither
closed nor pickled). Worst case of a failing call: (retries + 1) x timeout +
backoff (at most 0.1, 0.2, 0.4, ... s, each at most 1 s), plus ``connect_timeout``
for each attempt that must open a connection: with the defaults 4 x 5 s + 0.7 s,
about 21 s (41 s if every attempt also waits to connect).

After a failure: ``StoreUnavailable`` (connection, timeout, loading, failover to a
replica, out of memory, fewer replicas than ``wait_replicas`` acknowledged): the
ids in ``recorded`` were recorded by the call, those in ``unknown`` may have been,
and a retry of them on the same store object reports the latter as recorded by it
(redis-py's own retries are safe for the same reason). ``ConfigurationError``:
credentials, ACL permissions, a foreign key under the prefix, Redis Cluster.
Durability needs ``appendonly yes`` + ``appendfsync always`` (see
:meth:`~dedupstore.DeduplicationStore.health_warnings`); replication is
asynchronous unless ``wait_replicas`` is set. Not supported: Redis Cluster and
replicas as the URL's host (refused at open).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.connection import ConnectionPool, SSLConnection
from redis.exceptions import (
    AskError,
    AuthenticationError,
    AuthenticationWrongNumberOfArgsError,
    AuthorizationError,
    ClusterCrossSlotError,
    ClusterDownError,
    NoPermissionError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from dedupstore.client import ErrorKind
from dedupstore.errors import (
    ConfigurationError,
    ConsistencyError,
    StoreUnavailable,
    format_error,
)
from dedupstore.options import (
    Option,
    OptionSet,
    choice,
    client_option,
    connect_timeout_option,
    integer,
    optional,
    retries_option,
    text,
    timeout_option,
)
from dedupstore.store import DeduplicationStore, WriteRequest
from dedupstore.urls import StoreURL

if TYPE_CHECKING:
    from redis.commands.core import Script

__all__ = ["RedisDeduplicationStore", "record_key"]

_ESCAPES = str.maketrans({"%": "%25", ":": "%3A", "{": "%7B", "}": "%7D"})
#: Every record value starts with this tag; anything else was not written by us.
_TAG = "dsv1:"
_TAG_BYTES = _TAG.encode()
#: Error replies that mean "retry later": a script runs too long, the server cannot
#: persist, or it lacks the replicas min-replicas-to-write asks for.
_TRANSIENT_CODES = frozenset({"BUSY", "MISCONF", "NOREPLICAS"})

# KEYS: record keys. ARGV[1]: the new value; ARGV[2]: PX in ms ('' = no expiry);
# ARGV[3..]: the values that mean "written by this call" (its tokens, tagged).
# Decides every key before writing any, so an error leaves nothing half-written.
# Returns the (1-based) indexes of the keys it recorded. No keys: a permission probe.
_ADD_SCRIPT = """
if #KEYS == 0 then return {} end
local mine = {}
for i = 3, #ARGV do mine[ARGV[i]] = true end
local current = redis.call('MGET', unpack(KEYS))
local todo, absent = {}, {}
for i = 1, #KEYS do
  local value = current[i]
  if not value then
    todo[#todo + 1] = i
    absent[#absent + 1] = KEYS[i]
  elseif mine[value] then
    todo[#todo + 1] = i
  elseif string.sub(value, 1, 5) ~= 'dsv1:' then
    return redis.error_reply('DEDUPSTORE key ' .. string.sub(KEYS[i], 1, 200)
      .. ' holds a value dedupstore did not write')
  end
end
-- MGET answers nil for a key of another type, which SET would silently replace.
if #absent > 0 and redis.call('EXISTS', unpack(absent)) > 0 then
  for _, key in ipairs(absent) do
    local kind = redis.call('TYPE', key)['ok']
    if kind ~= 'none' then
      return redis.error_reply('WRONGTYPE key ' .. string.sub(key, 1, 200) .. ' holds a '
        .. kind .. ', not a dedupstore record')
    end
  end
end
if #todo > 0 then
  if ARGV[2] == '' then
    local pairs_ = {}
    for _, i in ipairs(todo) do
      pairs_[#pairs_ + 1] = KEYS[i]
      pairs_[#pairs_ + 1] = ARGV[1]
    end
    redis.call('MSET', unpack(pairs_))
  else
    for _, i in ipairs(todo) do
      redis.call('SET', KEYS[i], ARGV[1], 'PX', ARGV[2])
    end
  end
end
return todo
"""


def _escape(part: str) -> str:
    # str.translate with a mapping costs microseconds; most ids need no escaping at all.
    if "%" in part or ":" in part or "{" in part or "}" in part:
        return part.translate(_ESCAPES)
    return part


def record_key(key_prefix: str, endpoint: str, message_id: str) -> str:
    """Return the Redis key of (endpoint, id): injective, no ``:`` or braces in the parts."""
    return f"{key_prefix}{_escape(endpoint)}:{_escape(message_id)}"


def _key_prefix(value: object) -> str:
    prefix: str = text(what="a key prefix")(value)
    if prefix and not prefix.endswith(":"):
        raise ValueError(
            f"expected '' or a prefix ending with ':' (so that two prefixes never share "
            f"keys), got {prefix!r}"
        )
    prefix.encode("utf-8")  # a lone surrogate raises UnicodeEncodeError (a ValueError)
    return prefix


def _is_record(value: object) -> bool:
    if isinstance(value, bytes):
        return value.startswith(_TAG_BYTES)
    return str(value).startswith(_TAG)


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


class RedisDeduplicationStore(DeduplicationStore):
    """Deduplication store on a Redis primary; safe across threads and processes.

    Needs a standalone Redis primary (not Cluster, not a replica); durable only with
    ``appendonly yes`` + ``appendfsync always``. Raises ``StoreUnavailable`` (the
    redis-py error chained) whenever Redis cannot answer, ``ConfigurationError`` for
    credentials, permissions and foreign keys under the prefix.
    """

    schemes: ClassVar[tuple[str, ...]] = ("redis", "rediss")
    expiry_clock = "server"
    # The script unpack()s 2 values per key: Lua's stack allows about 8000.
    max_write_batch: ClassVar[int] = 1000
    max_read_batch: ClassVar[int] = 2000
    # Two chunks in flight: Python builds and parses one while the server runs the
    # other (each script runs atomically, so first-writer-wins is unaffected).
    chunk_concurrency: ClassVar[int] = 2
    declared_options: ClassVar[OptionSet] = DeduplicationStore.declared_options.extend(
        Option("key_prefix", _key_prefix, "dedup:", "namespace of the keys: '' or ending with ':'"),
        timeout_option(
            5.0,
            "seconds one command may take (each attempt) before it is retried",
            formerly=("socket_timeout",),
        ),
        connect_timeout_option(5.0, formerly=("socket_connect_timeout",)),
        retries_option(
            3, "how often a command is retried after a connection error or timeout (with backoff)"
        ),
        Option(
            "max_connections", optional(integer(1)), None, "largest number of pooled connections"
        ),
        Option("wait_replicas", integer(0), 0, "replicas every write waits for (WAIT); 0: none"),
        Option(
            "wait_timeout_ms",
            integer(1),
            1000,
            "how long a write waits for the replicas, in ms (shorter than timeout)",
        ),
        Option("username", optional(text()), None, "ACL user (instead of the URL's)", driver=True),
        Option(
            "password",
            optional(text()),
            None,
            "password (instead of the URL's)",
            secret=True,
            driver=True,
        ),
        Option("ssl_ca_certs", optional(text()), None, "CA bundle file (rediss://)", driver=True),
        Option(
            "ssl_cert_reqs",
            optional(choice("none", "optional", "required")),
            None,
            "server certificate check (rediss://)",
            driver=True,
        ),
        client_option("a ready redis.Redis (its own settings apply; not closed by close())"),
    )

    def __init__(self, url: str | StoreURL, /, **options: Any) -> None:
        """Connect to the Redis primary named by ``url`` and check it.

        ``url`` is ``redis[s]://[[user]:password@]host[:port][/db]``; its query holds
        the options (see the module). Raises ``ConfigurationError`` for bad options, a
        wrong password or missing permissions, or a Redis Cluster; ``ConsistencyError``
        when the server is a replica; ``StoreUnavailable`` when it cannot be reached.
        """
        super().__init__(url, **options)
        self._wait_replicas: int = self._opts["wait_replicas"]
        self._wait_timeout_ms: int = self._opts["wait_timeout_ms"]
        if self._wait_replicas and self._wait_timeout_ms >= self._opts["timeout"] * 1000:
            raise ConfigurationError(
                f"wait_timeout_ms ({self._wait_timeout_ms}) must be shorter than timeout "
                f"({self._opts['timeout']:g} s), or the WAIT would time out the connection"
            )
        self._key_base = f"{self._opts['key_prefix']}{_escape(self._endpoint)}:"
        # PX = the retention in whole ms, rounded up (at least 1).
        self._px = (
            "" if self._retention is None else str(-(-self._retention // timedelta(milliseconds=1)))
        )
        client = self._opts["client"]
        if client is not None and not isinstance(client, redis.Redis):
            raise ConfigurationError(
                f"client must be a redis.Redis, got {type(client).__name__} "
                "(Redis Cluster is not supported)"
            )
        self._owns_client = client is None
        self._client: redis.Redis = self._connect() if client is None else client
        self._add_script: Script = self._client.register_script(_ADD_SCRIPT)
        try:
            with self._translating_errors("connect"):
                self._probe()
        except BaseException:
            self._close()
            raise

    # ------------------------------------------------------------------ opening

    def _connect(self) -> redis.Redis:
        """A client with its own pool (fork-safe: redis-py's pool resets in a child)."""
        url = self._url
        if url.path in ("", "/"):
            db = 0
        elif re.fullmatch(r"/\d{1,5}", url.path):
            db = int(url.path[1:])
        else:
            raise ConfigurationError(
                f"bad Redis URL {url.masked}: the path must be a database number such as /0"
            )
        kwargs: dict[str, Any] = {
            "host": url.host or "localhost",
            "port": url.port or 6379,
            "db": db,
            "username": url.username or None,
            "password": url.password or None,
        }
        kwargs.update(self._opts.driver_kwargs())
        if url.scheme == "rediss":
            kwargs["connection_class"] = SSLConnection
        elif "ssl_ca_certs" in kwargs or "ssl_cert_reqs" in kwargs:
            raise ConfigurationError("ssl_ca_certs and ssl_cert_reqs need a rediss:// URL")
        pool = ConnectionPool(
            **kwargs,
            socket_timeout=self._opts["timeout"],
            socket_connect_timeout=self._opts["connect_timeout"],
            max_connections=self._opts["max_connections"],
            retry=Retry(ExponentialWithJitterBackoff(cap=1.0, base=0.05), self._opts["retries"]),
        )
        return redis.Redis(connection_pool=pool)

    def _probe(self) -> None:
        """``PING``; check the server is a primary, not a cluster, and runs our script."""
        pipe = self._client.pipeline(transaction=False)
        pipe.ping()
        pipe.script_load(_ADD_SCRIPT)
        pipe.info("replication")
        pipe.info("cluster")
        _, _, replication, cluster = pipe.execute()
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
        self._add_script(keys=[], args=[])  # refused now if the ACL forbids EVALSHA

    # ------------------------------------------------------------------ errors

    def _classify_error(self, exc: BaseException) -> ErrorKind:
        """Classify a redis-py error.

        Credentials, ACL, foreign keys and cluster redirects: ``ConfigurationError``;
        connection, timeout, failover (READONLY), loading, busy, OOM and any other
        redis-py error: ``StoreUnavailable``; an error reply not known to be
        transient: ``ConfigurationError``.
        """
        name, detail = type(self).__name__, self._describe_error(exc)
        if isinstance(
            exc, AuthenticationError | AuthorizationError | AuthenticationWrongNumberOfArgsError
        ):
            return ConfigurationError(
                f"{name} cannot log in to {self.url} (wrong or missing username/password): {detail}"
            )
        if isinstance(exc, NoPermissionError):
            return ConfigurationError(
                f"{name} at {self.url}: the Redis user may not run a command the store needs "
                f"(grant +ping +info +script|load +evalsha +get +mget +wait): {detail}"
            )
        if isinstance(exc, RedisConnectionError | RedisTimeoutError | ReadOnlyError):
            return StoreUnavailable  # also BusyLoadingError, MaxConnectionsError
        if isinstance(exc, TryAgainError | ClusterDownError):
            return StoreUnavailable  # also MasterDownError
        if isinstance(exc, OutOfMemoryError):
            return StoreUnavailable(
                f"{name} at {self.url}: Redis is out of memory and refuses writes ({detail}); "
                "raise maxmemory or free memory (keep maxmemory-policy noeviction)"
            )
        if isinstance(exc, ResponseError):
            code = str(exc).split(" ", 1)[0]
            if code in ("DEDUPSTORE", "WRONGTYPE"):
                return self._foreign_value_error(detail)
            if isinstance(exc, AskError | ClusterCrossSlotError):  # also MovedError
                return ConfigurationError(
                    f"{name} at {self.url}: the server redirects to a Redis Cluster node; Redis "
                    f"Cluster is not supported yet: {detail}"
                )
            if isinstance(exc, NoScriptError) or code in _TRANSIENT_CODES:
                return StoreUnavailable
            return ConfigurationError
        if type(exc).__module__.split(".", 1)[0] == "redis":
            return StoreUnavailable
        return super()._classify_error(exc)

    def _foreign_value_error(self, detail: str = "") -> ConfigurationError:
        return ConfigurationError(
            f"{type(self).__name__} at {self.url}: a key under the prefix {self._key_base!r} "
            "holds a value dedupstore did not write; the key_prefix must be reserved for "
            f"this store{f' ({detail})' if detail else ''}"
        )

    # ------------------------------------------------------------------ primitives

    def _add_new(self, request: WriteRequest) -> set[str]:
        """One script run (plus ``WAIT`` when configured) for the whole chunk."""
        keys = [self._key_base + _escape(mid) for mid in request.ids]
        args = [_TAG + request.token, self._px, *(_TAG + token for token in request.mine)]
        if self._wait_replicas:
            indexes = self._add_and_wait(keys, args)
        else:
            indexes = self._add_script(keys=keys, args=args)
        return {request.ids[i - 1] for i in indexes}

    def _add_and_wait(self, keys: list[str], args: list[str]) -> list[int]:
        """The script then ``WAIT``, pipelined on one connection (``WAIT`` counts its writes)."""
        try:
            indexes, acknowledged = self._pipelined_add(keys, args)
        except NoScriptError:  # the server restarted or flushed its scripts
            self._client.script_load(_ADD_SCRIPT)
            indexes, acknowledged = self._pipelined_add(keys, args)
        if int(acknowledged) < self._wait_replicas:
            raise StoreUnavailable(
                f"{type(self).__name__} at {self.url}: only {acknowledged} of "
                f"{self._wait_replicas} replicas acknowledged the write within "
                f"{self._wait_timeout_ms} ms; the records are on the primary but their "
                "durability is unknown (retrying on this store object reports them as "
                "recorded by it)"
            )
        return list(indexes)

    def _pipelined_add(self, keys: list[str], args: list[str]) -> tuple[list[int], int]:
        pipe = self._client.pipeline(transaction=False)
        pipe.evalsha(self._add_script.sha, len(keys), *keys, *args)
        pipe.wait(self._wait_replicas, self._wait_timeout_ms)
        indexes, acknowledged = pipe.execute()
        return list(indexes), int(acknowledged)

    def _find(self, ids: list[str], now: float) -> set[str]:
        """One ``MGET``; Redis never returns an expired key."""
        values = self._client.mget([self._key_base + _escape(mid) for mid in ids])
        found: set[str] = set()
        for mid, value in zip(ids, values, strict=True):
            if value is not None:
                if not _is_record(value):
                    raise self._foreign_value_error()
                found.add(mid)
        return found

    def _contains_one(self, message_id: str, now: float) -> bool:
        value = self._client.get(self._key_base + _escape(message_id))
        if value is not None and not _is_record(value):
            raise self._foreign_value_error()
        return value is not None

    def _purge(self, now: float) -> int:
        """Nothing to do: Redis deletes expired records itself (native expiry)."""
        return 0

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
                        f"allowed ({format_error(answer)}); acknowledged records survive a crash "
                        "only with appendonly yes and appendfsync always, and eviction must be "
                        "off (maxmemory-policy noeviction)"
                    )
                    break
                raise answer
            config.update({_text(k): _text(v) for k, v in dict(answer).items()})
        for answer in (persistence, replication):
            if isinstance(answer, Exception):
                raise answer
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
