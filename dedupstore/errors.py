"""The error hierarchy of dedupstore, and the one-line formatter every caller uses.

Every error the library raises on purpose is a :class:`DedupStoreError`. Driver
errors are classified once per backend (``_classify_error``) and chained
(``raise ... from exc``); nothing leaves the library as a bare driver error.

=======================  =====================================  =============
error                    meaning                                CLI exit code
=======================  =====================================  =============
``ConfigurationError``   fix the configuration or the input     2
``InvalidMessageId``     fix the input (a ``ValueError``)       2
``InvalidValue``         fix the input (a ``TypeError``)        2
``EntityTooLarge``       too large for one entity record        2
``MessageTooLarge``      too large for the dispatcher           2
``MalformedDelivery``    a broker delivery is not a message     2
``TokenPresent``         a token to mint again still exists     2
``ConsistencyError``     the store is too weak to be safe       2
``StoreClosed``          the object was closed; open a new one  2
``StoreUnavailable``     the store could not answer; retry      3
``ConcurrencyConflict``  someone saved the entity first; retry  3
=======================  =====================================  =============
"""

from __future__ import annotations

from collections.abc import Iterable

from dedupstore.masking import mask_text

__all__ = [
    "ConcurrencyConflict",
    "ConfigurationError",
    "ConsistencyError",
    "DeadLetterIncomplete",
    "DedupStoreError",
    "EntityTooLarge",
    "HandlerError",
    "InvalidMessageId",
    "InvalidValue",
    "MalformedDelivery",
    "MessageTooLarge",
    "StoreClosed",
    "StoreUnavailable",
    "TokenPresent",
    "format_error",
]


class DedupStoreError(Exception):
    """Base class of every error raised by dedupstore.

    A batch call (``add_many``) that fails part-way says what it completed:
    ``recorded`` holds the ids this call recorded in chunks that completed (the
    caller may act on them: nobody else will ever be told they are new), and
    ``unknown`` the ids of chunks in flight when it failed (recorded or not; a
    retry of them on the same store object reports those it recorded as
    recorded). Every other id of the call was not written by it.
    """

    recorded: frozenset[str] = frozenset()
    unknown: frozenset[str] = frozenset()

    def with_progress(self, recorded: Iterable[str], unknown: Iterable[str]) -> DedupStoreError:
        """Attach what a batch call completed before this error; return ``self``."""
        self.recorded = frozenset(recorded)
        self.unknown = frozenset(unknown)
        return self


class ConfigurationError(DedupStoreError):
    """The store cannot be used as configured: fix the configuration, do not retry.

    Unknown URL scheme, malformed URL, unknown option or bad option value, missing
    client library (the message names the ``pip install 'dedupstore[extra]'`` to
    run), missing environment or unset ``${VAR}``, refused credentials or
    permissions, a missing table or one of another shape.
    """


class ConsistencyError(DedupStoreError):
    """The store is not strongly consistent enough for exactly-once processing.

    Raised at open time, for example by a Cosmos DB account whose default
    consistency is weaker than Strong.
    """


class InvalidMessageId(DedupStoreError, ValueError):
    """A message or entity id breaks the id rules; raised before any I/O.

    Valid ids are non-empty ``str`` of at most 1024 UTF-8 bytes with no NUL
    character and no lone surrogate.
    """


class InvalidValue(DedupStoreError, TypeError, ValueError):
    """A state, body or headers value that cannot be stored as given; nothing was written.

    A dict key that is not ``str`` at any depth (a reload would not give it back),
    headers that are not a mapping of ``str`` to ``str``, a dataclass or a pydantic
    model (the text says what to pass instead) or another type JSON has no form for.
    The text starts with the value's path, such as ``sends[0].body["a"][0][3]``.
    """


class MalformedDelivery(DedupStoreError, ValueError):
    """A broker delivery cannot become a message: an id, correlation id or body is
    missing or bad (the text names the delivery's broker token and what is wrong).

    A consumer sets such a delivery aside (a dead letter) instead of retrying it.
    """

    def __init__(self, text: str, *, token: object = None, reason: str = "") -> None:
        super().__init__(text)
        #: The delivery's broker token.
        self.token = token
        #: What is wrong, without the token (the same for every copy of the delivery).
        self.reason = reason or text


