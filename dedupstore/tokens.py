"""The token store contract: :class:`TokenStore` (token-based deduplication).

A token is the right of one receiving endpoint to process one message once: the
sender creates it (a fresh id) before it dispatches the message, the receiver reads
it after it loads the entity and deletes it once its own outputs are dispatched. A
message whose token is absent is a duplicate. So the failure mode of a token store
is the inverse of a deduplication store's: a lost, expired or evicted token, or a
stale "absent", drops a legitimate message. The contract therefore has no
retention, reads are strongly consistent, and a store that cannot answer raises.

The base class owns what every backend shares (id validation before any I/O,
chunking, progress on failure); a backend implements four primitives whose
atomicity their docstrings state, and may count its tokens itself (``_outstanding``:
by default a count of what ``_scan`` lists). Open token stores with
:func:`dedupstore.open_token_store`.
"""

from __future__ import annotations

import abc
import hashlib
import secrets
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import ClassVar, NamedTuple

from dedupstore.client import Client
from dedupstore.errors import ConfigurationError, InvalidMessageId
from dedupstore.ids import validate_ids, validate_message_id
from dedupstore.options import OptionSet
from dedupstore.steps import Steps, run
from dedupstore.store import CLOCK, Clock, Stepped, chunked, split_ids

__all__ = [
    "TOKEN_HEADER",
    "TokenChange",
    "TokenCount",
    "TokenRecord",
    "TokenStore",
    "TokenWrites",
    "count_tokens",
    "new_nonce",
    "token_id",
    "token_of",
]

#: The header that carries a message's token to its receivers: the *nonce* of the
#: tokens minted for it. Each receiving endpoint's token id is
#: :func:`token_id` ``(message id, endpoint, nonce)``, so one header serves every
#: subscriber of a fanned-out message while each has a token of its own.
TOKEN_HEADER = "dedupstore-token"

_NONCE_CHARS = frozenset("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ-_")
#: Longest nonce a header may carry.
MAX_NONCE_CHARS = 64


def new_nonce() -> str:
    """A fresh nonce (64 random bits, hex): one per minting of a message's tokens."""
    return secrets.token_hex(8)


def validate_nonce(nonce: object, message_id: str) -> str:
    """``nonce`` if it is a valid :data:`TOKEN_HEADER` value (1 to 64 characters of
    ``[A-Za-z0-9_-]``), else ``InvalidMessageId`` naming the message."""
    if (
        not isinstance(nonce, str)
        or not 0 < len(nonce) <= MAX_NONCE_CHARS
        or not _NONCE_CHARS.issuperset(nonce)
    ):
        raise InvalidMessageId(
            f"message {message_id!r:.80}: its {TOKEN_HEADER} header must be 1 to "
            f"{MAX_NONCE_CHARS} characters of [A-Za-z0-9_-], got {nonce!r:.80}"
        )
    return nonce


def token_id(message_id: str, endpoint: str, nonce: str) -> str:
    """The id of the token that lets ``endpoint`` process message ``message_id`` once,
    minted with ``nonce`` (the message's :data:`TOKEN_HEADER`): a hash of the three,
    so two endpoints never share a token and a new nonce is a new token."""
    digest = hashlib.sha256(
        f"{len(message_id)}:{message_id}\0{len(endpoint)}:{endpoint}\0{nonce}".encode(
            "utf-8", "surrogatepass"
        )
    ).hexdigest()
    return f"tk-{digest[:40]}"


def token_of(message_id: str, headers: Mapping[str, str], endpoint: str) -> str | None:
    """The token id of an incoming message for ``endpoint``, from its
    :data:`TOKEN_HEADER` (None: the message came without a token). Raises
    ``InvalidMessageId`` for a header that is not a nonce."""
    nonce = headers.get(TOKEN_HEADER) if headers else None
    if nonce is None:
        return None
    return token_id(message_id, endpoint, validate_nonce(nonce, message_id))


