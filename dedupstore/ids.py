"""The id rules shared by message ids, entity ids and endpoint names."""

from __future__ import annotations

import functools
import hashlib
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from dedupstore.errors import ConfigurationError, InvalidMessageId

__all__ = [
    "MAX_ID_BYTES",
    "OUTGOING_NAMESPACE",
    "message_key",
    "outgoing_id",
    "validate_ids",
    "validate_message_id",
    "validate_name",
]

#: The largest message id, in UTF-8 bytes, that every backend accepts.
MAX_ID_BYTES = 1024


def validate_message_id(message_id: object, what: str = "message id") -> str:
    """Return ``message_id`` as a plain ``str``, or raise
    :class:`~dedupstore.errors.InvalidMessageId`.

    A valid id is a non-empty ``str`` of at most 1024 UTF-8 bytes, with no NUL
    character and no lone surrogate.
    """
    if type(message_id) is not str:
        if not isinstance(message_id, str):
            raise InvalidMessageId(
                f"the {what} must be a str, got {type(message_id).__name__} {message_id!r:.80}"
            )
        message_id = str.__str__(message_id)
    if not message_id:
        raise InvalidMessageId(f"the {what} must not be empty")
    if "\x00" in message_id:
        raise InvalidMessageId(f"{what} {message_id!r:.80} contains a NUL character")
    if len(message_id) * 4 > MAX_ID_BYTES or not message_id.isascii():
        try:
            size = len(message_id.encode("utf-8"))
        except UnicodeEncodeError as exc:
            raise InvalidMessageId(
                f"{what} {message_id!r:.80} contains a lone surrogate at position "
                f"{exc.start}; ids must be valid Unicode text"
            ) from None
        if size > MAX_ID_BYTES:
            raise InvalidMessageId(
                f"{what} {message_id[:40]!r}... is {size} bytes in UTF-8; "
                f"the limit is {MAX_ID_BYTES}"
            )
    return message_id


def plain_ids(items: Sequence[object]) -> bool:
    """Whether every item is a valid id that is a plain ``str`` of ASCII characters
    (``False`` says nothing: check each with :func:`validate_message_id`)."""
    if not items:
        return True
    try:
        joined = "\x01".join(items)  # type: ignore[arg-type]
    except TypeError:
        return False
    if not joined.isascii() or "\x00" in joined or set(map(type, items)) != {str}:
        return False
    sizes = list(map(len, items))  # type: ignore[arg-type]
    return min(sizes) > 0 and max(sizes) <= MAX_ID_BYTES


def validate_ids(ids: Iterable[object], what: str = "message id") -> list[str]:
    """Validate a batch; a fast path for the common all-plain-ASCII case, same rules."""
    items = list(ids)
    if plain_ids(items):
        return items  # type: ignore[return-value]
    return [validate_message_id(m, what) for m in items]


def validate_name(value: object, what: str) -> str:
    """Return ``value``, a name given as configuration (``what`` says which), or raise
    :class:`~dedupstore.errors.ConfigurationError`; same rules as ids."""
    try:
        return validate_message_id(value, what)
    except InvalidMessageId as exc:
        raise ConfigurationError(f"invalid {what}: {exc}") from None


# ---------------------------------------------------------------------- message identity
# A message is (consumer, entity, message id): producers often make ids unique only per
# entity, and two consumers of one event are two processings.

#: Namespace of the UUIDv5 outgoing message ids (:func:`outgoing_id`).
OUTGOING_NAMESPACE = uuid.UUID("6f1e6a52-4d0b-5c55-9a57-2a7d1c0b9e41")

_KEY_HASH_PREFIX = "#"


def message_key(correlation_id: str, message_id: str) -> str:
    """The id under which a processed message is recorded in the deduplication store.

    ``"<n>:<correlation id>:<message id>"``, ``n`` being the correlation id's length
    in characters, so the key is unambiguous and readable (``"5:alice:txn-1"``).
    When that is longer than :data:`MAX_ID_BYTES` in UTF-8, the key is ``"#"`` and
    the SHA-256 (hex) of that text instead: a key never starts with ``"#"``
    otherwise. Both arguments must be valid ids (not checked here: callers validate
    once, before any I/O). The deduplication store adds the consumer (its endpoint).
    """
    key = f"{len(correlation_id)}:{correlation_id}:{message_id}"
    if len(key) * 4 > MAX_ID_BYTES and len(key.encode("utf-8")) > MAX_ID_BYTES:
        return _KEY_HASH_PREFIX + hashlib.sha256(key.encode("utf-8")).hexdigest()
    return key


def outgoing_id(consumer: str, correlation_id: str, message_id: str, position: int) -> str:
    """The id of the ``position``-th outgoing message of one processing (UUIDv5 text).

    Derived from the consumer (the deduplication store's endpoint), the entity
    (correlation id), the incoming message id and the position, joined by NUL
    (which no id contains), so a re-run gives the same id and no two processings
    (another consumer, another entity, another message) share one. The text is
    ``str(uuid.uuid5(OUTGOING_NAMESPACE, name))``, computed without building a UUID.
    """
    digest = _consumer_hash(consumer).copy()  # the namespace and consumer, hashed once
    digest.update(f"{correlation_id}\x00{message_id}\x00{position}".encode())
    h = digest.hexdigest()
    # the UUID's version nibble is 5 and its variant bits 10: digits 12 and 16 change
    return f"{h[:8]}-{h[8:12]}-5{h[13:16]}-{_VARIANT[h[16]]}{h[17:20]}-{h[20:32]}"


_NAMESPACE_BYTES = OUTGOING_NAMESPACE.bytes


@functools.lru_cache(maxsize=256)
def _consumer_hash(consumer: str) -> Any:
    """SHA-1 fed with the namespace and ``consumer\\0``: what every outgoing id of
    ``consumer`` starts with (copied, never updated in place)."""
    return hashlib.sha1(_NAMESPACE_BYTES + consumer.encode() + b"\x00")


#: The hex digit of a digest's byte 8 high nibble -> that of ``(byte & 0x3F) | 0x80``.
_VARIANT = {digit: "89ab"[int(digit, 16) & 3] for digit in "0123456789abcdef"}
