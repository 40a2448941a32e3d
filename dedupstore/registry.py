"""Every kind of plugin: one table of names -> ``"module:Class"`` strings, resolved lazily.

Kinds (:data:`KINDS`): ``store``, ``entity_store`` and ``token_store`` (URL schemes of
:func:`dedupstore.open_store`, :func:`dedupstore.open_entity_store` and
:func:`dedupstore.open_token_store`), ``dispatcher``
(:func:`dedupstore.open_dispatcher`), ``broker``
(:func:`dedupstore.consumers.open_broker`) and ``command`` (subcommands of the
``dedupstore`` command line, :class:`dedupstore.cli.Command`).

Importing :mod:`dedupstore` imports no plugin and no client library: a plugin's module
is imported the first time its name is resolved (:func:`resolve`). A name comes from
the built-in table, from :func:`register`, or from an entry point in the group
``dedupstore.<kind>`` (``dedupstore.store``, ..., ``dedupstore.command``; name: the
scheme or command, value: ``"package.module:Class"``), read once per kind, the first
time a name is not found or the names are listed (:func:`known`). The table and
:func:`register` win over an entry point of the same name.
"""

from __future__ import annotations

import importlib
import importlib.util
import threading
from dataclasses import dataclass
from importlib.metadata import entry_points
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal, get_args, overload

from dedupstore.errors import ConfigurationError
from dedupstore.urls import StoreURL

if TYPE_CHECKING:
    from collections.abc import Mapping

    from dedupstore.cli import Command
    from dedupstore.consumers import Broker
    from dedupstore.dispatch import URLDispatcher
    from dedupstore.entities import EntityStore
    from dedupstore.store import DeduplicationStore
    from dedupstore.tokens import TokenStore

__all__ = [
    "KINDS",
    "Kind",
    "PluginSpec",
    "entry_point_group",
    "known",
    "open_url",
    "register",
    "resolve",
]

#: A kind of plugin.
Kind = Literal["store", "entity_store", "token_store", "dispatcher", "broker", "command"]


@dataclass(frozen=True)
class PluginSpec:
    """Where a plugin lives and what it needs.

    ``target`` is ``"module:Class"``; ``requires`` are the modules that must be
    installed before it is imported; ``extra`` is the ``pip install 'dedupstore[extra]'``
    that provides them.
    """

    target: str
    requires: tuple[str, ...] = ()
    extra: str | None = None


@dataclass(frozen=True)
class _KindInfo:
    label: str  # in messages: "the redis:// entity store", "the sweep command"
    base: str  # "module:Class" every plugin of the kind subclasses
    url: bool  # names are URL schemes (shown as "redis://")


#: kind -> what its plugins are.
_KINDS: dict[str, _KindInfo] = {
    "store": _KindInfo("store", "dedupstore.store:DeduplicationStore", True),
    "entity_store": _KindInfo("entity store", "dedupstore.entities:EntityStore", True),
    "token_store": _KindInfo("token store", "dedupstore.tokens:TokenStore", True),
    "dispatcher": _KindInfo("dispatcher", "dedupstore.dispatch:URLDispatcher", True),
    "broker": _KindInfo("broker", "dedupstore.consumers:Broker", True),
    "command": _KindInfo("command", "dedupstore.cli:Command", False),
}
#: Every kind of plugin.
KINDS: tuple[Kind, ...] = get_args(Kind)

#: extra -> the modules it installs (what a plugin of that extra needs).
_EXTRAS: dict[str, tuple[str, ...]] = {
    "postgres": ("psycopg", "psycopg_pool"),
    "redis": ("redis",),
    "dynamodb": ("boto3",),
    "cosmos": ("azure.cosmos",),
    "rabbitmq": ("pika",),
    "kafka": ("confluent_kafka",),
    "spark": ("pyspark",),
}


def _spec(target: str, extra: str | None = None) -> PluginSpec:
    return PluginSpec(target, _EXTRAS[extra] if extra else (), extra)


_B = "dedupstore.backends"

