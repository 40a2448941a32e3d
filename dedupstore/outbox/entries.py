"""An entity's outbox entries as the processor and the sweep change them (marked
dispatched, removed), their dispatch (a failure counted and logged), and the errors
that name a message or an entity.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence

from dedupstore import metrics
from dedupstore.entities import Entity, OutgoingMessage
from dedupstore.errors import ConfigurationError, EntityTooLarge, format_error
from dedupstore.outbox.messages import Dispatcher, Message
from dedupstore.outbox.tokened import retired
from dedupstore.steps import Steps, io

#: Every module of the outbox logs as ``dedupstore.outbox`` (imports this one).
_log = logging.getLogger("dedupstore.outbox")


def _dispatched(entity: Entity, mid: str) -> None:
    """Mark the entry of ``mid`` dispatched (it keeps no mark; its tokens keep what the
    clean-up deletes)."""
    if entity.tokens:
        kept = retired(entity, mid)
        if kept is not None:
            entity.tokens[mid] = kept
    entity.outbox[mid] = None
    entity.marks.pop(mid, None)


def _remove(entity: Entity, mid: str) -> None:
    """Remove the entry of ``mid`` (and its mark) from the outbox.

    An outbox or marks left empty is replaced by a new ``{}``: a dict that once held
    containers stays tracked by the cyclic garbage collector, which then walks it in
    every collection while the entity is kept; a new empty one is not tracked.
    """
    outbox, marks = entity.outbox, entity.marks
    outbox.pop(mid, None)
    if not outbox:
        entity.outbox = {}
    if entity.tokens:
        entity.tokens.pop(mid, None)
        if not entity.tokens:
            entity.tokens = {}
    if marks:
        marks.pop(mid, None)
        if not marks:
            entity.marks = {}


def _send(
    dispatcher: Dispatcher, messages: Sequence[OutgoingMessage], consumer: str
) -> Steps[None]:
    """``dispatcher.dispatch(messages)``; a failure is counted and logged, then raised."""
    try:
        yield from io(dispatcher.dispatch, messages)
    except Exception as exc:
        metrics.count_dispatch_failure(consumer, exc)
        _log.warning(
            "consumer %s: dispatching %d outgoing message(s) failed (they stay in the outbox "
            "and are dispatched again on redelivery or by a sweep with redispatch): %s: %s",
            consumer,
            len(messages),
            type(exc).__name__,
            format_error(exc),
        )
        raise


def _retrying(consumer: str, entity_ids: Collection[str]) -> None:
    """Count and log the processor's concurrency conflicts about to be retried."""
    if entity_ids:
        metrics.count_conflicts(consumer, "processor", len(entity_ids))
        _log.debug(
            "consumer %s: concurrency conflict on %d entity(ies) (%s); retrying",
            consumer,
            len(entity_ids),
            ", ".join(sorted(repr(e)[:80] for e in entity_ids)[:5]),
        )


def _foreign(entity: Entity, consumer: str) -> ConfigurationError:
    """An entity recorded for another consumer than ``consumer``, refused."""
    return ConfigurationError(
        f"entity {entity.id!r:.80} belongs to consumer {entity.consumer!r:.80}, not "
        f"{consumer!r:.80} (the deduplication store's endpoint); nothing was written. Each "
        "consumer has its own endpoint and entity store: open the deduplication store with "
        f"endpoint={entity.consumer!r:.80}, or give this consumer its own entity store"
    )


def _too_large(message: Message, exc: EntityTooLarge, set_aside: bool = False) -> EntityTooLarge:
    """``message`` does not fit in its entity: its new state and outgoing messages, or
    (``set_aside``) even its bounded dead letter beside the entity's state."""
    why = (
        " cannot be set aside: even its bounded dead letter does not fit beside the entity's "
        f"state ({exc})"
        if set_aside
        else ": its new state and outgoing messages do not fit in one entity record "
        f"({exc}); nothing of it was saved. Make the state or the outgoing messages smaller."
    )
    return EntityTooLarge(
        f"message {message.id!r:.80} of entity {message.correlation_id!r:.80}{why}",
        message_id=message.id,
        correlation_id=message.correlation_id,
    )
