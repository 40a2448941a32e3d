"""``amqp://`` and ``amqps://``: RabbitMQ (pika).

* :mod:`.rabbitmq._client` -- what the dispatcher and the consumer broker
  share: the URL (``amqp[s]://[user[:password]@]host[:port][/vhost]``), the
  connection options, connecting within the call's deadline, aborting a connection
  when the deadline passes, and the classification of pika's errors.
* :mod:`.rabbitmq.dispatcher` -- :class:`RabbitMQDispatcher`: persistent,
  ``mandatory`` messages on one exchange, each confirmed by the broker (publisher
  confirms) before :meth:`~RabbitMQDispatcher.dispatch` returns.
* :mod:`.rabbitmq.consumer` -- :class:`RabbitMQBroker`, the consume loop's
  broker (:mod:`dedupstore.consumers`): manual acknowledgements under a prefetch
  window, redelivery by the broker after a consumer died, delivery counts from
  quorum queues. Imported on first use (``open_broker('amqp://...?queue=...')``).
"""

from .dispatcher import RabbitMQDispatcher

__all__ = ["RabbitMQDispatcher"]