#: The built-in plugins: kind -> name -> where it lives and the extra it needs.
_BUILTIN: dict[str, dict[str, PluginSpec]] = {
    "store": {
        "memory": _spec(f"{_B}.memory:MemoryDeduplicationStore"),
        "sqlite": _spec(f"{_B}.sqlite:SqliteDeduplicationStore"),
        "postgresql": _spec(f"{_B}.postgres:PostgresDeduplicationStore", "postgres"),
        "postgres": _spec(f"{_B}.postgres:PostgresDeduplicationStore", "postgres"),
        "redis": _spec(f"{_B}.redis:RedisDeduplicationStore", "redis"),
        "rediss": _spec(f"{_B}.redis:RedisDeduplicationStore", "redis"),
        "dynamodb": _spec(f"{_B}.dynamodb:DynamoDBDeduplicationStore", "dynamodb"),
        "cosmos": _spec(f"{_B}.cosmos:CosmosDeduplicationStore", "cosmos"),
    },
    "entity_store": {
        "memory": _spec(f"{_B}.memory:MemoryEntityStore"),
        "sqlite": _spec(f"{_B}.sqlite:SqliteEntityStore"),
        "postgresql": _spec(f"{_B}.postgres:PostgresEntityStore", "postgres"),
        "postgres": _spec(f"{_B}.postgres:PostgresEntityStore", "postgres"),
        "redis": _spec(f"{_B}.redis:RedisEntityStore", "redis"),
        "rediss": _spec(f"{_B}.redis:RedisEntityStore", "redis"),
        "dynamodb": _spec(f"{_B}.dynamodb:DynamoDBEntityStore", "dynamodb"),
        "cosmos": _spec(f"{_B}.cosmos:CosmosEntityStore", "cosmos"),
    },
    "token_store": {
        "memory": _spec(f"{_B}.memory:MemoryTokenStore"),
        "sqlite": _spec(f"{_B}.sqlite:SqliteTokenStore"),
        "postgresql": _spec(f"{_B}.postgres:PostgresTokenStore", "postgres"),
        "postgres": _spec(f"{_B}.postgres:PostgresTokenStore", "postgres"),
        "redis": _spec(f"{_B}.redis:RedisTokenStore", "redis"),
        "rediss": _spec(f"{_B}.redis:RedisTokenStore", "redis"),
        "dynamodb": _spec(f"{_B}.dynamodb:DynamoDBTokenStore", "dynamodb"),
        "cosmos": _spec(f"{_B}.cosmos:CosmosTokenStore", "cosmos"),
    },
    "dispatcher": {
        "memory": _spec(f"{_B}.memory:MemoryDispatcher"),
        "sqlite": _spec(f"{_B}.sqlite:SqliteDispatcher"),
        "redis": _spec(f"{_B}.redis:RedisDispatcher", "redis"),
        "rediss": _spec(f"{_B}.redis:RedisDispatcher", "redis"),
        "amqp": _spec(f"{_B}.rabbitmq:RabbitMQDispatcher", "rabbitmq"),
        "amqps": _spec(f"{_B}.rabbitmq:RabbitMQDispatcher", "rabbitmq"),
    },
    "broker": {
        "redis": _spec(f"{_B}.redis.consumer:RedisStreamsBroker", "redis"),
        "rediss": _spec(f"{_B}.redis.consumer:RedisStreamsBroker", "redis"),
        "amqp": _spec(f"{_B}.rabbitmq.consumer:RabbitMQBroker", "rabbitmq"),
        "amqps": _spec(f"{_B}.rabbitmq.consumer:RabbitMQBroker", "rabbitmq"),
        "kafka": _spec(f"{_B}.kafka:KafkaBroker", "kafka"),
    },
    "command": {
        "sweep": _spec("dedupstore.spark.cli:SweepCommand", "spark"),
        "demo": _spec("dedupstore.spark.cli:DemoCommand", "spark"),
    },
}

_lock = threading.Lock()
#: kind -> name -> spec: the built-ins, then what register() and entry points add.
_registered: dict[str, dict[str, PluginSpec]] = {k: dict(v) for k, v in _BUILTIN.items()}
#: The kinds whose entry-point group was read.
_loaded: set[str] = set()


def _info(kind: str) -> _KindInfo:
    info = _KINDS.get(kind)
    if info is None:
        raise ValueError(f"unknown kind of plugin {kind!r}; kinds: {', '.join(KINDS)}")
    return info


def entry_point_group(kind: Kind) -> str:
    """The entry-point group of ``kind``: ``dedupstore.<kind>``.

    Raises ``ValueError`` for an unknown kind.
    """
    _info(kind)
    return f"dedupstore.{kind}"


def register(
    kind: Kind,
    name: str,
    target: str,
    *,
    clobber: bool = False,
    requires: tuple[str, ...] = (),
    extra: str | None = None,
) -> None:
    """Register ``target`` (``"module:Class"``) as the ``kind`` plugin ``name``.

    ``name`` is a URL scheme (``"myredis"``) or, for ``command``, the subcommand.
    Nothing is imported now; :func:`resolve` first checks that the modules in
    ``requires`` are installed (else its error says ``pip install 'dedupstore[extra]'``).
    Registering the same target again is a no-op.

    Raises ``ValueError`` for an unknown kind, a name that is not a lower-case name
    such as ``'myredis'``, a ``target`` not of the form ``"module:Class"``, or a name
    already registered to another target while ``clobber`` is false.
    """
    info = _info(kind)
    if not isinstance(name, str) or not name or "://" in name or name != name.lower():
        raise ValueError(
            f"a {info.label} name is a lower-case name such as 'myredis', got {name!r}"
        )
    module, sep, attribute = target.partition(":")
    if not sep or not module or not attribute:
        raise ValueError(f"a {info.label} target is 'package.module:Class', got {target!r}")
    with _lock:
        specs = _registered[kind]
        if name in specs and not clobber and specs[name].target != target:
            raise ValueError(
                f"{info.label} {name!r} is already registered to {specs[name].target}; "
                "pass clobber=True to replace it"
            )
        specs[name] = PluginSpec(target, tuple(requires), extra)


