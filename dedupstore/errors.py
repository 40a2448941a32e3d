"""The error hierarchy of dedupstore.

Every error the library raises on purpose is a :class:`DedupStoreError`. Driver
errors are translated at the backend boundary and chained (``raise ... from exc``).
"""

from __future__ import annotations

__all__ = [
    "ConcurrencyConflict",
    "ConfigurationError",
    "ConsistencyError",
    "DedupStoreError",
    "InvalidMessageId",
    "StoreUnavailable",
]


class DedupStoreError(Exception):
    """Base class of every error raised by dedupstore."""


class ConfigurationError(DedupStoreError):
    """The store cannot be opened as configured.

    Unknown URL scheme, malformed URL, unknown option, missing client library (the
    message names the ``pip install 'dedupstore[extra]'`` to run), missing
    environment or unset ``${VAR}`` in the configuration file, missing table.
    """


class ConsistencyError(DedupStoreError):
    """The store is not strongly consistent enough for exactly-once processing.

    Raised at open time, for example by a Cosmos DB account whose default
    consistency is weaker than Strong.
    """


class InvalidMessageId(DedupStoreError, ValueError):
    """A message id breaks the id rules; raised before any I/O.

    Valid ids are non-empty ``str`` of at most 1024 UTF-8 bytes with no NUL
    character and no lone surrogate.
    """


class StoreUnavailable(DedupStoreError):
    """The store could not answer; the operation may be retried.

    The driver's exception is chained as ``__cause__``. A store never answers
    "not processed" when it cannot reach its data: it raises this instead.
    """


class ConcurrencyConflict(DedupStoreError):
    """Somebody else saved the entity since it was loaded: reload and retry."""
