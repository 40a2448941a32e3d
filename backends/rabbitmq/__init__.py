"""``amqp://`` and ``amqps://``: RabbitMQ (pika).

* :mod:`.rabbitmq._client` -- what the dispatcher and the broker share: URL, connection options,
  connecting and aborting within the call's deadline, pika's errors.
* :mod:`.rabbitmq.dispatcher` -- :class:`RabbitMQDispatcher`: persistent, ``mandatory`` messages on
  one exchange, each confirmed by the broker (publisher confirms) before ``dispatch`` returns.
* :mod:`.rabbitmq.consumer` -- :class:`RabbitMQBroker`, the consume loop's broker: manual
  acknowledgements under a prefetch window, redelivery by the broker after a consumer died,
  delivery counts from quorum queues. Imported on first use (``open_broker('amqp://...?queue=')``).
"""

from .dispatcher import RabbitMQDispatcher

__all__ = ["RabbitMQDispatcher"]
