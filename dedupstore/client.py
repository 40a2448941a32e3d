"""What every object opened by URL shares: :class:`Client` and its :class:`Connection`.

:class:`Client` parses the URL once, resolves the declared options, classifies driver
errors through one hook (:meth:`Client._classify_error`), masks secrets, pickles by
configuration and refuses use after :meth:`Client.close` (``StoreClosed``). A backend's
:class:`Connection` (the driver's pool for one server, with the driver-level rules) is
shared by every client of that server in a process; its clients name it in
:attr:`Client.connection_class` and add their key layout and calls.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import contextvars
import functools
import inspect
import logging
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import Any, ClassVar, Generic, Protocol, Self, TypeVar, cast

from dedupstore import calls, metrics
from dedupstore.errors import (
    ConfigurationError,
    DedupStoreError,
    StoreClosed,
    StoreUnavailable,
    format_error,
)
from dedupstore.masking import mask_url, scrub
from dedupstore.options import Option, Options, OptionSet, boolean
from dedupstore.steps import Steps, io, offload_to, on_async_face
from dedupstore.urls import StoreURL

__all__ = [
    "MUST_EXIST",
    "Client",
    "Closing",
    "Connected",
    "Connection",
    "ErrorKind",
    "ProcessLocal",
    "check_client",
    "creates",
    "part_of",
]

T = TypeVar("T")
E = TypeVar("E", bound=DedupStoreError)
C = TypeVar("C", bound="Connection")

#: What :meth:`Client._classify_error` returns: an error class (the base writes the
#: message), a ready error (raised as is), or ``None`` (not a driver error).
ErrorKind = type[DedupStoreError] | DedupStoreError | None

_log = logging.getLogger(__name__)

#: ``must_exist`` (keyword only, every store): the CLI's read-only commands open with it,
#: so a typo in a URL cannot answer from a new, empty store.
MUST_EXIST = Option(
    "must_exist",
    boolean,
    False,
    "open an existing store only: create nothing (whatever 'create' says); a missing "
    "file, table, database or container is a ConfigurationError 'no such store'",
    in_url=False,
)

# Objects inherited through fork(): their sockets belong to the parent, so the
# child must neither use nor close them. Kept referenced here, never collected.
_inherited: list[object] = []


class _Slot:
    """One shared value of one process, and how many handles hold it."""

    __slots__ = ("lock", "pid", "refs", "value")

    def __init__(self, pid: int) -> None:
        self.lock = threading.Lock()
        self.pid = pid
        self.refs = 0
        self.value: object = None


_own_threads_lock = threading.Lock()  # (Connection.offload_executor)

# The values shared by key (ProcessLocal(..., key=...)): at most one per key and process.
_shared: dict[Hashable, _Slot] = {}
_shared_lock = threading.Lock()


class ProcessLocal(Generic[T]):
    """One ``T`` per process, made by ``factory`` on first use; with ``key``, shared.

    After ``fork()`` the child makes its own and never uses or closes the parent's
    (closing a socket in the child can end the parent's session). Handles of one
    process with equal keys (so equivalent factories) share one ``T``, reference
    counted: :meth:`close` of the last holder closes it (:class:`Connection`).
    """

    def __init__(
        self,
        factory: Callable[[], T],
        close: Callable[[T], None] | None = None,
        *,
        key: Hashable | None = None,
    ) -> None:
        self._factory = factory
        self._close = close
        self._key = key
        self._value: T | None = None
        self._pid = 0
        self._lock = threading.Lock()

    def get(self) -> T:
        """This process's instance (made now if needed)."""
        value, pid = self._value, calls.pid()
        if value is not None and self._pid == pid:
            return value
        with self._lock:
            if self._value is None or self._pid != pid:
                if self._key is not None:
                    self._value = self._acquire(pid)
                else:
                    if self._value is not None:
                        _inherited.append(self._value)
                    self._value = self._factory()
                self._pid = pid
            return self._value

    def _acquire(self, pid: int) -> T:
        """The shared value of ``key`` in this process, made if absent; one more holder."""
        with _shared_lock:
            slot = _shared.get(self._key)
            if slot is None or slot.pid != pid:
                if slot is not None and slot.value is not None:
                    _inherited.append(slot.value)  # the parent's, before a fork
                slot = _shared[self._key] = _Slot(pid)
            slot.refs += 1
        try:
            with slot.lock:  # made once, outside the registry's lock (it may connect)
                if slot.value is None:
                    slot.value = self._factory()
                value: T = slot.value  # type: ignore[assignment]
                return value
        except BaseException:
            self._release(slot)
            raise

    def _release(self, slot: _Slot) -> bool:
        """One holder fewer; whether it was the last (then the slot is forgotten)."""
        with _shared_lock:
            slot.refs -= 1
            if slot.refs:
                return False
            if _shared.get(self._key) is slot:
                del _shared[self._key]
            return True

    @property
    def key(self) -> Hashable | None:
        """The key this handle shares its value by (``None``: not shared)."""
        return self._key

    def peek(self) -> T | None:
        """This process's instance, or ``None`` if it has none yet."""
        return self._value if self._pid == calls.pid() else None

    def close(self) -> None:
        """Let go of this process's instance; close it unless another handle holds it."""
        with self._lock:
            value, self._value = self._value, None
            mine = self._pid == calls.pid()
        if value is None or not mine:
            return
        if self._key is not None:
            with _shared_lock:
                slot = _shared.get(self._key)
            if slot is None or slot.value is not value or not self._release(slot):
                return
        if self._close is not None:
            self._close(value)


class Closing:
    """``with`` support for an object with ``close()``: the block's end closes it."""

    def close(self) -> None:
        """Release what the object holds."""
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def creates(options: Options) -> bool:
    """Whether opening with ``options`` may create what is missing: ``create``, unless
    ``must_exist`` (:attr:`Client.creates`, for a :class:`Connection`)."""
    return bool(options.get("create", False)) and not options.get("must_exist", False)


def check_client(
    options: Options,
    kind: type,
    what: str,
    note: str = "",
    fits: Callable[[Any], bool] | None = None,
) -> None:
    """``ConfigurationError`` for a given ``client`` option that is not a ``kind`` (or that
    ``fits`` refuses); ``what`` names the type asked for ("a redis.Redis"), ``note`` adds."""
    given = options.get("client")
    if given is not None and not (isinstance(given, kind) and (fits is None or fits(given))):
        extra = f" ({note})" if note else ""
        raise ConfigurationError(f"client must be {what}, got {type(given).__name__}{extra}")


#: The drivers' loggers :func:`quiet_driver_logs` quieted (``dedupstore consume
#: --log-level DEBUG`` shows them again).
DRIVER_LOGGERS: set[str] = set()


def quiet_driver_logs(*names: str) -> None:
    """Give each of ``names`` still at ``NOTSET`` the level ``CRITICAL``: what a failing
    driver logs (pika: a dozen lines per refused connection) reaches the caller as one
    exception instead. A logger given a level before the backend is imported keeps it."""
    for name in names:
        DRIVER_LOGGERS.add(name)
        driver = logging.getLogger(name)
        if driver.level == logging.NOTSET:
            driver.setLevel(logging.CRITICAL)


def part_of(client: Client, name: str, kind: type[T]) -> T:
    """``client.<name>``, a ``kind``: what a client tells its connection's rules about
    itself (its table, its container); ``name`` is a public attribute of its class."""
    value = getattr(client, name, None)
    assert isinstance(value, kind), f"{type(client).__name__}.{name} is not a {kind.__name__}"
    return value


class AsyncConnection(Protocol):
    """What the async face needs of an async twin (:meth:`Connection.async_twin`)."""

    async def close(self) -> None:
        """Release the twin's connections."""


class _Held:
    """The connection of one client alone (an async twin, :meth:`Client._async_twin`),
    in the place of its :class:`ProcessLocal` handle; closed by :meth:`aclose`
    (:meth:`Client.close_async_twins`), or when its loop ends its tasks."""

    def __init__(self, connection: AsyncConnection, key: Hashable | None) -> None:
        self.connection = connection
        self.key = key
        # In a context of its own: this one may be a call's (its deadline), and a task
        # copies the context it is made in.
        self._keeper = asyncio.get_running_loop().create_task(
            _closed_with_loop(connection),
            name="dedupstore-aio-twin-keeper",
            context=contextvars.Context(),
        )

    def get(self) -> Any:
        return self.connection

    def peek(self) -> Any:
        return self.connection

    def close(self) -> None:
        """Nothing here: :meth:`aclose` (or the end of the loop) closes the connection."""

    async def aclose(self) -> None:
        """Close the connection (by its keeper, which closes it once cancelled); its
        error, if its ``close`` raised one."""
        keeper = self._keeper
        keeper.cancel()
        await asyncio.wait([keeper])
        if not keeper.cancelled():
            keeper.result()


async def _closed_with_loop(connection: AsyncConnection) -> None:
    """Close ``connection`` when this task is cancelled: by :meth:`_Held.aclose`, or by
    ``asyncio.run()``, which cancels every task of its loop as it ends, so that a twin its
    user did not close releases its sockets there (and a pool's workers, which may
    swallow a cancellation, end rather than hang the end of ``asyncio.run()``). A loop
    closed without ending its tasks leaves this one pending, as it leaves any."""
    loop = asyncio.get_running_loop()
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        await connection.close()
        raise
    except GeneratorExit:  # collected, not cancelled: its loop ended without ending its
        if _running_loop() is loop:  # tasks (there is no loop to close the connection on)
            raise


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class Connection(abc.ABC):
    """A backend's connection to one server in one process, shared by its clients.

    Made on first use from the first client's URL and options; the clients of one
    process whose :meth:`key` agrees hold the same object, reference counted
    (:meth:`close` runs when the last holder closes; a child after ``fork`` makes its
    own). A ``client`` given by the user is wrapped, never closed. A backend adds its
    driver calls and the rules :class:`Client` calls: :meth:`validate`,
    :meth:`deadline_seconds`, :meth:`classify_error`, :meth:`health_warnings`.
    """

    #: The options, besides the URL's server and credentials, that shape the driver's
    #: connection: clients whose values agree share one.
    shaped_by: ClassVar[tuple[str, ...]] = ()
    #: The backend's URL schemes, the first its name in metrics; its clients' default.
    schemes: ClassVar[tuple[str, ...]] = ()
    #: True when the data lives in this process only: its clients' default.
    process_local: ClassVar[bool] = False
    #: True when the URL must name the server's host (unless a ``client`` or a ``host``
    #: driver parameter is given): else ``ConfigurationError``, not a refused default host.
    needs_host: ClassVar[bool] = False

    @classmethod
    def async_twin(cls, url: StoreURL, options: Options) -> AsyncConnection | None:
        """The async face's connection to the same server with the same options (no I/O:
        it connects on first use, on the running event loop), with the same method names
        as this class's, awaited: a client's primitives written as steps then run on it
        natively on the async face (:meth:`Client._primitive`). ``None`` (the default):
        the backend has no async driver, and its calls run in the async face's threads."""
        return None

    #: Threads of the async face for the blocking calls of this connection's clients
    #: (their primitives without an async driver): ``None``, the face's shared pool
    #: (``DEDUPSTORE_AIO_THREADS``); a number, that many threads of this connection's own
    #: (:meth:`offload_executor`), one pool per connection and process: SQLite's is 1,
    #: one writer per database file (``make bench-drivers``).
    offload_threads: ClassVar[int | None] = None

    def __init__(self, url: StoreURL, options: Options) -> None:
        """Open the connection (it may do I/O) from the first client's URL and options."""
        self.url = url
        self.options = options

    def offload_executor(self) -> ThreadPoolExecutor | None:
        """The threads of this connection's own for the async face's blocking calls (made
        on first use), or ``None`` for the shared pool (:attr:`offload_threads`)."""
        threads = self.offload_threads
        if threads is None:
            return None
        with _own_threads_lock:
            executor: ThreadPoolExecutor | None = self.__dict__.get("_offload_executor")
            if executor is None:
                executor = self.__dict__["_offload_executor"] = ThreadPoolExecutor(
                    threads, thread_name_prefix="dedupstore-aio-own"
                )
        return executor

    def close_offload_executor(self) -> None:
        """Let the threads of :meth:`offload_executor` end (a connection's ``close``)."""
        with _own_threads_lock:
            executor = self.__dict__.pop("_offload_executor", None)
        if executor is not None:
            executor.shutdown(wait=False)

    @classmethod
    def portable_url(cls, url: str | StoreURL) -> StoreURL:
        """``url`` as another process must see it: see :meth:`Client.portable_url`."""
        return StoreURL.parse(url)

    @classmethod
    def key(cls, url: StoreURL, options: Options) -> Hashable:
        """What clients must agree on to share a connection: the backend, the URL's
        server and credentials (:meth:`address`), the options of :attr:`shaped_by`;
        a given ``client`` by identity."""
        shaped = tuple(options.get(name) for name in cls.shaped_by)
        given = options.get("client")
        if given is not None:
            return (cls, "client", id(given), shaped)
        return (cls, cls.address(url, options), shaped)

    @classmethod
    def address(cls, url: StoreURL, options: Options) -> Hashable:
        """The server and credentials ``url`` and ``options`` name (the whole URL by default)."""
        return url.text

    @classmethod
    def validate(cls, url: StoreURL, options: Options) -> None:
        """Refuse (``ConfigurationError``) what the driver cannot use; no I/O
        (run by :meth:`Client._validate`)."""
        return None

    @classmethod
    def deadline_seconds(cls, options: Options) -> float | None:
        """How long one call of a client may take in all (:meth:`Client._deadline_seconds`):
        ``connect_timeout + (retries + 1) x timeout`` (connecting once, then attempts of
        at most ``timeout`` each) for a backend with those three options, else ``None``."""
        # (three ``in``: comparing a set with a mapping's keys is slow, and every call asks)
        if "connect_timeout" in options and "retries" in options and "timeout" in options:
            return float(options["connect_timeout"] + (options["retries"] + 1) * options["timeout"])
        return None

    @classmethod
    def classify_error(cls, client: Client, exc: BaseException) -> ErrorKind:
        """The driver's errors judged for ``client``: see :meth:`Client._classify_error`."""
        return None

    @classmethod
    def describe_error(cls, client: Client, exc: BaseException) -> str | None:
        """A driver error as one short line for ``client`` (``None``: the default line,
        see :meth:`Client.describe_error`)."""
        return None

    @classmethod
    def secrets(cls, options: Options) -> set[str]:
        """Secrets the options lead to besides the declared ones (say, an environment
        variable's key): masked in every message too."""
        return set()

    def health_warnings(self, client: Client) -> list[str]:
        """Warnings about the server's durability or consistency settings; none by default."""
        return []

    @abc.abstractmethod
    def close(self) -> None:
        """Release the driver's connections (not a given ``client``); called once."""


class Connected(Generic[C]):
    """``_redis = Connected(RedisConnection)`` in a client class body: the class's
    :attr:`Client.connection_class`, and ``self._redis`` reads as ``self.connection``,
    typed as the backend's connection class."""

    def __init__(self, kind: type[C]) -> None:
        self.kind = kind

    def __set_name__(self, owner: type[Client], name: str) -> None:
        owner.connection_class = self.kind  # before Client.__init_subclass__ reads it

    def __get__(self, client: Client, owner: type[Client] | None = None) -> C:
        connection: C = client.connection  # type: ignore[assignment]
        return connection


class Client(Closing, abc.ABC):
    """Base of every object opened by URL: option resolution, errors, pickling, closing.

    Constructors take the URL and the keyword options ``open_store`` accepts:
    ``Cls(url, **options)``. Its members for backends are listed by
    :mod:`dedupstore.backend`; the underscore hooks (``_configure``, ``_open``, ...)
    are called by this class, never by users.
    """

    #: The URL as parsed (secrets included: never show it; :attr:`url` is masked).
    store_url: StoreURL
    #: The resolved options (declared in :attr:`declared_options`); read-only.
    options: Options

    #: URL schemes this class serves (informational: the registry decides).
    schemes: ClassVar[tuple[str, ...]] = ()
    #: The options this class accepts, declared once (stores extend this set).
    declared_options: ClassVar[OptionSet] = OptionSet(MUST_EXIST)
    #: True when the data lives in this process only (another process opening the same
    #: URL sees other data): such a client cannot be shared with worker processes.
    process_local: ClassVar[bool] = False
    #: The backend's connection class (one instance per server and process, shared by
    #: its clients); ``None``: the client keeps no connection.
    connection_class: ClassVar[type[Connection] | None] = None
    #: The names of the class's primitives (:meth:`_primitive`); a role class lists them.
    primitives: ClassVar[tuple[str, ...]] = ()
    #: Those of ``primitives`` the class writes as steps (generator functions), found
    #: when the class is made.
    stepped: ClassVar[frozenset[str]] = frozenset()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A class naming a ``connection_class`` takes its backend's :attr:`schemes` and
        :attr:`process_local` from it, unless it sets its own; its :attr:`stepped`
        primitives are found."""
        super().__init_subclass__(**kwargs)
        cls.stepped = frozenset(
            name for name in cls.primitives if inspect.isgeneratorfunction(getattr(cls, name))
        )
        kind = cls.__dict__.get("connection_class")
        if kind is not None:
            if "schemes" not in cls.__dict__:
                cls.schemes = kind.schemes
            if "process_local" not in cls.__dict__:
                cls.process_local = kind.process_local

    def __init__(self, url: str | StoreURL, /, **options: Any) -> None:
        """Open the store, table or queue named by ``url`` and check that it is usable.

        ``options`` come as keywords or in the URL's query. Raises ``ConfigurationError``
        for a bad URL or option before any I/O (:meth:`check_options`), and for what the
        server refuses (credentials, permissions, a missing table without ``create``, one
        of another shape); ``ConsistencyError`` for a server too weak for the backend's
        guarantees; ``StoreUnavailable`` when the server cannot be reached within the
        deadline. A failed open leaves no connection behind.
        """
        self._closed = False
        self.store_url = self.portable_url(url)
        self.options = self.declared_options.resolve(type(self).__name__, self.store_url, options)
        self._validate(self.store_url, self.options)
        kind = self.connection_class
        self._connection_handle: ProcessLocal[Connection] | None = None
        if kind is not None:
            url, opts = self.store_url, self.options
            self._connection_handle = ProcessLocal(
                lambda: kind(url, opts), kind.close, key=kind.key(url, opts)
            )
        self._configure()
        if type(self)._open is not Client._open:  # no I/O, no call to record
            with self._opening():
                self._open()

    @classmethod
    def portable_url(cls, url: str | StoreURL) -> StoreURL:
        """``url`` as another process on this machine must see it to reach the same data
        (:meth:`Connection.portable_url`: SQLite makes the path absolute). Raises
        ``ConfigurationError`` for a malformed URL. No I/O.
        """
        kind = cls.connection_class
        return StoreURL.parse(url) if kind is None else kind.portable_url(url)

    @classmethod
    def check_options(cls, url: str | StoreURL, **options: Any) -> None:
        """Raise ``ConfigurationError`` if ``url`` or ``options`` would be refused; no I/O.

        The constructor's checks before its first I/O (the converters, :meth:`_validate`):
        what passes fails later only for what needs the server or this process's
        environment (Cosmos DB's ``COSMOS_KEY``).
        """
        parsed = cls.portable_url(url)
        cls._validate(parsed, cls.declared_options.resolve(cls.__name__, parsed, options))

    @classmethod
    def _validate(cls, url: StoreURL, options: Options) -> None:
        """Refuse (``ConfigurationError``) what no single option converter can see: the
        URL's shape, options that contradict each other; no I/O. Run by the constructor
        and :meth:`check_options` alike; runs :meth:`Connection.validate`. Clients extend
        it, calling ``super()._validate`` first.
        """
        kind = cls.connection_class
        if kind is not None:
            given = options.get("client") is not None or "host" in options.driver_params
            if kind.needs_host and not url.host and not given:
                raise ConfigurationError(
                    f"the {url.scheme}:// URL {url.masked!r} names no host: "
                    f"{url.scheme}://host[:port]/..."
                )
            kind.validate(url, options)

    # ------------------------------------------------------------------ public

    @classmethod
    def from_url(cls, url: str | StoreURL, **options: Any) -> Self:
        """Same as the constructor (kept for symmetry with other libraries)."""
        return cls(url, **options)

    @property
    def url(self) -> str:
        """The URL the object was opened with (secrets masked)."""
        return mask_url(self.store_url.text, self.declared_options.secret_names)

    def option(self, name: str) -> Any:
        """The resolved value of a declared option."""
        return self.options[name]

    def health_warnings(self) -> list[str]:
        """Human-readable warnings about durability or consistency settings (``dedupstore
        check``). Raises ``StoreClosed`` and ``StoreUnavailable``."""
        self.check_open()
        with self.translating_errors("health check"):
            return self._health_warnings()

    def close(self) -> None:
        """Release connections; idempotent. The object cannot be used afterwards."""
        if not self._closed:
            self._closed = True
            self._close()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def __repr__(self) -> str:
        shown = {k: v for k, v in self.options.shown().items() if k not in self.options.from_url}
        args = "".join(f", {key}={value!r}" for key, value in shown.items())
        return f"{type(self).__name__}({self.url!r}{args})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_reopen, (type(self), self.store_url.text, self.options.pickled_keywords()))

    # ------------------------------------------------------------- for backends: hooks, helpers

    def _configure(self) -> None:
        """Set up what the options decide, without I/O (role classes extend it)."""

    def _open(self) -> None:
        """The backend's I/O that opens this object (check the server, open the table),
        run by the constructor under :meth:`_opening`, after :meth:`_configure`."""

    def _close(self) -> None:
        """Let go of the connection (closed if no other client holds it); called once."""
        if self._connection_handle is not None:
            self._connection_handle.close()

    @property
    def connection(self) -> Connection:
        """This process's connection to the server (:class:`Connection`), shared with its
        other clients, made on first use; only for a class with a :attr:`connection_class`."""
        assert self._connection_handle is not None, f"{type(self).__name__} has no connection_class"
        return self._connection_handle.get()

    @property
    def made_connection(self) -> Connection | None:
        """This process's connection if it is made already, else ``None`` (never makes one)."""
        handle = self._connection_handle
        return None if handle is None else handle.peek()

    def _health_warnings(self) -> list[str]:
        """Warnings for ``dedupstore check``: :meth:`Connection.health_warnings`."""
        if self.connection_class is None:
            return []
        return self.connection.health_warnings(self)

    def _deadline_seconds(self) -> float | None:
        """How long one call (one chunk of a batch) may take in all, retries included
        (:meth:`Connection.deadline_seconds`): its round trips run under this deadline
        (:func:`dedupstore.calls.deadline`). ``None``: only the driver's own timeouts.
        """
        kind = self.connection_class
        return None if kind is None else kind.deadline_seconds(self.options)

    @functools.cached_property
    def _call_deadline(self) -> float | None:
        """:meth:`_deadline_seconds`, worked out once (the options do not change)."""
        return self._deadline_seconds()

    def _shares_connection_with(self, other: Client) -> bool:
        """Whether ``other`` uses the very connection this object uses: then one request
        can carry the work of both (:meth:`EntityStore._joined`)."""
        mine, theirs = self._connection_handle, other._connection_handle
        return mine is not None and theirs is not None and mine.key == theirs.key

    @property
    def creates(self) -> bool:
        """Whether opening may create what is missing: ``create``, unless ``must_exist``
        (backends test this, never the ``create`` option)."""
        return creates(self.options)

    def no_such_store(self, what: str, fix: str) -> ConfigurationError:
        """The error for a store that does not exist (``what``, in the user's terms):
        ``fix`` says how to create it, or with ``must_exist`` to check the URL."""
        if self.options.get("must_exist", False):
            return ConfigurationError(
                f"no such store: {what} (nothing was created: check the URL, or create the "
                "store first)"
            )
        return ConfigurationError(f"no such store: {what}; {fix}")

    def check_open(self) -> None:
        """Raise ``StoreClosed`` if :meth:`close` was called (every public call's first line)."""
        if self._closed:
            raise StoreClosed(f"{self!r} is closed; open a new one")

    def _primitive(self, name: str, *args: Any) -> Steps[Any]:
        """The primitive ``name`` called with ``args``, as steps. One the class writes as a
        generator function runs as its own steps: on the sync face over this client's
        connection, on the async face (:func:`dedupstore.steps.on_async_face`) over the
        async twin of it (:meth:`Connection.async_twin`), awaited on the loop. Any other
        primitive is one blocking call (in a thread on the async face)."""
        if name in self.stepped:
            face = self._async_twin() if on_async_face() else self
            return (yield from getattr(face, name)(*args))
        primitive = getattr(self, name)
        own = None
        if on_async_face() and self.connection_class is not None:
            own = self.connection.offload_executor()
        if own is not None:  # the connection's own threads, not the shared pool
            return (yield from io(offload_to, own, primitive, *args))
        return (yield from io(primitive, *args))

    def _async_twin(self) -> Self:
        """This client on the async twin of its connection, one per event loop (its
        connection is bound to the loop), made on first use (no I/O: it connects at its
        first call); this client itself when the backend has no async driver or the
        user gave a ``client`` (a sync driver object). The twin shares this client's
        state (options, write tokens) and is used only inside its primitives' steps."""
        loop = asyncio.get_running_loop()
        twins: dict[asyncio.AbstractEventLoop, Any] = self.__dict__.setdefault("_twins", {})
        twin = twins.get(loop)
        if twin is None:
            for ended in [other for other in twins if other.is_closed()]:
                twins.pop(ended, None)  # a loop that ended (asyncio.run() after another)
            kind = self.connection_class
            connection = None
            if kind is not None and self.options.get("client") is None:
                connection = kind.async_twin(self.store_url, self.options)
            if connection is None:
                twin = self
            else:
                twin = object.__new__(type(self))
                twin.__dict__.update(self.__dict__)
                handle = self._connection_handle
                twin._connection_handle = _Held(connection, None if handle is None else handle.key)  # type: ignore[assignment]
            twin = twins.setdefault(loop, twin)
        return cast(Self, twin)

    async def close_async_twins(self) -> None:
        """Close the async connections of this client's twins (:meth:`_async_twin`): the
        running loop's awaited, those of other loops dropped. Called by the async face's
        ``close``; a later async call makes a new one."""
        twins: dict[asyncio.AbstractEventLoop, Any] = self.__dict__.get("_twins", {})
        mine = twins.pop(asyncio.get_running_loop(), None)
        twins.clear()
        if mine is not None and mine is not self:
            await cast(_Held, mine._connection_handle).aclose()

    def _classify_error(self, exc: BaseException) -> ErrorKind:
        """Map a driver exception to an error class (or a ready error); ``None`` if foreign.

        The one place driver errors are judged: ``StoreUnavailable`` (retry),
        ``ConfigurationError`` (fix it), ``ConsistencyError``. The connection class
        judges first (:meth:`Connection.classify_error`); overrides call ``super()`` last.
        """
        if self.connection_class is not None:
            kind = self.connection_class.classify_error(self, exc)
            if kind is not None:
                return kind
        if isinstance(exc, TimeoutError | ConnectionError):
            return StoreUnavailable
        return None

    def describe_error(self, exc: BaseException) -> str:
        """The driver error as one short line, secrets scrubbed (the connection class's
        :meth:`Connection.describe_error` first)."""
        kind = self.connection_class
        described = None if kind is None else kind.describe_error(self, exc)
        if described is not None:
            return described
        line = format_error(exc)
        if len(line) > 300:
            line = line[:297] + "..."
        return self.scrub(f"{type(exc).__name__}: {line}" if str(exc) else type(exc).__name__)

    def _secret_values(self) -> set[str]:
        """Every secret this object knows: the URL's password, secret options and the
        connection class's :meth:`Connection.secrets`."""
        secrets = self.store_url.secrets
        for name, option in self.declared_options.items():
            value = self.options.get(name)
            if option.secret and isinstance(value, str):
                secrets.add(value)
        if self.connection_class is not None:
            secrets |= self.connection_class.secrets(self.options)
        secrets.discard("")
        return secrets

    def scrub(self, text: str) -> str:
        """Remove this object's secrets from ``text`` (:func:`dedupstore.masking.scrub`)."""
        return scrub(text, self._secret_values(), self.declared_options.secret_names)

    def make_error(self, kind: type[E], operation: str | None, detail: str) -> E:
        """An error of ``kind``, secrets scrubbed: ``"<Class> at <url>: <operation> failed:
        <detail>"`` (without ``operation``, ``None``: ``"<Class> at <url>: <detail>"``)."""
        text = detail if operation is None else f"{operation} failed: {detail}"
        return kind(self.scrub(f"{type(self).__name__} at {self.url}: {text}"))

    @functools.cached_property
    def _backend(self) -> str:
        """The backend's name in metrics: its main URL scheme (``postgres`` -> ``postgresql``)."""
        scheme = self.store_url.scheme
        return self.schemes[0] if scheme in self.schemes else scheme

    @contextlib.contextmanager
    def _opening(self) -> Iterator[None]:
        """The block finishes a constructor (driver errors classified as ``open``'s): on
        any error the connections are released (:meth:`_close`) before it is raised."""
        try:
            with self.translating_errors("open"):
                yield
        except BaseException:
            self._close()
            raise

    def translating_errors(self, operation: str) -> _Translating:
        """Classify driver errors raised in the block (chained); library errors pass.

        The block runs under the call's deadline (:meth:`_deadline_seconds`); its
        duration goes to the ``dedupstore.store.duration`` histogram with the class
        name of its error, and ``StoreUnavailable`` is logged (INFO).
        """
        return _Translating(self, operation)

    def _translated(self, exc: Exception, operation: str) -> DedupStoreError | None:
        """The library's error for a driver's ``exc`` (``None``: not a driver error)."""
        kind = self._classify_error(exc)
        if kind is None or isinstance(kind, DedupStoreError):
            return kind
        return self.make_error(kind, operation, self.describe_error(exc))


class _Translating(contextlib.AbstractContextManager[None]):
    """The block of :meth:`Client.translating_errors` (a class, not a generator:
    every store call enters one)."""

    __slots__ = ("_client", "_deadline", "_operation", "_started")

    def __init__(self, client: Client, operation: str) -> None:
        self._client = client
        self._operation = operation
        self._started = 0.0
        self._deadline = calls.deadline(client._call_deadline)

    def __enter__(self) -> None:
        self._started = time.perf_counter()
        self._deadline.__enter__()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._deadline.__exit__(kind, exc, tb)
        client, operation = self._client, self._operation
        failed = exc
        try:
            if isinstance(exc, Exception) and not isinstance(exc, DedupStoreError):
                translated = client._translated(exc, operation)
                if translated is not None:
                    raise translated from exc
        except BaseException as raised:  # the translation (or a failure to make it)
            failed = raised
            raise
        finally:
            if isinstance(failed, StoreUnavailable):
                # at open the caller gets the error before anything runs: it reports it
                level = logging.DEBUG if operation == "open" else logging.INFO
                _log.log(level, "store unavailable: %s", client.scrub(format_error(failed)))
            metrics.record_store_call(
                client._backend,
                operation,
                time.perf_counter() - self._started,
                None if failed is None else type(failed).__name__,
            )


def _reopen(cls: type[Client], url: str, options: dict[str, Any]) -> Any:
    return cls(url, **options)
