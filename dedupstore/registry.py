"""URL scheme -> backend class, as import strings resolved lazily.

Importing :mod:`dedupstore` imports no backend and no client library: a backend
module is imported the first time a store with its scheme is opened. Third-party
backends register with :func:`register_backend` or through the entry-point group
``dedupstore.backends`` (name: the scheme, value: ``"package.module:Class"``).
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass
from importlib.metadata import entry_points
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from dedupstore.errors import ConfigurationError
from dedupstore.urls import split_url

if TYPE_CHECKING:
    from collections.abc import Mapping

    from dedupstore.store import DeduplicationStore

__all__ = ["ENTRY_POINT_GROUP", "BackendSpec", "backend_class", "known_backends", "open_url"]

ENTRY_POINT_GROUP = "dedupstore.backends"


@dataclass(frozen=True)
class BackendSpec:
    """Where a scheme's backend lives and what it needs.

    ``target`` is ``"module:Class"``; ``requires`` are the client modules imported
    before the backend; ``extra`` is the ``pip install 'dedupstore[extra]'`` that
    provides them.
    """

    target: str
    requires: tuple[str, ...] = ()
    extra: str | None = None


_BUILTIN: dict[str, BackendSpec] = {
    "memory": BackendSpec("backends.memory:MemoryDeduplicationStore"),
    "sqlite": BackendSpec("backends.sqlite:SqliteDeduplicationStore"),
    "postgresql": BackendSpec(
        "backends.postgres:PostgresDeduplicationStore", ("psycopg", "psycopg_pool"), "postgres"
    ),
    "postgres": BackendSpec(
        "backends.postgres:PostgresDeduplicationStore", ("psycopg", "psycopg_pool"), "postgres"
    ),
    "redis": BackendSpec("backends.redis:RedisDeduplicationStore", ("redis",), "redis"),
    "rediss": BackendSpec("backends.redis:RedisDeduplicationStore", ("redis",), "redis"),
    "dynamodb": BackendSpec("backends.dynamodb:DynamoDBDeduplicationStore", ("boto3",), "dynamodb"),
    "cosmos": BackendSpec("backends.cosmos:CosmosDeduplicationStore", ("azure.cosmos",), "cosmos"),
}

_registry: dict[str, BackendSpec] = dict(_BUILTIN)
_lock = threading.Lock()
_entry_points_loaded = False

#: Read-only view of the registered schemes.
known_backends: Mapping[str, BackendSpec] = MappingProxyType(_registry)


def register_backend(
    scheme: str,
    target: str,
    *,
    clobber: bool = False,
    requires: tuple[str, ...] = (),
    extra: str | None = None,
) -> None:
    """Register ``target`` (``"module:Class"``) for URLs of ``scheme``.

    Nothing is imported now. Raises ``ValueError`` if ``scheme`` is taken and
    ``clobber`` is false, or if ``target`` is not of the form ``"module:Class"``.
    """
    if not isinstance(scheme, str) or not scheme or "://" in scheme or scheme != scheme.lower():
        raise ValueError(f"a scheme is a lower-case name such as 'myredis', got {scheme!r}")
    module, sep, name = target.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"a backend target is 'package.module:Class', got {target!r}")
    with _lock:
        if scheme in _registry and not clobber and _registry[scheme].target != target:
            raise ValueError(
                f"scheme {scheme!r} is already registered to {_registry[scheme].target}; "
                "pass clobber=True to replace it"
            )
        _registry[scheme] = BackendSpec(target, tuple(requires), extra)


def _load_entry_points() -> None:
    global _entry_points_loaded
    with _lock:
        if _entry_points_loaded:
            return
        _entry_points_loaded = True
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            _registry.setdefault(ep.name, BackendSpec(ep.value))


def backend_class(scheme: str) -> type[DeduplicationStore]:
    """Import and return the class registered for ``scheme``.

    Raises ``ConfigurationError`` for an unknown scheme, or when the backend's
    client library is missing (the message names the extra to install).
    """
    from dedupstore.store import DeduplicationStore

    if scheme not in _registry:
        _load_entry_points()
    spec = _registry.get(scheme)
    if spec is None:
        known = ", ".join(f"{s}://" for s in sorted(_registry))
        raise ConfigurationError(f"unknown store URL scheme {scheme!r}; known schemes: {known}")
    for module in spec.requires:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            hint = f"pip install 'dedupstore[{spec.extra}]'" if spec.extra else f"install {module}"
            raise ConfigurationError(
                f"the {scheme}:// backend needs the {module} client library, which is not "
                f"installed: {hint}"
            ) from exc
    module_name, _, class_name = spec.target.partition(":")
    try:
        cls: Any = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        hint = f" (pip install 'dedupstore[{spec.extra}]')" if spec.extra else ""
        raise ConfigurationError(
            f"cannot load the {scheme}:// backend {spec.target}: {exc}{hint}"
        ) from exc
    if not (isinstance(cls, type) and issubclass(cls, DeduplicationStore)):
        raise ConfigurationError(f"{spec.target} is not a DeduplicationStore subclass")
    return cls


def open_url(url: str, **options: Any) -> DeduplicationStore:
    """Open the store for ``url``; see :func:`dedupstore.open_store`."""
    parts = split_url(url)
    return backend_class(parts.scheme).from_url(url, **options)
