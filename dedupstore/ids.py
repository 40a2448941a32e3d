"""The id rules shared by message ids, entity ids and endpoint names."""

from __future__ import annotations

from collections.abc import Iterable

from dedupstore.errors import ConfigurationError, InvalidMessageId

__all__ = ["MAX_ID_BYTES", "validate_endpoint", "validate_ids", "validate_message_id"]

#: The largest message id, in UTF-8 bytes, that every backend accepts.
MAX_ID_BYTES = 1024


def validate_message_id(message_id: object, what: str = "message id") -> str:
    """Return ``message_id`` as a plain ``str`` or raise :class:`InvalidMessageId`.

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


def validate_ids(ids: Iterable[object], what: str = "message id") -> list[str]:
    """Validate a batch; a fast path for the common all-plain-ASCII case, same rules."""
    items = list(ids)
    try:
        joined = "\x01".join(items)  # type: ignore[arg-type]
    except TypeError:
        joined = None
    if (
        joined is not None
        and joined.isascii()
        and "\x00" not in joined
        and all(type(m) is str and 0 < len(m) <= MAX_ID_BYTES for m in items)
    ):
        return items  # type: ignore[return-value]
    return [validate_message_id(m, what) for m in items]


def validate_endpoint(endpoint: object) -> str:
    """Return ``endpoint`` or raise :class:`ConfigurationError`; same rules as ids."""
    try:
        return validate_message_id(endpoint, "name")
    except InvalidMessageId as exc:
        raise ConfigurationError(f"invalid endpoint: {exc}") from None
