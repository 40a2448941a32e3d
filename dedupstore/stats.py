"""How far behind the outbox is: :func:`outbox_backlog` and :class:`Backlog`.

One scan of :meth:`~dedupstore.entities.EntityStore.pending_outboxes` (the entities
whose outbox is not empty) counts, exactly, what awaits dispatch and what awaits the
sweep, and finds the oldest entry still awaiting dispatch. The deduplication side is
:meth:`dedupstore.store.DeduplicationStore.count`. ``dedupstore stats`` prints both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from typing import Any

from dedupstore.entities import Entity, EntityStore

__all__ = ["PROGRESS_EVERY", "Backlog", "outbox_backlog"]

#: ``progress`` is called after this many entities (and at the end of each segment).
PROGRESS_EVERY = 1000


@dataclass(frozen=True)
class Backlog:
    """The outbox backlog of an entity store (or of some of its segments).

    * ``entities_scanned``: entities the scan returned (those whose outbox is not empty);
    * ``entities_pending``: entities with at least one entry awaiting dispatch;
    * ``messages_pending``: entries awaiting dispatch (incoming messages whose
      outgoing messages were not all dispatched yet);
    * ``outgoing_pending``: outgoing messages in those entries;
    * ``ids_awaiting_sweep``: dispatched entries (``None``) whose ids await the move to
      the deduplication store (``sweep``, or the deferred clean-up's limit);
    * ``oldest_pending_at``: when the oldest entry awaiting dispatch was written (UTC,
      millisecond precision, by the clock of the process that wrote it), or ``None``
      when none is pending (entries written before marks existed carry no time);
    * ``consumers``: the consumers recorded on the entities scanned (those that wrote
      them: see :attr:`~dedupstore.entities.Entity.consumer`), an entity that records
      none adding nothing;
    * ``entities_tokened``: entities scanned whose entries keep token data (written in
      token mode: sweeping them needs the token store).
    """

    entities_scanned: int = 0
    entities_pending: int = 0
    messages_pending: int = 0
    outgoing_pending: int = 0
    ids_awaiting_sweep: int = 0
    oldest_pending_at: datetime | None = None
    consumers: frozenset[str] = frozenset()
    entities_tokened: int = 0

    def merged(self, other: Backlog) -> Backlog:
        """The backlog of both parts (counts added, the older oldest entry): for segments
        scanned separately, e.g. in parallel."""
        times = [t for t in (self.oldest_pending_at, other.oldest_pending_at) if t is not None]
        return Backlog(
            entities_scanned=self.entities_scanned + other.entities_scanned,
            entities_pending=self.entities_pending + other.entities_pending,
            messages_pending=self.messages_pending + other.messages_pending,
            outgoing_pending=self.outgoing_pending + other.outgoing_pending,
            ids_awaiting_sweep=self.ids_awaiting_sweep + other.ids_awaiting_sweep,
            oldest_pending_at=min(times, default=None),
            consumers=self.consumers | other.consumers,
            entities_tokened=self.entities_tokened + other.entities_tokened,
        )

    def to_json(self) -> dict[str, Any]:
        """The fields as a JSON-compatible dict (``oldest_pending_at`` in ISO 8601, to the
        ms; ``consumers`` sorted)."""
        oldest = self.oldest_pending_at
        return {
            **{field.name: getattr(self, field.name) for field in fields(self)},
            "oldest_pending_at": (
                None if oldest is None else oldest.isoformat(timespec="milliseconds")
            ),
            "consumers": sorted(self.consumers),
        }


class _Tally:
    """Running totals of one scan."""

    def __init__(self) -> None:
        self.scanned = self.entities = self.messages = self.outgoing = self.swept = 0
        self.tokened = 0
        self.oldest: int | None = None
        self.consumers: set[str] = set()

    def add(self, entity: Entity) -> None:
        self.scanned += 1
        if entity.tokens:
            self.tokened += 1
        if entity.consumer is not None:
            self.consumers.add(entity.consumer)
        pending = entity.pending
        if pending:
            self.entities += 1
            self.messages += len(pending)
            self.outgoing += sum(len(entity.outbox[mid] or ()) for mid in pending)
            since = entity.pending_since()
            if since is not None and (self.oldest is None or since < self.oldest):
                self.oldest = since
        self.swept += len(entity.outbox) - len(pending)

    def backlog(self) -> Backlog:
        return Backlog(
            entities_scanned=self.scanned,
            entities_pending=self.entities,
            messages_pending=self.messages,
            outgoing_pending=self.outgoing,
            ids_awaiting_sweep=self.swept,
            oldest_pending_at=(
                None if self.oldest is None else datetime.fromtimestamp(self.oldest / 1000, UTC)
            ),
            consumers=frozenset(self.consumers),
            entities_tokened=self.tokened,
        )


def outbox_backlog(
    entities: EntityStore,
    *,
    segment: int | None = None,
    segments: int = 1,
    progress: Callable[[Backlog], None] | None = None,
) -> Backlog:
    """Count the outbox backlog of ``entities`` in one scan of its non-empty outboxes.

    Scans every segment of ``segments``, one after the other (``segments`` only sets
    the size of the pieces), or only ``segment`` (run one call per segment, in
    parallel, and combine them with :meth:`Backlog.merged`). Exact for a store nobody
    writes meanwhile; beside live consumers each entity is counted as its page of the
    scan read it. Memory is bounded by a page of the scan. ``progress``, if given, is
    called with the running totals every :data:`PROGRESS_EVERY` entities and at the
    end of each segment.

    Raises ``ValueError`` for a bad ``segment``/``segments``, ``StoreUnavailable``
    and ``StoreClosed``.
    """
    if not (isinstance(segments, int) and segments >= 1):
        raise ValueError(f"segments must be an int >= 1, got {segments!r}")
    if segment is not None and not (isinstance(segment, int) and 0 <= segment < segments):
        raise ValueError(f"segment must be None or in 0..{segments - 1}, got {segment!r}")
    tally = _Tally()
    for part in range(segments) if segment is None else (segment,):
        for entity in entities.pending_outboxes(part, segments):
            tally.add(entity)
            if progress is not None and tally.scanned % PROGRESS_EVERY == 0:
                progress(tally.backlog())
        if progress is not None:
            progress(tally.backlog())
    return tally.backlog()
