"""URL scheme -> implementation class, as import strings resolved lazily.

Importing :mod:`dedupstore` imports no backend and no client library: a backend
module is imported the first time an object with its scheme is opened. Third-party
backends register with :func:`register_backend` (entity stores:
:func:`register_entity_backend`, dispatchers: :func:`register_dispatcher`) or
through the entry-point group ``dedupstore.backends`` (``dedupstore.entity_stores``,
``dedupstore.dispatchers``; brokers: :func:`register_broker`, ``dedupstore.brokers``),
name: the scheme, value: ``"package.module:Class"``.
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass
from importlib.metadata import entry_points
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from dedupstore.errors import ConfigurationError
from dedupstore.urls import StoreURL

if TYPE_CHECKING:
    from collections.abc import Mapping

    from dedupstore.consumers import Broker
    from dedupstore.dispatch import URLDispatcher
    from dedupstore.entities import EntityStore
    from dedupstore.store import DeduplicationStore

__all__ = [
    "BROKER_ENTRY_POINT_GROUP",
    "DISPATCHER_ENTRY_POINT_GROUP",
    "ENTITY_ENTRY_POINT_GROUP",
    "ENTRY_POINT_GROUP",
    "BackendSpec",
    "Registry",
    "backend_class",
    "brokers",
    "dispatchers",
    "entity_stores",
    "known_backends",
    "register_backend",
    "register_broker",
    "register_dispatcher",
    "register_entity_backend",
    "stores",
]

ENTRY_POINT_GROUP = "dedupstore.backends"
ENTITY_ENTRY_POINT_GROUP = "dedupstore.entity_stores"
DISPATCHER_ENTRY_POINT_GROUP = "dedupstore.dispatchers"
BROKER_ENTRY_POINT_GROUP = "dedupstore.brokers"

T = TypeVar("T")


@dataclass(frozen=True)
class BackendSpec:
    """Where a scheme's implementation lives and what it needs.

    ``target`` is ``"module:Class"``; ``requires`` are the client modules imported
    before it; ``extra`` is the ``pip install 'dedupstore[extra]'`` that provides them.
    """

    target: str
    requires: tuple[str, ...] = ()
    extra: str | None = None


class Registry(Generic[T]):
    """Scheme -> :class:`BackendSpec` for one kind of object (stores, entity stores, ...)."""

    def __init__(self, kind: str, group: str, base: str, builtin: dict[str, BackendSpec]) -> None:
        self.kind = kind
        self.group = group
        self._base = base
        self._specs: dict[str, BackendSpec] = dict(builtin)
        self._lock = threading.Lock()
        self._entry_points_loaded = False
        #: Read-only view of the registered schemes.
        self.view: Mapping[str, BackendSpec] = MappingProxyType(self._specs)

    def register(
        self,
        scheme: str,
        target: str,
        *,
        clobber: bool = False,
        requires: tuple[str, ...] = (),
        extra: str | None = None,
    ) -> None:
        """Register ``target`` (``"module:Class"``) for URLs of ``scheme``; nothing is imported.

        Raises ``ValueError`` if ``scheme`` is taken and ``clobber`` is false, or if
        ``target`` is not of the form ``"module:Class"``.
        """
        if not isinstance(scheme, str) or not scheme or "://" in scheme or scheme != scheme.lower():
            raise ValueError(f"a scheme is a lower-case name such as 'myredis', got {scheme!r}")
        module, sep, name = target.partition(":")
        if not sep or not module or not name:
            raise ValueError(f"a {self.kind} target is 'package.module:Class', got {target!r}")
        with self._lock:
            if scheme in self._specs and not clobber and self._specs[scheme].target != target:
                raise ValueError(
                    f"scheme {scheme!r} is already registered to {self._specs[scheme].target}; "
                    "pass clobber=True to replace it"
                )
            self._specs[scheme] = BackendSpec(target, tuple(requires), extra)

    def _load_entry_points(self) -> None:
        with self._lock:
            if self._entry_points_loaded:
                return
            self._entry_points_loaded = True
            for ep in entry_points(group=self.group):
                self._specs.setdefault(ep.name, BackendSpec(ep.value))

    def resolve(self, scheme: str) -> type[T]:
        """Import and return the class registered for ``scheme``.

        Raises ``ConfigurationError`` for an unknown scheme, or when the client
        library is missing (the message names the extra to install).
        """
        if scheme not in self._specs:
            self._load_entry_points()
        spec = self._specs.get(scheme)
        if spec is None:
            known = ", ".join(f"{s}://" for s in sorted(self._specs))
            raise ConfigurationError(
                f"unknown {self.kind} URL scheme {scheme!r}; known schemes: {known}"
            )
        for module in spec.requires:
            try:
                importlib.import_module(module)
            except ImportError as exc:
                hint = (
                    f"pip install 'dedupstore[{spec.extra}]'" if spec.extra else f"install {module}"
                )
                raise ConfigurationError(
                    f"the {scheme}:// {self.kind} needs the {module} client library, which is "
                    f"not installed: {hint}"
                ) from exc
        module_name, _, class_name = spec.target.partition(":")
        try:
            cls: Any = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError) as exc:
            hint = f" (pip install 'dedupstore[{spec.extra}]')" if spec.extra else ""
            raise ConfigurationError(
                f"cannot load the {scheme}:// {self.kind} {spec.target}: {exc}{hint}"
            ) from exc
        base_module, _, base_name = self._base.partition(":")
        base = getattr(importlib.import_module(base_module), base_name)
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise ConfigurationError(f"{spec.target} is not a {base_name} subclass")
        return cls

    def open(self, url: str | StoreURL, **options: Any) -> T:
        """Parse ``url`` once and open it with the class of its scheme."""
        parsed = StoreURL.parse(url)
        cls: Any = self.resolve(parsed.scheme)
        return cls(parsed, **options)  # type: ignore[no-any-return]


_PG = ("psycopg", "psycopg_pool")

#: scheme -> (module, class-name prefix, client modules, extra). Each backend module
#: holds ``<prefix>DeduplicationStore`` and ``<prefix>EntityStore``.
_BUILTIN: dict[str, tuple[str, str, tuple[str, ...], str | None]] = {
    "memory": ("dedupstore.backends.memory", "Memory", (), None),
    "sqlite": ("dedupstore.backends.sqlite", "Sqlite", (), None),
    "postgresql": ("dedupstore.backends.postgres", "Postgres", _PG, "postgres"),
    "postgres": ("dedupstore.backends.postgres", "Postgres", _PG, "postgres"),
    "redis": ("dedupstore.backends.redis", "Redis", ("redis",), "redis"),
    "rediss": ("dedupstore.backends.redis", "Redis", ("redis",), "redis"),
    "dynamodb": ("dedupstore.backends.dynamodb", "DynamoDB", ("boto3",), "dynamodb"),
    "cosmos": ("dedupstore.backends.cosmos", "Cosmos", ("azure.cosmos",), "cosmos"),
}


def _builtin(kind: str) -> dict[str, BackendSpec]:
    return {
        scheme: BackendSpec(f"{module}:{prefix}{kind}", requires, extra)
        for scheme, (module, prefix, requires, extra) in _BUILTIN.items()
    }


stores: Registry[DeduplicationStore] = Registry(
    "store",
    ENTRY_POINT_GROUP,
    "dedupstore.store:DeduplicationStore",
    _builtin("DeduplicationStore"),
)
entity_stores: Registry[EntityStore] = Registry(
    "entity store",
    ENTITY_ENTRY_POINT_GROUP,
    "dedupstore.entities:EntityStore",
    _builtin("EntityStore"),
)

#: Dispatchers: their own table (not every store backend has one).
dispatchers: Registry[URLDispatcher] = Registry(
    "dispatcher",
    DISPATCHER_ENTRY_POINT_GROUP,
    "dedupstore.dispatch:URLDispatcher",
    {
        "memory": BackendSpec("dedupstore.backends.memory:MemoryDispatcher"),
        "sqlite": BackendSpec("dedupstore.backends.sqlite:SqliteDispatcher"),
        "redis": BackendSpec("dedupstore.backends.redis:RedisDispatcher", ("redis",), "redis"),
        "rediss": BackendSpec("dedupstore.backends.redis:RedisDispatcher", ("redis",), "redis"),
        "amqp": BackendSpec(
            "dedupstore.backends.rabbitmq:RabbitMQDispatcher", ("pika",), "rabbitmq"
        ),
        "amqps": BackendSpec(
            "dedupstore.backends.rabbitmq:RabbitMQDispatcher", ("pika",), "rabbitmq"
        ),
    },
)

#: Brokers a consume loop reads (:mod:`dedupstore.consumers`): their own table too.
brokers: Registry[Broker] = Registry(
    "broker",
    BROKER_ENTRY_POINT_GROUP,
    "dedupstore.consumers:Broker",
    {
        "redis": BackendSpec(
            "dedupstore.backends.redis.consumer:RedisStreamsBroker", ("redis",), "redis"
        ),
        "rediss": BackendSpec(
            "dedupstore.backends.redis.consumer:RedisStreamsBroker", ("redis",), "redis"
        ),
        "amqp": BackendSpec(
            "dedupstore.backends.rabbitmq.consumer:RabbitMQBroker", ("pika",), "rabbitmq"
        ),
        "amqps": BackendSpec(
            "dedupstore.backends.rabbitmq.consumer:RabbitMQBroker", ("pika",), "rabbitmq"
        ),
        "kafka": BackendSpec(
            "dedupstore.backends.kafka:KafkaBroker", ("confluent_kafka",), "kafka"
        ),
    },
)

#: Read-only view of the registered store schemes.
known_backends: Mapping[str, BackendSpec] = stores.view


def register_backend(
    scheme: str,
    target: str,
    *,
    clobber: bool = False,
    requires: tuple[str, ...] = (),
    extra: str | None = None,
) -> None:
    """Register a deduplication store class for ``scheme``; see :meth:`Registry.register`."""
    stores.register(scheme, target, clobber=clobber, requires=requires, extra=extra)


def backend_class(scheme: str) -> type[DeduplicationStore]:
    """Import and return the store class registered for ``scheme``."""
    return stores.resolve(scheme)


def register_entity_backend(
    scheme: str,
    target: str,
    *,
    clobber: bool = False,
    requires: tuple[str, ...] = (),
    extra: str | None = None,
) -> None:
    """Register an entity store class for ``scheme``; see :meth:`Registry.register`."""
    entity_stores.register(scheme, target, clobber=clobber, requires=requires, extra=extra)


def register_dispatcher(
    scheme: str,
    target: str,
    *,
    clobber: bool = False,
    requires: tuple[str, ...] = (),
    extra: str | None = None,
) -> None:
    """Register a :class:`~dedupstore.dispatch.URLDispatcher` class for ``scheme``.

    See :meth:`Registry.register` (``ValueError`` for a taken scheme or a bad target).
    """
    dispatchers.register(scheme, target, clobber=clobber, requires=requires, extra=extra)


def register_broker(
    scheme: str,
    target: str,
    *,
    clobber: bool = False,
    requires: tuple[str, ...] = (),
    extra: str | None = None,
) -> None:
    """Register a :class:`~dedupstore.consumers.Broker` class for ``scheme``.

    The class is opened as ``Cls(url, **options)`` by
    :func:`dedupstore.consumers.open_broker`. See :meth:`Registry.register`.
    """
    brokers.register(scheme, target, clobber=clobber, requires=requires, extra=extra)
