"""The connection the Redis stores, dispatcher and broker share: :class:`RedisConnection`.

Options: :data:`CONNECTION_OPTIONS` (the same on every Redis object) and ``key_prefix`` (``''`` or
ending with ``:``; each class has its own default). ``wait_timeout_ms`` must be shorter than
``timeout``; ``ssl_ca_certs`` and ``ssl_cert_reqs`` need ``rediss://``; a given ``client`` (a ready
``redis.Redis``, keyword only) keeps its own settings and is neither closed nor pickled.

Keys: ``key_prefix`` (keep the prefixes of the stores and the dispatcher apart), then parts escaped
by :func:`escape` (``%`` ``:`` ``{`` ``}`` become ``%25`` ``%3A`` ``%7B`` ``%7D``): no two parts
share a key and none forms a Redis Cluster hash tag.

Each store and the dispatcher runs ONE Lua script for its writes, loaded at open and run by
``EVALSHA`` through :meth:`RedisConnection.run_script` on one connection, followed by ``WAIT`` when
``wait_replicas`` is set, so the caller knows when an attempt whose answer was lost may have run
(and may send the script a "re-sent" flag then); the token store, whose writes are idempotent
commands, sends them the same way (:meth:`RedisConnection.write`). Reads go through redis-py, whose
pool retries nothing: every command is retried here (:func:`dedupstore.calls.retry`) after a
connection error or timeout.

Deadline: a call (one chunk of a batch) raises ``StoreUnavailable`` at most ``connect_timeout +
(retries + 1) x timeout`` seconds after it started (25 s with the defaults), whatever the server
does: attempts stop there, and every wait of an attempt (connecting, the handshake, each reply) is
capped by the time left. A given ``client`` keeps its own timeouts and retries.

Errors (:meth:`RedisConnection.classify_error`): ``StoreUnavailable`` for connection errors,
timeouts, loading, failover to a replica (``READONLY``), out of memory,
``BUSY``/``MISCONF``/``NOREPLICAS``/``NOSCRIPT``, any other redis-py error, and fewer replicas than
``wait_replicas`` acknowledging; ``ConfigurationError`` for credentials, ACL permissions, a key
under the prefix that dedupstore did not write, Redis Cluster (redirects) and any other error reply.
Opening refuses a Redis Cluster node (``ConfigurationError``) and a replica (``ConsistencyError``),
and for the token store a server that may evict keys (``ConfigurationError``).
Durability needs ``appendonly yes`` + ``appendfsync always`` and ``maxmemory-policy noeviction``
(``health_warnings()`` says when not); replication is asynchronous unless ``wait_replicas`` is set.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import re
import threading
from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import Any, ClassVar

import redis
from redis.backoff import NoBackoff
from redis.connection import Connection as DriverConnection
from redis.connection import ConnectionPool, SSLConnection
from redis.exceptions import (
    AskError,
    AuthenticationError,
    AuthenticationWrongNumberOfArgsError,
    AuthorizationError,
    ClusterCrossSlotError,
    ClusterDownError,
    DataError,
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
from redis.utils import SENTINEL

try:  # redis[hiredis] brings it; without it, redis-py packs the commands
    from hiredis import pack_command as _pack_command
except ImportError:  # pragma: no cover
    _pack_command = None  # type: ignore[assignment]

from dedupstore.backend import (
    Client,
    ConfigurationError,
    Connection,
    ConsistencyError,
    ErrorKind,
    Option,
    Options,
    Steps,
    StoreUnavailable,
    StoreURL,
    capped,
    check_client,
    choice,
    client_option,
    connect_timeout_option,
    format_error,
    integer,
    io,
    optional,
    part_of,
    retries_option,
    retry,
    run,
    text,
    time_left,
    timeout_option,
)

__all__ = [
    "CONNECTION_OPTIONS",
    "RedisConnection",
    "escape",
    "foreign_value_error",
    "key_prefix_option",
    "probe_steps",
    "server_kwargs",
    "unescape",
]

_log = logging.getLogger(__name__)

#: Error replies that mean "retry later": a script runs too long, the server cannot persist, or it
#: lacks the replicas min-replicas-to-write asks for.
_TRANSIENT_CODES = frozenset({"BUSY", "MISCONF", "NOREPLICAS"})
#: The path of a Redis URL: none, ``/`` or a database number.
_DB_PATH = re.compile(r"/?|/\d{1,5}")
#: Keys asked of each ``SCAN`` round trip by :meth:`RedisConnection.scan_values`.
_SCAN_COUNT = 1000
#: Makes a text a ``SCAN MATCH`` pattern matching exactly itself.
_GLOB_ESCAPE = str.maketrans({c: "\\" + c for c in "\\*?[]"})
_PIPELINE_PREFIX = re.compile(r"^Command # \d+ \(.*?\) of pipeline caused error: ", re.S)


def escape(part: str) -> str:
    """``part`` with ``%`` ``:`` ``{`` ``}`` percent-escaped (injective; no ``:``, no hash tag)."""
    # ``str.translate`` with a mapping costs about 4 us; these replace calls a twentieth of that.
    # Every deduplication key has a ``:`` (see ``message_key``). ``%`` goes first.
    if "%" in part:
        part = part.replace("%", "%25")
    if ":" in part:
        part = part.replace(":", "%3A")
    if "{" in part or "}" in part:
        part = part.replace("{", "%7B").replace("}", "%7D")
    return part


_ESCAPED = re.compile("%(25|3A|7B|7D)")
_UNESCAPED = {"25": "%", "3A": ":", "7B": "{", "7D": "}"}


def unescape(part: str) -> str:
    """The inverse of :func:`escape`."""
    return _ESCAPED.sub(lambda m: _UNESCAPED[m.group(1)], part) if "%" in part else part


def _key_prefix(value: object) -> str:
    prefix: str = text(what="a key prefix")(value)
    if prefix and not prefix.endswith(":"):
        raise ValueError(
            f"expected '' or a prefix ending with ':' (so that two prefixes never share "
            f"keys), got {prefix!r}"
        )
    prefix.encode("utf-8")  # a lone surrogate raises UnicodeEncodeError (a ValueError)
    return prefix


def key_prefix_option(default: str) -> Option:
    """The ``key_prefix`` option (``''`` or ending with ``:``), with a store's own default."""
    return Option(
        "key_prefix", _key_prefix, default, "namespace of the keys: '' or ending with ':'"
    )


