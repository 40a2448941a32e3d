"""What the parts of :class:`~dedupstore.outbox.OutboxProcessor` (one class made of
mixins, one module each) share: :class:`_Base` declares the attributes its ``__init__``
sets and, for the type checker only, the methods a part calls on a later one."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from dedupstore.entities import Entity, EntityStore, EntryMark, OutgoingMessage
    from dedupstore.outbox.cache import _EntityCache
    from dedupstore.outbox.messages import Dispatcher, Handler, Message, Outcome, ProcessResult
    from dedupstore.steps import Steps
    from dedupstore.store import DeduplicationStore
    from dedupstore.tokens import TokenChange, TokenStore


class _Base:
    """The processor's attributes (see ``OutboxProcessor.__init__``)."""

    run: str | None
    dead_letters: str | None
    handler_attempts: int
    entities: EntityStore
    dedup: DeduplicationStore
    dispatcher: Dispatcher
    cleanup: Literal["inline", "deferred"]
    max_attempts: int
    deferred_limit: int
    gc_threshold: int | None
    #: token mode: the token store (None: retention mode only) and, per destination,
    #: the receiving endpoints each outgoing message gets a token for
    tokens: TokenStore | None
    subscriptions: dict[str, tuple[str, ...]]
    #: without a token store: whether a message carrying a token was already reported
    _untokened_reported: bool
    #: the handler that passed the check
    _checked_handler: Handler | None
    #: the dispatcher's bounds (max_message_bytes, max_header_bytes): see check_size
    _bounds: tuple[int | None, int | None]
    #: valid destinations the handler named, as JSON strings (checked once each)
    _destinations: dict[str, str]
    #: the entities process() saved last, at the version of that save
    _kept: _EntityCache
    #: whether the two stores share a server: process() loads the entity and checks the
    #: id in one round trip, and the inline clean-up is one atomic write
    _joined: bool
    #: whether the token store shares the entity store's server: token mode's writes
    #: are folded into the entity's saves (``EntityStore._save_tokened``)
    _tokens_joined: bool
    #: then: most token ids one entity's joint save may name
    _joint_tokens: int

    @property
    def consumer(self) -> str:
        """The consumer's name: the deduplication store's endpoint."""
        return self.dedup.endpoint

    if TYPE_CHECKING:  # the methods one part calls on another (defined by their part)

        def _process_one(self, message: Message, handler: Handler) -> Steps[ProcessResult]:
            raise NotImplementedError

        def _process(
            self, message: Message, handler: Handler, dispatched: set[str], clean: bool = True
        ) -> Steps[ProcessResult]:
            raise NotImplementedError

        def _claim_all(self, entities: dict[str, Entity]) -> dict[str, Entity]:
            raise NotImplementedError

        def _found(self, entity: Entity, mid: str) -> tuple[Outcome, str | None]:
            raise NotImplementedError

        def _apply(
            self, entity: Entity, message: Message, handler: Handler, mark: EntryMark | None = None
        ) -> Steps[tuple[list[OutgoingMessage], str | None]]:
            raise NotImplementedError

        def _mark(self) -> EntryMark:
            raise NotImplementedError

        def _over_limit(self, entity: Entity) -> bool:
            raise NotImplementedError

        def _move_and_save(
            self,
            to_save: Sequence[Entity],
            moving: Sequence[Entity],
            retiring: Sequence[tuple[Entity, str]] = (),
        ) -> Steps[set[str]]:
            raise NotImplementedError

        def _minting(self, entity: Entity, mid: str) -> dict[str, str]:
            raise NotImplementedError

        def _token_store(self) -> TokenStore:
            raise NotImplementedError

        def _save_folded(
            self, entities: Sequence[Entity], changes: Mapping[str, TokenChange]
        ) -> Steps[tuple[set[str], set[str]]]:
            raise NotImplementedError

        def _token_of(self, message: Message) -> str | None:
            raise NotImplementedError

        def _register(self, entity: Entity, message: Message, letter: bool) -> None:
            raise NotImplementedError

        def _recorded_by_token(self, tokens: dict[str, str]) -> Steps[set[str]]:
            raise NotImplementedError

        def _make(
            self, pairs: Sequence[tuple[Entity, str]], alone: bool = False
        ) -> Steps[set[str]]:
            raise NotImplementedError

        def _retire(self, pairs: Sequence[tuple[Entity, str]]) -> Steps[None]:
            raise NotImplementedError

        def _token_room(self, message: Message, outgoing: Sequence[OutgoingMessage]) -> int:
            raise NotImplementedError

        def _clear(self, entities: Iterable[Entity], keep: set[tuple[str, str]]) -> Steps[set[str]]:
            raise NotImplementedError

        def _report(self, messages: Sequence[Message], results: Sequence[ProcessResult]) -> None:
            raise NotImplementedError
