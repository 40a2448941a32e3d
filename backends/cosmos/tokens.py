"""The Cosmos DB token store: :class:`CosmosTokenStore`, one item per token.

The URL names the TOKEN container, ``cosmos://<host>[:port]/<database>[/<container>]``: without a
container, ``dedup_tokens`` (:data:`DEFAULT_TOKEN_CONTAINER`). It is made by
:func:`create_token_container`, or at open with ``create=true``: partitioned on ``/id``, TTL off,
nothing indexed but what Cosmos DB always indexes (no query filters on a property). An item:
``id`` (:func:`token_document_id` of the token id: Cosmos DB ids may not hold ``/ \\ ? #``, as
for the other stores), ``token_id`` (as given, compared on every read), ``endpoint`` (the
receiving endpoint) and ``created`` (the mint time, epoch seconds of the minting client's clock).

* ``create``: one ``create_item`` per token (at most ``max_concurrency`` in flight); 409 Conflict:
  the token exists and is left as it is (an earlier try of the same creation). Those are read back
  (one read-many) to check that the item is that token, not another's data.
* ``present_among``: one read-many per chunk of 1000 (:meth:`CosmosConnection.read_many`, queries,
  never point reads), strongly consistent.
* ``delete``: one ``delete_item`` per token (at most ``max_concurrency`` in flight); 404 Not Found:
  gone already.
* ``scan``: one cross-partition query of every token's ``id``, ``token_id``, ``endpoint`` and
  ``created``, each page of 1000 fetched as the caller reaches it; ``outstanding``: the same
  query, counted here (``GROUP BY`` with aggregates is not answered by every server; the
  emulator's is limited).

Tokens never expire: a container with a default TTL that expires items (a positive number of
seconds) is refused at open (``ConfigurationError``); ``-1`` (per-item TTL, which token items do not
carry) and off are accepted. The account must be Strong, as for the other stores (see
:mod:`.cosmos`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Final
from urllib.parse import urlsplit, urlunsplit

from azure.cosmos import CosmosClient

from dedupstore.backend import (
    ConfigurationError,
    Connected,
    OptionSet,
    Steps,
    StoreURL,
    TokenRecord,
    TokenStore,
    io,
)

from ._client import CONNECTION_OPTIONS, ContainerKind, CosmosConnection, side_by_side

if TYPE_CHECKING:
    from azure.cosmos import ContainerProxy

__all__ = [
    "DEFAULT_TOKEN_CONTAINER",
    "CosmosTokenStore",
    "create_token_container",
    "token_document_id",
]

#: The container of a URL that names only the database.
DEFAULT_TOKEN_CONTAINER: Final = "dedup_tokens"
_ID_NAMESPACE: Final = b"dedupstore/cosmos/token/v1\x00"


def token_document_id(token_id: str) -> str:
    """The Cosmos DB item id of a token: the hex SHA-256 of a namespace tag (not the other stores')
    and the UTF-8 token id."""
    return hashlib.sha256(_ID_NAMESPACE + token_id.encode("utf-8")).hexdigest()


def create_token_container(
    client: CosmosClient,
    database: str,
    container: str = DEFAULT_TOKEN_CONTAINER,
    *,
    offer_throughput: int | None = None,
) -> ContainerProxy:
    """Create ``database`` and a token ``container`` if missing: TTL off, no property indexed. See
    :mod:`.cosmos` for ``offer_throughput`` and errors."""
    return CosmosTokenStore.container_kind.create(client, database, container, offer_throughput)


class CosmosTokenStore(TokenStore):
    """Tokens in an Azure Cosmos DB (NoSQL API) container, one item each, on a Strong account
    (:mod:`.cosmos.tokens`)."""

    _cosmos = Connected(CosmosConnection)
    max_batch: ClassVar[int] = 1000
    declared_options: ClassVar[OptionSet] = TokenStore.declared_options.extend(*CONNECTION_OPTIONS)
    container_kind: ClassVar[ContainerKind] = ContainerKind(
        "a token container",
        "create_token_container()",
        (),
        "token-based deduplication",
        "reads may miss acknowledged writes: a token just created may read as absent (a "
        "legitimate message dropped) and a deleted one as present (a message processed twice)",
    )

    @classmethod
    def portable_url(cls, url: str | StoreURL) -> StoreURL:
        """The URL naming the container: ``dedup_tokens`` when it names only the database."""
        parsed = super().portable_url(url)
        segments = parsed.path.split("/")[1:]
        if len(segments) != 1 or not segments[0]:
            return parsed  # a container named, or a malformed path the connection refuses
        scheme, netloc, path, query, fragment = urlsplit(parsed.text)
        path = f"{path}/{DEFAULT_TOKEN_CONTAINER}"
        return StoreURL.parse(urlunsplit((scheme, netloc, path, query, fragment)))

    def _open(self) -> None:
        ttl = self._cosmos.open_container(self).get("defaultTtl")
        if isinstance(ttl, int) and ttl > 0:
            raise self.make_error(
                ConfigurationError,
                None,
                f"container {self._cosmos.container(self).id!r} has a default TTL of {ttl} s: "
                "Cosmos DB would delete tokens, dropping legitimate messages; tokens never "
                "expire: give them a container with TTL off (create_token_container())",
            )

    @staticmethod
    def _item(record: TokenRecord) -> dict[str, Any]:
        return {
            "id": token_document_id(record.id),
            "token_id": record.id,
            "endpoint": record.endpoint,
            "created": record.created,
        }

    def _check_item(
        self, item: Mapping[str, Any], token_id: str | None = None
    ) -> tuple[str, float]:
        """The item's endpoint and mint time; ``ConfigurationError`` if it is not a token item
        (of ``token_id``, when given)."""
        stored, endpoint, created = item.get("token_id"), item.get("endpoint"), item.get("created")
        if (
            not isinstance(stored, str)
            or not isinstance(endpoint, str)
            or isinstance(created, bool)
            or not isinstance(created, int | float)
            or (token_id is not None and stored != token_id)
            or token_document_id(stored) != item.get("id")
        ):
            wanted = "a token" if token_id is None else f"token {token_id!r:.60}"
            raise self.make_error(
                ConfigurationError,
                None,
                f"item {item.get('id')!r} of container {self._cosmos.container(self).id!r} is "
                f"not {wanted} (it holds token_id {stored!r:.60}, endpoint {endpoint!r:.60}): "
                "a container shared with other data (or a SHA-256 collision); give the tokens "
                "a container of their own",
            )
        return endpoint, float(created)

    def _read(self, ids: list[str]) -> Steps[set[str]]:
        """Those of ``ids`` whose token exists; ``ConfigurationError`` if an item is not ours."""
        found = yield from io(
            self._cosmos.read_many, self, {tid: token_document_id(tid) for tid in ids}
        )
        for tid, item in found.items():
            self._check_item(item, tid)
        return set(found)

    def _create(self, records: list[TokenRecord]) -> Steps[None]:
        def create(record: TokenRecord) -> Steps[tuple[str, int]]:
            answer = yield from io(self._cosmos.write, self, self._item(record))
            return record.id, answer[0]

        created = yield from side_by_side(self, (create(r) for r in records))
        existing = [tid for tid, status in created if status == 409]
        if existing:
            yield from self._read(existing)  # left as they are; only checked to be tokens

    def _present(self, ids: list[str]) -> Steps[set[str]]:
        return (yield from self._read(ids))

    def _delete(self, ids: list[str]) -> Steps[None]:
        def delete(token_id: str) -> Steps[int]:
            return (yield from io(self._cosmos.delete, self, token_document_id(token_id)))

        yield from side_by_side(self, (delete(tid) for tid in ids))

    def _scan(self) -> Iterator[TokenRecord]:
        """One cross-partition query, pages of :attr:`page_size` items fetched as the
        iterator reaches them; each item checked to be a token."""
        items = self._cosmos.query(
            self, "SELECT c.id, c.token_id, c.endpoint, c.created FROM c", self.page_size
        )
        for item in items:
            endpoint, created = self._check_item(item)
            yield TokenRecord(str(item["token_id"]), endpoint, created)