class TokenRecord(NamedTuple):
    """One token handed to :meth:`TokenStore._create`: its id, the receiving endpoint
    it authorises, and when it was minted (epoch seconds, the client's clock)."""

    id: str
    endpoint: str
    created: float


class TokenChange(NamedTuple):
    """What one entity's joint save does to a token store on the entity store's server
    (``EntityStore._save_tokened``), in the save's request:
    the entity is saved only if the token ``require`` exists (None: no condition), and
    only once it is saved are ``create`` (token id -> receiving endpoint) created where
    absent and ``delete`` deleted."""

    require: str | None = None
    create: Mapping[str, str] = {}
    delete: tuple[str, ...] = ()

    @property
    def size(self) -> int:
        """How many token ids it names."""
        return (self.require is not None) + len(self.create) + len(self.delete)


class TokenWrites(NamedTuple):
    """A :class:`TokenChange` as a backend's joint save gets it (ids validated, the
    tokens to create stamped with their mint time)."""

    require: str | None
    create: tuple[TokenRecord, ...]
    delete: tuple[str, ...]


class TokenCount(NamedTuple):
    """The tokens of one receiving endpoint: how many exist, and when the oldest was
    minted (epoch seconds, the minting client's clock)."""

    outstanding: int
    oldest: float


def count_tokens(tokens: Iterable[tuple[str, float]]) -> dict[str, TokenCount]:
    """Receiving endpoint -> :class:`TokenCount`, from ``(endpoint, created)`` per token:
    what :meth:`TokenStore._outstanding` returns, counted on the client."""
    counts: dict[str, TokenCount] = {}
    for endpoint, created in tokens:
        known = counts.get(endpoint)
        counts[endpoint] = (
            TokenCount(1, created)
            if known is None
            else TokenCount(known.outstanding + 1, min(known.oldest, created))
        )
    return counts