def _packed(conn: Any, commands: list[tuple[Any, ...]]) -> Any:
    """The bytes redis-py would send on ``conn`` for ``commands`` (``str``/``int`` tuples led by a
    command name), packed by hiredis in one C call per command rather than by redis-py's Python pass
    over every argument. ``DataError`` for an argument that cannot be packed."""
    if _pack_command is None:  # pragma: no cover
        return conn.pack_commands(commands)
    try:
        return [b"".join([_pack_command(command) for command in commands])]
    except TypeError as exc:
        raise DataError(str(exc)) from exc


@functools.cache
def _sha1(source: str) -> str:
    return hashlib.sha1(source.encode()).hexdigest()


def text_of(value: bytes | str) -> str:
    """A reply as text (redis-py answers bytes unless the client decodes responses)."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


class _Bounded(DriverConnection):
    """A redis-py connection whose every wait is capped by the call's deadline (see the module);
    past the deadline a read drops the connection and raises ``TimeoutError``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]
        # the pool always sets both (CONNECTION_OPTIONS)
        self._full_timeout = float(self.socket_timeout or 0)
        self._full_connect_timeout = float(self.socket_connect_timeout or 0)

    def _connect(self) -> Any:
        self.socket_connect_timeout = capped(self._full_connect_timeout)
        return super()._connect()  # type: ignore[no-untyped-call]

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        if self._sock is not None:
            self._sock.settimeout(capped(self._full_timeout))
        super().send_packed_command(command, check_health)  # type: ignore[no-untyped-call]

    def read_response(
        self, disable_decoding: bool = False, *, timeout: Any = SENTINEL, **kwargs: Any
    ) -> Any:
        if timeout is SENTINEL and time_left() is not None:
            try:
                timeout = capped(self._full_timeout)
            except TimeoutError:
                self.disconnect()  # type: ignore[no-untyped-call]
                raise RedisTimeoutError("timed out: the call's deadline passed") from None
        return super().read_response(disable_decoding, timeout=timeout, **kwargs)