class EntityTooLarge(DedupStoreError, ValueError):
    """An entity is larger than its store can hold in one record; nothing was written.

    Raised by the processor for one incoming message (its new state and outbox entry
    do not fit), named by :attr:`message_id` and :attr:`correlation_id` (``None`` when
    raised by an entity store's ``save``).
    """

    def __init__(
        self, text: str, *, message_id: str | None = None, correlation_id: str | None = None
    ) -> None:
        super().__init__(text)
        #: The incoming message that does not fit (``None``: raised by a store).
        self.message_id = message_id
        #: Its entity (correlation id).
        self.correlation_id = correlation_id


class MessageTooLarge(DedupStoreError, ValueError):
    """A message is larger than its dispatcher (or destination) accepts; nothing was sent.

    Raised before any I/O by a dispatcher (:attr:`outgoing_id` names the refused
    message; none of the batch is sent) and by the processor for the incoming message
    whose outgoing message or dead letter would be refused (:attr:`message_id`,
    :attr:`correlation_id`; nothing of it was saved). :attr:`size` (bytes, of the
    headers for a header bound) exceeds :attr:`bound`.
    """

    def __init__(
        self,
        text: str,
        *,
        outgoing_id: str | None = None,
        size: int = 0,
        bound: int = 0,
        message_id: str | None = None,
        correlation_id: str | None = None,
    ) -> None:
        super().__init__(text)
        #: The outgoing message refused (a dead letter's id for a letter).
        self.outgoing_id = outgoing_id
        #: Its size and the bound, in bytes.
        self.size = size
        self.bound = bound
        #: The incoming message (``None``: raised by a dispatcher).
        self.message_id = message_id
        #: Its entity (correlation id).
        self.correlation_id = correlation_id


class DeadLetterIncomplete(DedupStoreError, ValueError):
    """A bounded dead letter cannot be redriven: it does not hold the original message.

    A dead letter too large to be written whole carries its message's body (or
    headers) as their size and SHA-256 digest only; :attr:`letter_id`,
    :attr:`message_id` and :attr:`correlation_id` name it. Process the original again
    from its source, or drop the letter.
    """

    def __init__(self, text: str, *, letter_id: str, message_id: str, correlation_id: str):
        super().__init__(text)
        self.letter_id = letter_id
        self.message_id = message_id
        self.correlation_id = correlation_id


class TokenPresent(DedupStoreError, ValueError):
    """A token asked to be minted again still exists: its message was never consumed
    (or is being processed), so minting it "again" would be a mistake; nothing was
    written. ``message_ids`` names the messages, ``token_ids`` their tokens.
    """

    def __init__(self, text: str, *, message_ids: Iterable[str], token_ids: Iterable[str]):
        super().__init__(text)
        self.message_ids = tuple(message_ids)
        self.token_ids = tuple(token_ids)


class StoreUnavailable(DedupStoreError):
    """The store could not answer (connection, timeout, throttling, failover): retry.

    The driver's exception is chained as ``__cause__``. A store never answers
    "not processed" when it cannot reach its data: it raises this instead.
    """


class StoreClosed(DedupStoreError):
    """The store object was used after ``close()``; open a new one."""


class ConcurrencyConflict(DedupStoreError):
    """Somebody else saved the entity since it was loaded: reload and retry."""


class HandlerError(DedupStoreError):
    """A handler raised, or returned something else than ``(dict, sends)``, on a message.

    The text names the message id and the entity; the handler's own exception is
    ``__cause__`` (and :attr:`error`). Nothing of the message was saved. Retrying
    does not help (a handler is deterministic): fix the handler, or set
    ``dead_letters`` on the processor to set such messages aside.
    """

    def __init__(
        self, text: str, *, message_id: str, correlation_id: str, error: BaseException | None
    ) -> None:
        super().__init__(text)
        self.message_id = message_id
        self.correlation_id = correlation_id
        self.error = error


def format_error(exc: BaseException) -> str:
    """The error as one line (whitespace folded, secrets in URLs masked)."""
    text = " ".join(str(exc).split())
    return mask_text(text) if text else type(exc).__name__
