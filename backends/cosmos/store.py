"""The Cosmos DB deduplication store: :class:`CosmosDeduplicationStore`.

One item per (endpoint, message id): ``id`` (:func:`document_id`), ``endpoint``, ``message_id``,
``expires_at``, ``ttl`` and ``write_token``. Correctness rests on three native guarantees:
``create_item`` is atomic per id (409 Conflict: the id is there, so of concurrent writers exactly
one creates it); an expired record is overwritten by ``replace_item`` with ``If-Match`` on the
``_etag`` that was read (412: another writer changed it first); Strong consistency (see
:mod:`.cosmos`).

Every item records the write token of the call that wrote it: an item holding a token of this call
(a create or replace resent by the transport, or a retry on the same store object after
``StoreUnavailable``) is this call's own write, reported as recorded, exactly once. ``add_many``
sends one ``create_item`` per id (at most ``max_concurrency`` in flight), then one read-many for the
ids that already existed; ``processed_among`` one read-many per chunk of 1000.

Expiry is judged by the CLIENT's clock (``clock``, ``time.time`` by default): every client of a
container must keep its clock in sync (NTP). Items carry ``expires_at`` (compared with the clock on
every read) and a native ``ttl`` of the retention plus ``max_clock_skew``, which only reclaims space
(``-1`` without retention; per-item TTL needs the container's default TTL set:
:func:`create_container` sets ``-1``). ``purge_expired`` deletes (``If-Match``) only records
expired for longer than ``max_clock_skew``.

``StoreUnavailable`` carries ``recorded`` ids (recorded by the call) and ``unknown`` ids (maybe
recorded: a retry on the same store object reports those as recorded).

``_add_new`` and ``_find`` are written as steps (:mod:`dedupstore.steps`): the sync face runs them
on the shared ``CosmosClient``, the per-id writes in threads; the async face on the store's
``azure.cosmos.aio`` twin (:mod:`._aio`), the per-id writes as tasks on the loop; at most
``max_concurrency`` in flight on both. ``purge_expired``, ``count`` and ``endpoints`` stay blocking
(in threads on the async face).
"""

from __future__ import annotations

import hashlib
import math
from typing import TYPE_CHECKING, Any, ClassVar, Final

from azure.cosmos import CosmosClient

from dedupstore.backend import (
    CLOCK,
    MAX_CLOCK_SKEW,
    ConfigurationError,
    Connected,
    DeduplicationStore,
    OptionSet,
    Steps,
    StoreUnavailable,
    WriteRequest,
    io,
)

from ._client import CONNECTION_OPTIONS, ContainerKind, CosmosConnection, side_by_side

if TYPE_CHECKING:
    from collections.abc import Mapping

    from azure.cosmos import ContainerProxy

__all__ = ["CosmosDeduplicationStore", "create_container", "document_id"]

_ID_NAMESPACE: Final = b"dedupstore/cosmos/v1\x00"
_MAX_TTL_SECONDS: Final = 2**31 - 1
#: Rounds of create / read / replace before giving up on a contended id.
_MAX_ROUNDS: Final = 8


def document_id(endpoint: str, message_id: str) -> str:
    """The Cosmos DB item id of (``endpoint``, ``message_id``): the hex SHA-256 of a namespace tag,
    the 4-byte length of the UTF-8 endpoint, the endpoint and the message id (injective up to
    SHA-256 collisions, which reads detect)."""
    ep = endpoint.encode("utf-8")
    digest = hashlib.sha256(_ID_NAMESPACE + len(ep).to_bytes(4, "big") + ep)
    digest.update(message_id.encode("utf-8"))
    return digest.hexdigest()


def create_container(
    client: CosmosClient, database: str, container: str, *, offer_throughput: int | None = None
) -> ContainerProxy:
    """Create ``database`` and a deduplication ``container`` if missing: default TTL ``-1``
    (per-item TTL on, nothing expires by default), only ``endpoint`` and ``expires_at`` indexed. See
    :mod:`.cosmos` for ``offer_throughput`` and errors."""
    return CosmosDeduplicationStore.container_kind.create(
        client, database, container, offer_throughput
    )