class _BoundedSSL(_Bounded, SSLConnection):
    """Over TLS (``rediss://``)."""


def _transient(exc: BaseException) -> bool:
    """A connection error or timeout that another attempt may not meet."""
    return isinstance(exc, RedisConnectionError | RedisTimeoutError) and not isinstance(
        exc, AuthenticationError | AuthorizationError
    )


#: The connection options of every Redis store (after its ``key_prefix``).
CONNECTION_OPTIONS: tuple[Option, ...] = (
    timeout_option(5.0, "seconds one command may take (each attempt) before it is retried"),
    connect_timeout_option(5.0),
    retries_option(
        3, "how often a command is retried after a connection error or timeout (with backoff)"
    ),
    Option("max_connections", optional(integer(1)), None, "largest number of pooled connections"),
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


def _exchange(conn: Any, commands: list[tuple[Any, ...]], sent: list[bool]) -> list[Any]:
    """:meth:`RedisConnection._send` on ``conn``: every reply, error replies as exceptions."""
    try:
        packet = _packed(conn, commands)
        sent.append(True)
        conn.send_packed_command(packet)
        replies: list[Any] = []
        for _ in commands:
            try:
                replies.append(conn.read_response())
            except ResponseError as exc:
                replies.append(exc)
    except BaseException:
        conn.disconnect()
        raise
    return replies


class RedisConnection(Connection):
    """The ``redis.Redis`` of one standalone Redis primary, shared by its clients. Each client uses
    it as ``self._redis``, declares ``key_prefix_option(...)`` plus :data:`CONNECTION_OPTIONS`,
    calls :meth:`probe` at open, and declares what the error rules read: ``commands`` (named when an
    ACL refuses one) and, with :meth:`run_script`, ``unconfirmed`` (what an unreplicated write means
    for it)."""

    schemes: ClassVar[tuple[str, ...]] = ("redis", "rediss")
    needs_host: ClassVar[bool] = True
    shaped_by: ClassVar[tuple[str, ...]] = tuple(
        option.name for option in CONNECTION_OPTIONS if option.name != "client"
    )

    def __init__(self, url: StoreURL, options: Options) -> None:
        """A pool of our own on the server of ``url`` (or the given ``client``); no I/O."""
        super().__init__(url, options)
        given: redis.Redis | None = options["client"]
        self._given = given is not None
        self.client: redis.Redis = given if given is not None else self._connect()
        self._attempts: int = options["retries"] + 1
        self._wait_replicas: int = options["wait_replicas"]
        self._wait_timeout_ms: int = options["wait_timeout_ms"]
        # what _send keeps checked out of the pool (a child after fork() has its own object)
        self._kept: Any = None  # (redis-py leaves its connection methods untyped)
        self._keeping = threading.Lock()

    @classmethod
    def async_twin(cls, url: StoreURL, options: Options) -> Any:
        """A :class:`~._aio.AsyncRedisConnection` (``redis.asyncio``) of the same server."""
        from ._aio import AsyncRedisConnection

        return AsyncRedisConnection(url, options)

    @classmethod
    def address(cls, url: StoreURL, options: Options) -> Hashable:
        """The server, the database and the URL's credentials."""
        return (
            url.scheme,
            url.host,
            url.port,
            url.path.strip("/") or "0",
            url.username,
            url.password,
        )

    @classmethod
    def validate(cls, url: StoreURL, options: Options) -> None:
        """The URL's path (a database number), TLS options, ``wait_timeout_ms``, ``client``."""
        if not _DB_PATH.fullmatch(url.path):
            raise ConfigurationError(
                f"bad Redis URL {url.masked}: the path must be a database number such as /0"
            )
        if url.scheme != "rediss" and (
            options["ssl_ca_certs"] is not None or options["ssl_cert_reqs"] is not None
        ):
            raise ConfigurationError("ssl_ca_certs and ssl_cert_reqs need a rediss:// URL")
        wait_ms, timeout = options["wait_timeout_ms"], options["timeout"]
        if options["wait_replicas"] and wait_ms >= timeout * 1000:
            raise ConfigurationError(
                f"wait_timeout_ms ({wait_ms}) must be shorter than timeout ({timeout:g} s), "
                "or the WAIT would time out the connection"
            )
        check_client(options, redis.Redis, "a redis.Redis", "Redis Cluster is not supported")

    def _connect(self) -> redis.Redis:
        """A client with its own pool (fork-safe: redis-py's pool resets in a child)."""
        url = self.url
        pool = ConnectionPool(
            **server_kwargs(url, self.options),
            connection_class=_BoundedSSL if url.scheme == "rediss" else _Bounded,
            socket_timeout=self.options["timeout"],
            socket_connect_timeout=self.options["connect_timeout"],
            max_connections=self.options["max_connections"],
            retry=Retry(NoBackoff(), 0),  # retried here (read, write)
        )
        return redis.Redis(connection_pool=pool)

    def read(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` (redis-py), retried after a connection error or timeout."""
        call = functools.partial(fn, *args, **kwargs)
        return retry(call, attempts=self._attempts, retry_on=_transient)

    def pipelined(
        self, build: Callable[[Any], object], *, transaction: bool = False, **execute: Any
    ) -> list[Any]:
        """The replies of the commands ``build(pipe)`` queues, in one round trip (a read);
        ``transaction``: wrapped in ``MULTI``/``EXEC`` (run atomically)."""

        def attempt() -> list[Any]:
            pipe = self.client.pipeline(transaction=transaction)
            build(pipe)
            return pipe.execute(**execute)

        replies: list[Any] = self.read(attempt)
        return replies

    def probe(self, client: Client, script: str, *, no_eviction: bool = False) -> None:
        """``PING``; check the server is a primary, not a cluster, and runs ``script`` (the write
        script of ``client``, loaded now; ``""``: none). ``no_eviction``: refuse a server that may
        evict keys (``INFO memory``, allowed where ``CONFIG`` is not; ``ConfigurationError``).
        The steps are :func:`probe_steps`, which the async connection drives too."""
        run(probe_steps(self, client, script, no_eviction=no_eviction))

    def run_script(
        self,
        client: Client,
        source: str,
        keys: list[str],
        args: list[str],
        resent_args: list[str] | None = None,
    ) -> Any:
        """Run ``client``'s write script ``source`` by :meth:`write` (then ``WAIT``); return its
        answer. Once a request may have reached the server, later attempts send ``resent_args``
        (``args`` when ``None``)."""
        commands, resent = script_commands(source, keys, args, resent_args)
        return self.write(client, commands, resent, script=source)[0]

    def write(
        self,
        client: Client,
        commands: list[tuple[Any, ...]],
        resent: list[tuple[Any, ...]] | None = None,
        *,
        script: str = "",
    ) -> list[Any]:
        """Send ``commands`` (then ``WAIT`` when ``wait_replicas`` is set) in one packet on one
        connection, retried after a connection error or timeout; return their replies. Once a
        request may have reached the server, later attempts send ``resent`` (``commands`` when
        ``None``); after ``NOSCRIPT`` (a restarted or flushed server) ``script``, the source the
        commands run by ``EVALSHA``, is loaded and the request re-sent in the same attempt. Raises
        the last attempt's redis-py error (the first error reply, all replies read), or
        ``StoreUnavailable`` when fewer than ``wait_replicas`` replicas confirmed in time."""
        wait = wait_command(self.options)
        sent: list[bool] = []

        def attempt() -> list[Any]:
            request = [*(resent if sent and resent is not None else commands), *wait]
            try:
                return self._send(request, sent)
            except NoScriptError:  # the script did not run: load it, send again at once
                if not script:
                    raise
                self.client.script_load(script)
                return self._send(request, sent)

        replies = retry(
            attempt,
            attempts=self._attempts,
            retry_on=_transient,
            before_sleep=functools.partial(_log_write_retry, client, self._attempts),
        )
        return confirmed(client, replies, wait)

    def scan_values(self, prefix: str) -> Iterator[tuple[bytes | str, Any]]:
        """Every key under ``prefix`` (``SCAN MATCH``, a page at a time) with its value (one
        ``MGET`` per page; ``None`` for a key of another type or one that expired or was deleted
        since the scan saw it). ``SCAN`` may return a key twice: the keys seen are held in memory
        to give each once. Cost: ``SCAN`` walks every key of the database (filtering on the
        server)."""
        pattern = prefix.translate(_GLOB_ESCAPE) + "*"
        seen: set[bytes | str] = set()
        cursor = 0
        while True:
            cursor, keys = self.read(
                self.client.scan, cursor=cursor, match=pattern, count=_SCAN_COUNT
            )
            fresh = [key for key in dict.fromkeys(keys) if key not in seen]
            if fresh:
                seen.update(fresh)
                values = self.read(self.client.mget, fresh)
                yield from zip(fresh, values, strict=True)
            if not int(cursor):
                return

    def _send(self, commands: list[tuple[Any, ...]], sent: list[bool]) -> list[Any]:
        """Send ``commands`` in one packet; read every reply. Appends to ``sent`` once the request
        may have reached the server. A failed connection is closed (reconnected at its next use);
        error replies are raised once all are read (the connection stays in step).

        On the connection this object keeps checked out (a pooled one while another thread uses
        it): a checkout polls the socket for unread data, which costs more than the script call,
        and every request here reads all its replies or closes the connection."""
        if self._keeping.acquire(blocking=False):
            try:
                conn = self._kept
                if conn is None:
                    conn = self._kept = self.client.connection_pool.get_connection()
                replies = _exchange(conn, commands, sent)
            finally:
                self._keeping.release()
        else:
            pool = self.client.connection_pool
            conn = pool.get_connection()
            try:
                replies = _exchange(conn, commands, sent)
            finally:
                pool.release(conn)
        for reply in replies:
            if isinstance(reply, ResponseError):
                raise reply
        return replies

    @classmethod
    def classify_error(cls, client: Client, exc: BaseException) -> ErrorKind:
        name, detail = type(client).__name__, client.describe_error(exc)
        if isinstance(
            exc, AuthenticationError | AuthorizationError | AuthenticationWrongNumberOfArgsError
        ):
            return ConfigurationError(
                f"{name} cannot log in to {client.url} (wrong or missing username/password): "
                f"{detail}"
            )
        # inside a script an ACL refusal is a plain error reply, not NOPERM
        if isinstance(exc, NoPermissionError) or "user executing the script can't run" in str(exc):
            commands = part_of(client, "commands", str)
            return client.make_error(
                ConfigurationError,
                None,
                f"the Redis user may not run a command the store needs (grant {commands}): "
                f"{detail}",
            )
        # also BusyLoadingError, MaxConnectionsError, MasterDownError
        transient = RedisConnectionError | RedisTimeoutError | ReadOnlyError | TryAgainError
        if isinstance(exc, transient | ClusterDownError):
            return StoreUnavailable
        if isinstance(exc, OutOfMemoryError):
            return client.make_error(
                StoreUnavailable,
                None,
                f"Redis is out of memory and refuses writes ({detail}); "
                "raise maxmemory or free memory (keep maxmemory-policy noeviction)",
            )
        if isinstance(exc, ResponseError):
            # a pipeline prefixes the reply: "Command # 1 (HMGET k b v) of pipeline caused error: "
            reply = _PIPELINE_PREFIX.sub("", str(exc), count=1)
            code = reply.split(" ", 1)[0]
            if code in ("DEDUPSTORE", "WRONGTYPE"):
                return foreign_value_error(client, detail)
            if isinstance(exc, AskError | ClusterCrossSlotError):  # also MovedError
                return client.make_error(
                    ConfigurationError,
                    None,
                    f"the server redirects to a Redis Cluster node; Redis "
                    f"Cluster is not supported yet: {detail}",
                )
            if isinstance(exc, NoScriptError) or code in _TRANSIENT_CODES:
                return StoreUnavailable
            return ConfigurationError
        if type(exc).__module__.split(".", 1)[0] == "redis":
            return StoreUnavailable
        return None

    def health_warnings(self, client: Client) -> list[str]:
        """Warn about settings that can lose acknowledged writes."""
        warnings: list[str] = []
        config: dict[str, str] = {}

        def build(pipe: Any) -> None:
            for name in ("appendonly", "appendfsync", "maxmemory", "maxmemory-policy"):
                pipe.config_get(name)
            pipe.info("persistence")
            pipe.info("replication")

        *answers, persistence, replication = self.pipelined(build, raise_on_error=False)
        for answer in (persistence, replication):
            if isinstance(answer, Exception):
                raise answer
        refused = [answer for answer in answers if isinstance(answer, ResponseError)]
        if refused:
            warnings.append(
                "could not check appendfsync and maxmemory-policy: CONFIG GET is not "
                f"allowed ({format_error(refused[0])}); acknowledged records survive a crash "
                "only with appendonly yes and appendfsync always, and eviction must be "
                "off (maxmemory-policy noeviction)"
            )
        else:
            for answer in answers:
                config.update({text_of(k): text_of(v) for k, v in dict(answer).items()})
        aof = config.get(
            "appendonly", "yes" if str(persistence.get("aof_enabled")) == "1" else "no"
        )
        if aof != "yes":
            warnings.append(
                "the server has no append-only file (appendonly no): acknowledged records are "
                "lost when Redis crashes or restarts; set appendonly yes and appendfsync always"
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
                "memory is full Redis may evict records, silently forgetting what was written; "
                "use noeviction"
            )
        replicas = int(replication.get("connected_slaves", 0))
        if replicas and not self._wait_replicas:
            warnings.append(
                f"the primary has {replicas} replica(s) and replication is asynchronous: after a "
                "failover, acknowledged records can be missing; set wait_replicas"
            )
        return warnings

    def close(self) -> None:
        """Disconnect the pool (not a given ``client``'s: the kept connection goes back to it)."""
        with self._keeping:
            kept, self._kept = self._kept, None
        if self._given:
            if kept is not None:
                self.client.connection_pool.release(kept)
        else:
            self.client.connection_pool.disconnect()


def script_commands(
    source: str, keys: list[str], args: list[str], resent_args: list[str] | None
) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]] | None]:
    """The ``EVALSHA`` of a write script, first sent and re-sent (``None``: the same)."""
    sha = _sha1(source)
    resent = None if resent_args is None else [("EVALSHA", sha, len(keys), *keys, *resent_args)]
    return [("EVALSHA", sha, len(keys), *keys, *args)], resent


def wait_command(options: Options) -> list[tuple[Any, ...]]:
    """The ``WAIT`` a write ends with when ``wait_replicas`` is set (else none)."""
    if not options["wait_replicas"]:
        return []
    return [("WAIT", options["wait_replicas"], options["wait_timeout_ms"])]


def confirmed(client: Client, replies: list[Any], wait: list[tuple[Any, ...]]) -> list[Any]:
    """A write's replies without its ``WAIT``'s; ``StoreUnavailable`` when fewer replicas
    than ``wait_replicas`` acknowledged it in time (the sync and async writes alike)."""
    if not wait:
        return replies
    _, wanted, timeout_ms = wait[0]
    if int(replies[-1]) < wanted:
        unconfirmed = part_of(client, "unconfirmed", str)
        raise client.make_error(
            StoreUnavailable,
            None,
            f"only {replies[-1]} of {wanted} replicas acknowledged the write within "
            f"{timeout_ms} ms; {unconfirmed}",
        )
    return replies[:-1]


def _log_write_retry(client: Client, attempts: int, state: Any) -> None:
    """Before a write's retry: what failed, and which retry this is."""
    _log.info(
        "%s: a write failed (%s); retry %d of %d",
        client.url,
        client.describe_error(state.outcome.exception()),
        state.attempt_number,
        attempts - 1,
    )


def server_kwargs(url: StoreURL, options: Options) -> dict[str, Any]:
    """The server, database and credentials of ``url`` and ``options`` as redis-py's
    connection pools take them (the sync one and ``redis.asyncio``'s alike)."""
    return {
        "host": url.host or "localhost",
        "port": url.port or 6379,
        "db": int(url.path[1:] or 0),
        "username": url.username or None,
        "password": url.password or None,
        **options.driver_kwargs(),
    }


def probe_steps(
    connection: Any, client: Client, script: str, *, no_eviction: bool = False
) -> Steps[None]:
    """The steps of :meth:`RedisConnection.probe` over ``connection`` (sync or async):
    ``PING``; check the server is a primary, not a cluster, and runs ``script`` (the write
    script of ``client``, loaded now; ``""``: none). ``no_eviction``: refuse a server that may
    evict keys (``INFO memory``, allowed where ``CONFIG`` is not; ``ConfigurationError``)."""

    def build(pipe: Any) -> None:
        pipe.ping()
        if script:
            pipe.script_load(script)
        if no_eviction:
            pipe.info("memory")
        pipe.info("replication")
        pipe.info("cluster")

    replies = yield from io(connection.pipelined, build)
    replication, cluster = replies[-2:]
    if isinstance(cluster, Mapping) and str(cluster.get("cluster_enabled", "0")) == "1":
        raise ConfigurationError(
            f"{client.url} is a Redis Cluster node; {type(client).__name__} needs a "
            "standalone primary (Redis Cluster is not supported yet)"
        )
    if isinstance(replication, Mapping) and replication.get("role") not in (None, "master"):
        raise ConsistencyError(
            f"{client.url} is a read-only replica (role {replication.get('role')!r}): its "
            "reads can be stale; point the store at the primary"
        )
    if no_eviction:
        memory = replies[-3]
        policy = memory.get("maxmemory_policy") if isinstance(memory, Mapping) else None
        if policy != "noeviction":
            said = (
                f"may evict keys (maxmemory_policy {text_of(policy)!r})"
                if policy is not None
                else "does not say whether it evicts keys (no maxmemory_policy in INFO memory)"
            )
            raise ConfigurationError(
                f"{client.url} {said}: {type(client).__name__} must never lose a key; set "
                "maxmemory-policy noeviction (CONFIG SET maxmemory-policy noeviction, or the "
                "managed service's parameter) and raise maxmemory if memory runs short"
            )
    if script:  # refused now if the ACL forbids EVALSHA
        yield from io(connection.read, connection.client.evalsha, _sha1(script), 0)


def foreign_value_error(client: Client, detail: str = "") -> ConfigurationError:
    """The error for a key under ``client``'s ``key_prefix`` that dedupstore did not write."""
    return client.make_error(
        ConfigurationError,
        None,
        f"a key under the prefix {client.option('key_prefix')!r} "
        "holds a value dedupstore did not write; the key_prefix must be reserved for "
        f"this store{f' ({detail})' if detail else ''}",
    )