def _load_entry_points(kind: str) -> None:
    with _lock:
        if kind in _loaded:
            return
        _loaded.add(kind)
        specs = _registered[kind]
        for ep in entry_points(group=f"dedupstore.{kind}"):
            specs.setdefault(ep.name, PluginSpec(ep.value))


def known(kind: Kind) -> Mapping[str, PluginSpec]:
    """Read-only view of the ``kind`` plugins' names, entry points included.

    Raises ``ValueError`` for an unknown kind.
    """
    _info(kind)
    _load_entry_points(kind)
    return MappingProxyType(_registered[kind])


def _shown(info: _KindInfo, name: str) -> str:
    return f"{name}://" if info.url else name


def _installed(module: str) -> bool:
    """Whether ``module`` can be imported, found without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


@overload
def resolve(kind: Literal["store"], name: str) -> type[DeduplicationStore]: ...
@overload
def resolve(kind: Literal["entity_store"], name: str) -> type[EntityStore]: ...
@overload
def resolve(kind: Literal["token_store"], name: str) -> type[TokenStore]: ...
@overload
def resolve(kind: Literal["dispatcher"], name: str) -> type[URLDispatcher]: ...
@overload
def resolve(kind: Literal["broker"], name: str) -> type[Broker]: ...
@overload
def resolve(kind: Literal["command"], name: str) -> type[Command]: ...
@overload
def resolve(kind: Kind, name: str) -> type[Any]: ...
def resolve(kind: Kind, name: str) -> type[Any]:
    """Import and return the class registered as the ``kind`` plugin ``name``.

    Raises ``ConfigurationError`` for an unknown name (the message lists the known
    ones), when a module it requires is not installed (the message names the
    ``pip install 'dedupstore[extra]'``), when its target does not import, and when
    the target is not a subclass of the kind's base class
    (:class:`~dedupstore.store.DeduplicationStore`, ...,
    :class:`~dedupstore.cli.Command`). ``ValueError`` for an unknown kind.
    """
    info = _info(kind)
    if name not in _registered[kind]:
        _load_entry_points(kind)
    spec = _registered[kind].get(name)
    what = f"{_shown(info, name)} {info.label}"  # "redis:// store", "sweep command"
    if spec is None:
        names = ", ".join(_shown(info, n) for n in sorted(_registered[kind]))
        if info.url:
            raise ConfigurationError(
                f"unknown {info.label} URL scheme {name!r}; known schemes: {names}"
            )
        raise ConfigurationError(f"unknown {info.label} {name!r}; known {info.label}s: {names}")
    hint = f"pip install 'dedupstore[{spec.extra}]'" if spec.extra else None
    for module in spec.requires:
        if not _installed(module):
            raise ConfigurationError(
                f"the {what} needs the {module} library, which is not installed: "
                f"{hint or f'install {module}'}"
            )
    module_name, _, class_name = spec.target.partition(":")
    try:
        cls: Any = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise ConfigurationError(
            f"cannot load the {what} {spec.target}: {exc}{f' ({hint})' if hint else ''}"
        ) from exc
    base_module, _, base_name = info.base.partition(":")
    base = getattr(importlib.import_module(base_module), base_name)
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ConfigurationError(f"{spec.target} is not a {base_name} subclass")
    return cls


@overload
def open_url(
    kind: Literal["store"], url: str | StoreURL, /, **options: Any
) -> DeduplicationStore: ...
@overload
def open_url(
    kind: Literal["entity_store"], url: str | StoreURL, /, **options: Any
) -> EntityStore: ...
@overload
def open_url(
    kind: Literal["token_store"], url: str | StoreURL, /, **options: Any
) -> TokenStore: ...
@overload
def open_url(
    kind: Literal["dispatcher"], url: str | StoreURL, /, **options: Any
) -> URLDispatcher: ...
@overload
def open_url(kind: Literal["broker"], url: str | StoreURL, /, **options: Any) -> Broker: ...
@overload
def open_url(kind: Kind, url: str | StoreURL, /, **options: Any) -> Any: ...
def open_url(kind: Kind, url: str | StoreURL, /, **options: Any) -> Any:
    """Parse ``url`` once and open it with its scheme's class: ``Cls(url, **options)``.

    Raises what :func:`resolve` and the class's constructor raise; ``ConfigurationError``
    for a malformed URL, ``ValueError`` for a kind whose names are not URL schemes.
    """
    if not _info(kind).url:
        raise ValueError(f"{kind} plugins are not opened by URL")
    parsed = StoreURL.parse(url)
    return resolve(kind, parsed.scheme)(parsed, **options)
