"""Consume loops: read a broker, process exactly once, acknowledge only what is done.

* :class:`Broker` -- the small interface a broker implements (fetch, ack, nack,
  reclaim, pending); :class:`Delivery` -- one delivery it hands out.
* :class:`MessageRules` -- how a delivery becomes a :class:`~dedupstore.outbox.Message`.
* :class:`Consumer` -- the loop: :meth:`Consumer.run_once`, :meth:`Consumer.run`
  (until :meth:`Consumer.stop`, SIGTERM or SIGINT), :class:`ConsumeStats`.

Brokers: :class:`dedupstore.consumers.redis_streams.RedisStreamsBroker` (Redis Streams
consumer groups), or a class of your own.
"""

from __future__ import annotations

from dedupstore.consumers._base import Broker, Delivery, MessageRules
from dedupstore.consumers._loop import (
    MALFORMED_ENTITY,
    SET_ASIDE_POSITION,
    Consumer,
    ConsumeStats,
)
from dedupstore.errors import MalformedDelivery

__all__ = [
    "MALFORMED_ENTITY",
    "SET_ASIDE_POSITION",
    "Broker",
    "ConsumeStats",
    "Consumer",
    "Delivery",
    "MalformedDelivery",
    "MessageRules",
]