class TokenStore(Client):
    """A strongly consistent set of tokens, each minted for one receiving endpoint.

    Guarantees (every backend, checked by
    :class:`dedupstore.testing.TokenStoreContract`):

    * :meth:`create` is create-if-absent per token, durable and visible to every
      client when it returns; creating a token that exists changes nothing (token
      ids are fresh per mint, so it was an earlier try of the same creation);
    * :meth:`present` / :meth:`present_among` are strongly consistent: never a
      stale "absent", never a stale "present";
    * :meth:`delete` is idempotent, durable when it returns;
    * tokens never expire: there is no retention option, and a backend that could
      evict data refuses to open;
    * invalid ids or endpoints raise :class:`~dedupstore.errors.InvalidMessageId`
      before any I/O, and nothing is written; a store that cannot answer raises
      :class:`~dedupstore.errors.StoreUnavailable`; a batch that fails part-way
      says what it completed (``recorded``: created, or deleted) and what is
      ``unknown``.

    Instances pickle to their URL and options; they are safe to share between threads.
    """

    #: Largest number of tokens handed to one primitive call.
    max_batch: ClassVar[int] = 1000
    #: How many chunks of one call may be in flight at once (1: one by one).
    chunk_concurrency: ClassVar[int] = 1
    #: Tokens asked per page of :meth:`scan` (Redis: the ``COUNT`` of its ``SCAN`` is its
    #: own; DynamoDB: also at most 1 MB a page).
    page_size: ClassVar[int] = 1000

    declared_options: ClassVar[OptionSet] = Client.declared_options.extend(CLOCK)
    primitives: ClassVar[tuple[str, ...]] = ("_create", "_present", "_delete")

    def _configure(self) -> None:
        super()._configure()
        clock = self.options.get("clock")
        self._clock: Clock = clock if clock is not None else time.time

    # ------------------------------------------------------------------ public API

    def create(self, tokens: Mapping[str, str]) -> None:
        """Create every token of ``tokens`` (token id -> receiving endpoint) that does
        not exist; one round trip per chunk of :attr:`max_batch`.

        Every id and endpoint is validated before anything is written. A failure
        part-way raises with ``recorded`` (created for sure) and ``unknown``; creating
        the same tokens again completes it. Raises ``InvalidMessageId``,
        ``StoreUnavailable``, ``StoreClosed``.
        """
        run(self._create_steps(tokens))

    def _create_steps(self, tokens: Mapping[str, str]) -> Steps[None]:
        if not isinstance(tokens, Mapping):
            raise InvalidMessageId(
                f"expected a mapping of token id -> receiving endpoint, got {type(tokens).__name__}"
            )
        ids = validate_ids(list(tokens), "token id")
        endpoints = {mid: validate_message_id(tokens[mid], "endpoint") for mid in ids}
        self.check_open()
        now = self._clock()

        def create_chunk(chunk: list[str]) -> Steps[set[str]]:
            records = [TokenRecord(mid, endpoints[mid], now) for mid in chunk]
            with self.translating_errors("create tokens"):
                yield from self._primitive("_create", records)
            return set(chunk)

        yield from self._over_chunks(ids, create_chunk, writes=True)

    def present(self, token_id: str) -> bool:
        """Whether the token ``token_id`` exists (strongly consistent). Raises
        ``InvalidMessageId`` before any I/O, ``StoreUnavailable``, ``StoreClosed``."""
        return bool(self.present_among([token_id]))  # validated there, before any I/O

    def present_among(self, token_ids: Iterable[str]) -> set[str]:
        """The ids among ``token_ids`` whose token exists (strongly consistent); one
        round trip per chunk of :attr:`max_batch`. Raises ``InvalidMessageId`` before
        any I/O, ``StoreUnavailable``, ``StoreClosed``."""
        return run(self._present_among_steps(token_ids))

    def _present_among_steps(self, token_ids: Iterable[str]) -> Steps[set[str]]:
        ids = self._validated(token_ids)

        def find_chunk(chunk: list[str]) -> Steps[set[str]]:
            with self.translating_errors("read tokens"):
                found: set[str] = yield from self._primitive("_present", chunk)
                return found

        return (yield from self._over_chunks(ids, find_chunk, writes=False))

    def delete(self, token_ids: Iterable[str]) -> None:
        """Delete the tokens ``token_ids`` (those that do not exist are left alone:
        idempotent); durable when it returns. A failure part-way raises with
        ``recorded`` (deleted for sure) and ``unknown``. Raises ``InvalidMessageId``
        before any I/O, ``StoreUnavailable``, ``StoreClosed``."""
        run(self._delete_steps(token_ids))

    def _delete_steps(self, token_ids: Iterable[str]) -> Steps[None]:
        ids = self._validated(token_ids)

        def delete_chunk(chunk: list[str]) -> Steps[set[str]]:
            with self.translating_errors("delete tokens"):
                yield from self._primitive("_delete", chunk)
            return set(chunk)

        yield from self._over_chunks(ids, delete_chunk, writes=True)

    def _over_chunks(
        self, ids: list[str], work: Callable[[list[str]], Steps[set[str]]], *, writes: bool
    ) -> Steps[set[str]]:
        """``work`` over the chunks of :attr:`max_batch` of ``ids`` (:func:`chunked`)."""
        chunks = split_ids(ids, self.max_batch)
        return (yield from chunked(chunks, work, writes=writes, concurrency=self.chunk_concurrency))

    def outstanding(self) -> dict[str, TokenCount]:
        """Receiving endpoint -> its tokens (how many, the oldest's mint time): the
        messages in flight, dead-lettered or lost. A maintenance read of every token.
        Raises ``StoreUnavailable``, ``StoreClosed``."""
        self.check_open()
        with self.translating_errors("count tokens"):
            return self._outstanding()

    def scan(
        self, *, endpoint: str | None = None, created_before: float | None = None
    ) -> Iterator[TokenRecord]:
        """Every token as a :class:`TokenRecord` (id, receiving endpoint, mint time), read a
        page of about :attr:`page_size` at a time as the iterator is consumed: a maintenance
        read (the orphan report), never one request for the whole store.

        A token that exists for the whole scan is listed exactly once; one created or
        deleted meanwhile may or may not be. The order is the backend's. ``endpoint`` and
        ``created_before`` (epoch seconds) keep only the tokens of that receiving endpoint /
        minted before that time (filtered as the pages are read). Raises
        ``InvalidMessageId`` (a bad endpoint) or ``ConfigurationError`` (a bad
        ``created_before``) at the call, before any I/O; ``StoreClosed``; while iterating,
        ``StoreUnavailable`` (iterate again from the start: nothing is written).
        """
        if endpoint is not None:
            endpoint = validate_message_id(endpoint, "endpoint")
        if created_before is not None and (
            isinstance(created_before, bool)
            or not isinstance(created_before, int | float)
            or created_before != created_before  # NaN
        ):
            raise ConfigurationError(
                f"created_before must be epoch seconds (a number), got {created_before!r:.80}"
            )
        self.check_open()
        return self._scanning(endpoint, created_before)

    def _scanning(self, endpoint: str | None, before: float | None) -> Iterator[TokenRecord]:
        records = self._scan()
        while True:
            with self.translating_errors("list tokens"):
                record = next(records, None)
            if record is None:
                return
            if (endpoint is None or record.endpoint == endpoint) and (
                before is None or record.created < before
            ):
                yield record

    def _writes(self, change: TokenChange) -> TokenWrites:
        """``change`` checked (``InvalidMessageId`` before any I/O) and stamped now."""
        if not isinstance(change, TokenChange):
            raise TypeError(f"expected a TokenChange, got {type(change).__name__}")
        require = (
            None if change.require is None else validate_message_id(change.require, "token id")
        )
        ids = validate_ids(list(change.create), "token id")
        now = self._clock()
        created = tuple(
            TokenRecord(tid, validate_message_id(change.create[tid], "endpoint"), now)
            for tid in ids
        )
        return TokenWrites(require, created, tuple(validate_ids(list(change.delete), "token id")))

    def _validated(self, token_ids: Iterable[str]) -> list[str]:
        if isinstance(token_ids, str | bytes):
            raise InvalidMessageId(
                f"expected an iterable of token ids, got a single {type(token_ids).__name__}"
                f" {token_ids!r:.80}; wrap it in a list"
            )
        try:
            listed = list(token_ids)
        except TypeError:
            raise InvalidMessageId(
                f"expected an iterable of token ids, got {type(token_ids).__name__}"
            ) from None
        ids = validate_ids(listed, "token id")
        self.check_open()
        return ids

    # ------------------------------------------------------------------ primitives

    @abc.abstractmethod
    def _create(self, records: list[TokenRecord]) -> Stepped[None]:
        """Atomically per token, create each record whose id does not exist (an
        existing one is left as it is). ``records`` is non-empty, duplicate-free and at
        most :attr:`max_batch` long. Durable and visible to all clients on return. Like
        every primitive, a blocking method or steps (as the deduplication store's,
        :class:`~dedupstore.store.DeduplicationStore`)."""

    @abc.abstractmethod
    def _present(self, ids: list[str]) -> Stepped[set[str]]:
        """The ids that exist; a strongly consistent read. ``ids`` as in :meth:`_create`."""

    @abc.abstractmethod
    def _delete(self, ids: list[str]) -> Stepped[None]:
        """Delete the tokens that exist among ``ids``; durable on return."""

    def _outstanding(self) -> dict[str, TokenCount]:
        """Receiving endpoint -> count and oldest mint time, over every token: by default
        counted on the client from :meth:`_scan`; a backend that can count in one
        request (SQL's ``GROUP BY``) overrides it."""
        return count_tokens((record.endpoint, record.created) for record in self._scan())

    @abc.abstractmethod
    def _scan(self) -> Iterator[TokenRecord]:
        """Every token (its id as created, endpoint, mint time), a page of about
        :attr:`page_size` per request, read lazily as the iterator is consumed; each token
        that exists for the whole scan exactly once (a backend whose pages may repeat a
        token drops the repeats). Driver errors propagate (the caller translates them)."""
