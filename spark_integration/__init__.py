"""dedupstore on Spark: the improving outbox as PySpark jobs.

* :func:`process_messages` processes a DataFrame of messages exactly once, one
  entity's messages in one task, in order; :func:`process_stream` does the same
  for Structured Streaming through ``foreachBatch``; :func:`run_messages` runs it
  now, once, into an exact record of what the run did (read it many times).
* :func:`sweep_outboxes` moves dispatched ids from the entities' outboxes into
  the deduplication store, one task per segment.
* :func:`drop_processed` removes rows whose (correlation id, id) is already recorded.
* :func:`mint_tokens` mints the tokens of a DataFrame's messages at the boundary
  (token mode: see the Token mode page).

Everything is built on DataFrame APIs, so it runs on a classic session, on a
cluster and on Spark Connect alike. Clients are opened in each task from URLs
(checked on the driver without I/O); nothing live is pickled.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .pipeline import (
        MINT_SCHEMA,
        PROCESS_SCHEMA,
        RECORD_SCHEMA,
        SWEEP_SCHEMA,
        drop_processed,
        mint_tokens,
        process_messages,
        process_stream,
        run_messages,
        sweep_outboxes,
    )
    from .session import local_session, use_this_python

__all__ = [
    "MINT_SCHEMA",
    "PROCESS_SCHEMA",
    "RECORD_SCHEMA",
    "SWEEP_SCHEMA",
    "drop_processed",
    "local_session",
    "mint_tokens",
    "process_messages",
    "process_stream",
    "run_messages",
    "sweep_outboxes",
    "use_this_python",
]

#: Public name -> the module that defines it, imported on first use: importing this
#: package imports no pyspark (the ``dedupstore`` command lists ``sweep`` and ``demo``
#: from :mod:`dedupstore.spark.cli` without Spark).
_HOME = {
    name: "session" if name in ("local_session", "use_this_python") else "pipeline"
    for name in __all__
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
