"""dedupstore on Spark: the improving outbox as PySpark jobs.

* :func:`process_messages` processes a DataFrame of messages exactly once, one
  entity's messages in one task, in order; :func:`process_stream` does the same
  for Structured Streaming through ``foreachBatch``; :func:`run_messages` runs it
  now, once, into an exact record of what the run did (read it many times).
* :func:`sweep_outboxes` moves dispatched ids from the entities' outboxes into
  the deduplication store, one task per segment.
* :func:`drop_processed` removes rows whose (correlation id, id) is already recorded.

Everything is built on DataFrame APIs, so it runs on a classic session, on a
cluster and on Spark Connect alike. Clients are opened in each task from URLs
(checked on the driver without I/O); nothing live is pickled.
"""

from .pipeline import (
    PROCESS_SCHEMA,
    RECORD_SCHEMA,
    SWEEP_SCHEMA,
    drop_processed,
    process_messages,
    process_stream,
    run_messages,
    sweep_outboxes,
)
from .session import local_session, use_this_python

__all__ = [
    "PROCESS_SCHEMA",
    "RECORD_SCHEMA",
    "SWEEP_SCHEMA",
    "drop_processed",
    "local_session",
    "process_messages",
    "process_stream",
    "run_messages",
    "sweep_outboxes",
    "use_this_python",
]
