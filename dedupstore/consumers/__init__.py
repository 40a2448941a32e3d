"""Consume loops: read a broker, process exactly once, acknowledge only what is done.

A :class:`Broker` (Redis Streams, RabbitMQ and Kafka built in: :func:`open_broker`; or
a class of your own) hands out each :class:`Delivery`; :class:`MessageRules` turns one
into a :class:`~dedupstore.outbox.Message`; :class:`Consumer` is the loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dedupstore.consumers._base import AsyncBroker, Broker, Delivery, MessageRules
from dedupstore.consumers._loop import MALFORMED_ENTITY, SET_ASIDE_POSITION, Consumer, ConsumeStats
from dedupstore.errors import MalformedDelivery

if TYPE_CHECKING:
    from dedupstore.urls import StoreURL

__all__ = [
    "MALFORMED_ENTITY",
    "SET_ASIDE_POSITION",
    "AsyncBroker",
    "Broker",
    "ConsumeStats",
    "Consumer",
    "Delivery",
    "MalformedDelivery",
    "MessageRules",
    "open_broker",
]


def open_broker(url: str | StoreURL, /, **options: Any) -> Broker:
    """The broker a URL names, opened with ``options`` (``redis://host:6379/0?stream=...``).

    Schemes are the registry's ``broker`` plugins (:mod:`dedupstore.registry`; built in:
    ``redis``, ``rediss``, ``amqp``, ``amqps``, ``kafka``; others through
    ``dedupstore.register("broker", ...)`` or the ``dedupstore.broker`` entry-point
    group). Raises ``ConfigurationError`` for an unknown scheme, a bad URL or option
    (before any I/O), and what the broker's constructor raises (``StoreUnavailable``
    when it cannot be reached).
    """
    from dedupstore.registry import open_url

    return open_url("broker", url, **options)
