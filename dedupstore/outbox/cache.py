"""The entities a processor keeps: each stands for a load of its entity."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable

from dedupstore.entities import Entity


class _EntityCache:
    """The entities the processor saved (or loaded) last, as of that save: each
    stands for a load of the entity (least recently kept dropped first, at most
    ``size`` entities and ``_CACHE_BYTES`` of their state texts and outbox ids).

    An entity taken is the taker's alone (it is changed in place); one is kept only
    once its processing is over. Its version is the save's, so a save of it after
    anyone else saved the entity conflicts: a stale entity costs a conflict and a
    load, never a wrong answer. Thread-safe.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        # (an OrderedDict: a dict's oldest entry is found by skipping the ones removed)
        self._entities: OrderedDict[str, tuple[Entity, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def take(self, entity_id: str) -> Entity | None:
        """The kept entity of ``entity_id`` (no longer kept), or None."""
        if not self._entities:
            return None
        with self._lock:
            kept = self._entities.pop(entity_id, None)
            if kept is None:
                return None
            self._bytes -= kept[1]
            return kept[0]

    def keep(self, entity: Entity) -> None:
        """Keep ``entity``, saved or loaded and not changed since, unless it is large,
        holds pending entries or its state's text is not known."""
        source = entity._source()
        if not self.size or source is None or entity.version is None:
            return
        size = len(source)
        for mid, entry in entity.outbox.items():
            if entry is not None:
                return
            size += len(mid) + 8
        if size > _CACHE_ENTITY_BYTES:
            return
        with self._lock:
            old = self._entities.pop(entity.id, None)
            self._entities[entity.id] = (entity, size)
            self._bytes += size - (0 if old is None else old[1])
            while len(self._entities) > self.size or self._bytes > _CACHE_BYTES:
                self._bytes -= self._entities.popitem(last=False)[1][1]

    def take_many(self, entity_ids: Iterable[str]) -> dict[str, Entity]:
        """The kept entities among ``entity_ids`` (no longer kept), by id."""
        if not self._entities:
            return {}
        taken: dict[str, Entity] = {}
        with self._lock:
            kept = self._entities
            for entity_id in entity_ids:
                found = kept.pop(entity_id, None)
                if found is not None:
                    self._bytes -= found[1]
                    taken[entity_id] = found[0]
        return taken


#: Bytes of the entities one processor keeps (see :class:`_EntityCache`), at most.
_CACHE_BYTES = 16 * 1024 * 1024


#: Bytes of one entity a processor keeps, at most (a larger one is loaded each time).
_CACHE_ENTITY_BYTES = 256 * 1024