class CosmosDeduplicationStore(DeduplicationStore):
    """Deduplication store in an Azure Cosmos DB (NoSQL API) container: linearizable on a Strong
    account, expiry by the client's clock (:mod:`.cosmos.store`)."""

    _cosmos = Connected(CosmosConnection)
    max_write_batch: ClassVar[int] = 1000
    max_read_batch: ClassVar[int] = 1000
    declared_options: ClassVar[OptionSet] = DeduplicationStore.declared_options.extend(
        CLOCK, MAX_CLOCK_SKEW, *CONNECTION_OPTIONS
    )
    container_kind: ClassVar[ContainerKind] = ContainerKind(
        "a deduplication container",
        "create_container()",
        ("endpoint", "expires_at"),
        "exactly-once deduplication",
        "reads may miss acknowledged writes and messages may be processed twice",
        default_ttl=-1,
    )

    def _open(self) -> None:
        self._max_skew: float = self.options["max_clock_skew"]
        ttl = self._cosmos.open_container(self).get("defaultTtl")
        self._default_ttl = ttl if isinstance(ttl, int) else None

    def _item(self, message_id: str, request: WriteRequest) -> dict[str, Any]:
        ttl = -1
        if request.expires_at is not None:
            ttl = math.ceil(max(request.expires_at - request.now, 0.0) + self._max_skew)
            if ttl > _MAX_TTL_SECONDS:
                ttl = -1  # beyond native TTL's range: reclaimed by purge_expired()
        return {
            "id": document_id(self.endpoint, message_id),
            "endpoint": self.endpoint,
            "message_id": message_id,
            "expires_at": request.expires_at,
            "ttl": ttl,
            "write_token": request.token,
        }

    def _read(self, ids: list[str]) -> Steps[dict[str, Mapping[str, Any]]]:
        """The items of those ``ids`` that exist; ``ConfigurationError`` if one is not ours."""
        found: dict[str, Mapping[str, Any]] = yield from io(
            self._cosmos.read_many, self, {mid: document_id(self.endpoint, mid) for mid in ids}
        )
        for mid, item in found.items():
            if item.get("endpoint") != self.endpoint or item.get("message_id") != mid:
                raise self.make_error(
                    ConfigurationError,
                    None,
                    f"item {item.get('id')!r} holds "
                    f"({item.get('endpoint')!r:.60}, {item.get('message_id')!r:.60}), not "
                    f"({self.endpoint!r:.60}, {mid!r:.60}): a container shared with "
                    "other data (or a SHA-256 collision); use a container of its own",
                )
        return found

    @staticmethod
    def _live(item: Mapping[str, Any], now: float) -> bool:
        expires_at = item.get("expires_at")
        return expires_at is None or float(expires_at) > now

    def _add_new(self, request: WriteRequest) -> Steps[set[str]]:
        def create(mid: str) -> Steps[tuple[str, int]]:
            answer = yield from io(self._cosmos.write, self, self._item(mid, request))
            return mid, answer[0]

        def replace(mid: str, etag: str) -> Steps[tuple[str, int]]:
            answer = yield from io(self._cosmos.write, self, self._item(mid, request), etag)
            return mid, answer[0]

        recorded: set[str] = set()
        to_create, to_read = list(request.ids), list[str]()
        for _ in range(_MAX_ROUNDS):
            created = yield from side_by_side(self, (create(m) for m in to_create))
            for mid, status in created:
                (recorded.add if status == 201 else to_read.append)(mid)
            to_create, to_replace = [], []
            found = yield from self._read(to_read)
            for mid in to_read:
                item = found.get(mid)
                if item is None:  # deleted since (purge or native TTL): create again
                    to_create.append(mid)
                elif not self._live(item, request.now):
                    to_replace.append((mid, str(item["_etag"])))
                elif item.get("write_token") in request.mine:  # this call's own write
                    recorded.add(mid)
            to_read = []
            replaced = yield from side_by_side(self, (replace(*e) for e in to_replace))
            for mid, status in replaced:
                if status == 200:
                    recorded.add(mid)
                elif status == 412:  # changed since read: look again
                    to_read.append(mid)
                else:
                    to_create.append(mid)
            if not to_create and not to_read:
                return recorded
        raise self.make_error(
            StoreUnavailable,
            None,
            f"{len(to_create) + len(to_read)} id(s) "
            f"changed under every one of {_MAX_ROUNDS} attempts (heavy contention); retry",
        )

    def _find(self, ids: list[str], now: float) -> Steps[set[str]]:
        found = yield from self._read(ids)
        return {mid for mid, item in found.items() if self._live(item, now)}

    def _purge(self, now: float) -> int:
        def delete(item: Mapping[str, Any]) -> int:
            # 404: gone already; 412: re-recorded since
            return int(self._cosmos.delete(self, str(item["id"]), str(item["_etag"])) == 204)

        # Only records expired for longer than max_clock_skew: a client whose clock runs up to that
        # much ahead never deletes a record others count as live.
        pages = self._cosmos.query(
            self,
            "SELECT c.id, c._etag FROM c WHERE c.endpoint = @endpoint "
            "AND IS_NUMBER(c.expires_at) AND c.expires_at <= @cutoff",
            self.max_write_batch,
            endpoint=self.endpoint,
            cutoff=now - self._max_skew,
        ).by_page()
        return sum(sum(self._cosmos.parallel(delete, list(page))) for page in pages)

    def _count(self, now: float) -> int:
        """Exact: ``SELECT VALUE COUNT(1)`` over this endpoint's live items (by the client's clock,
        as :meth:`_find` judges them), answered from the index; the SDK's values are summed, so
        partial counts (per partition or page) add up."""
        results = self._cosmos.query(
            self,
            "SELECT VALUE COUNT(1) FROM c WHERE c.endpoint = @endpoint "
            "AND (NOT IS_NUMBER(c.expires_at) OR c.expires_at > @now)",
            endpoint=self.endpoint,
            now=now,
        )
        return sum(int(value) for value in results)

    def _endpoints(self, now: float) -> set[str]:
        """Exact: ``SELECT VALUE c.endpoint`` over the live items (by the client's clock, as
        :meth:`_find` judges them), cross-partition, merged here: one value per live item
        crosses (``DISTINCT`` is not answered by every server: the emulator refuses it)."""
        results = self._cosmos.query(
            self,
            "SELECT VALUE c.endpoint FROM c WHERE IS_STRING(c.endpoint) "
            "AND (NOT IS_NUMBER(c.expires_at) OR c.expires_at > @now)",
            now=now,
        )
        return {str(value) for value in results}

    def _health_warnings(self) -> list[str]:
        warnings = super()._health_warnings()
        if self.retention is not None and self._default_ttl is None:
            warnings.append(
                f"container {self._cosmos.container(self).id!r} has no default TTL, so "
                "per-item TTL is off: expired records stay until purge_expired() (set default "
                "TTL to -1)"
            )
        return warnings
