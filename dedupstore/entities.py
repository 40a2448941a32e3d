"""Entities and their outbox: :class:`Entity`, :class:`OutgoingMessage`, :class:`EntityStore`.

An entity is the application's state for one correlation id, stored as ONE record
with an optimistic-concurrency token (``version``): its ``state`` (a JSON-compatible
dict) and its ``outbox``, which maps each incoming message id to the outgoing
messages processing it produced, or to ``None`` once they were dispatched. A backend
implements three primitives (load, conditional save, segmented scan).
"""

from __future__ import annotations

import abc
import copy
import functools
import hashlib
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, TypeVar, cast

from dedupstore import canonical
from dedupstore.client import Client
from dedupstore.errors import ConcurrencyConflict, EntityTooLarge, InvalidMessageId, InvalidValue
from dedupstore.ids import plain_ids, validate_ids, validate_message_id
from dedupstore.options import OptionSet
from dedupstore.steps import Steps, run

if TYPE_CHECKING:
    from dedupstore.store import DeduplicationStore, Stepped, WriteRequest
    from dedupstore.tokens import TokenChange, TokenStore, TokenWrites

T = TypeVar("T")

__all__ = [
    "BUCKETS",
    "ENTITY_FRAME_BYTES",
    "Entity",
    "EntityRecord",
    "EntityStore",
    "EntryMark",
    "EntryTokens",
    "OutgoingMessage",
    "body_text",
    "bucket_of",
    "canonical_json",
    "decode_entity",
    "encode_entity",
    "entry_size",
    "groups_by_size",
    "head_size",
    "json_size",
    "message_text",
]

#: Entities are spread over this many buckets by a hash of their id; segment ``s``
#: of ``n`` holds the buckets ``b`` with ``b % n == s``, so any number of segments
#: is disjoint and complete, on every backend alike.
BUCKETS = 4096


@functools.lru_cache(maxsize=1 << 16)
def bucket_of(entity_id: str) -> int:
    """The bucket of an entity id (stable across processes, versions and backends)."""
    digest = hashlib.sha256(entity_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big") % BUCKETS


#: The texts a message can keep, and what each reads as when it keeps none.
_NO_TEXTS = {"_body_text": None, "_headers_text": "{}", "_text": None}


class _Texts:
    """The canonical JSON of ``body``, ``headers`` and :meth:`~OutgoingMessage.to_json`
    kept by a message the processor made (:meth:`OutgoingMessage._encoded`), all three
    or none: slots outside the fields, so ``asdict``, equality and pickling ignore them."""

    __slots__ = tuple(_NO_TEXTS)
    _body_text: str | None
    _headers_text: str
    _text: str | None


# Hand-tuned (texts in slots, the body decoded on first read, _encoded bypassing
# __init__): the plain dataclass made process_batch 1.16x slower (benchmarks.cpu_compare).
@dataclass(frozen=True, slots=True)
class OutgoingMessage(_Texts):
    """A message an entity sends: ``id`` (deterministic), ``destination``, ``body``, ``headers``.

    ``body`` is any JSON-compatible value; ``headers`` maps ``str`` to ``str``.
    Receivers deduplicate by ``id``: a re-dispatch carries the same id and bytes.
    """

    id: str
    destination: str
    body: Any
    headers: Mapping[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The message as a JSON-compatible dict."""
        return {
            "id": self.id,
            "destination": self.destination,
            "body": self.body,
            "headers": dict(self.headers),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> OutgoingMessage:
        """The inverse of :meth:`to_json`."""
        return cls(
            id=str(data["id"]),
            destination=str(data["destination"]),
            body=data["body"],
            headers=dict(data.get("headers") or {}),
        )

    if not TYPE_CHECKING:  # (hidden from type checkers: every other name stays checked)

        def __getattr__(self, name: str) -> Any:
            """An empty slot: a text this message does not keep, or the ``body`` of a
            message :meth:`_encoded` made without it, decoded once on first read."""
            if name in _NO_TEXTS:
                return _NO_TEXTS[name]
            text = self._body_text
            if name != "body" or text is None:
                raise AttributeError(
                    f"{type(self).__name__!r} object has no attribute {name!r}", name=name, obj=self
                )
            with _decoding:
                try:
                    return _get_body(self, OutgoingMessage)
                except AttributeError:  # the first read
                    body = canonical.loads(text)
                    _set_body(self, body)
                    return body

    @classmethod
    def _encoded(
        cls,
        id: str,
        destination: str,
        body: Any,
        body_text: str,
        headers: dict[str, str],
        destination_text: str | None = None,
        id_text: str | None = None,
    ) -> OutgoingMessage:
        """A message keeping its texts (encoded once, whatever saves or dispatches it);
        ``body`` is ``body_text`` decoded, or ``canonical._UNDECODED`` (decoded on first
        read). ``destination_text``, ``id_text``: those as JSON strings, when known."""
        message = _new(cls)  # frozen: fill the slots at once, as __init__ would
        if destination_text is None:
            destination_text = canonical.string(destination)
        headers_text = canonical.dumps(headers) if headers else "{}"
        _set_id(message, id)
        _set_destination(message, destination)
        _set_headers(message, headers)
        _set_body_text(message, body_text)
        _set_headers_text(message, headers_text)
        _set_text(  # what message_text composes
            message,
            f'{{"body":{body_text},"destination":{destination_text}'
            f',"headers":{headers_text}'
            f',"id":{canonical.string(id) if id_text is None else id_text}}}',
        )
        if body is not canonical._UNDECODED:
            _set_body(message, body)
        return message


_new = object.__new__
# The slots' own accessors (a frozen dataclass's __setattr__ refuses).
_set_id = vars(OutgoingMessage)["id"].__set__
_set_destination = vars(OutgoingMessage)["destination"].__set__
_set_headers = vars(OutgoingMessage)["headers"].__set__
_set_body_text = vars(_Texts)["_body_text"].__set__
_set_headers_text = vars(_Texts)["_headers_text"].__set__
_set_text = vars(_Texts)["_text"].__set__
_set_body = vars(OutgoingMessage)["body"].__set__
_get_body = vars(OutgoingMessage)["body"].__get__
_decoding = threading.Lock()  # one decoded body per message, whichever thread reads first


def body_text(message: OutgoingMessage) -> str:
    """Canonical JSON of ``message.body`` (kept from when the processor made it)."""
    text = message._body_text
    return canonical.dumps(message.body, "body") if text is None else text


def message_text(message: OutgoingMessage) -> str:
    """Canonical JSON of ``message.to_json()``, composed from its parts' texts."""
    text = message._text
    if text is not None:
        return text
    headers = message.headers
    return (
        f'{{"body":{body_text(message)},"destination":{canonical.string(message.destination)}'
        f',"headers":{canonical.dumps(dict(headers), "headers") if headers else "{}"}'
        f',"id":{canonical.string(message.id)}}}'
    )


Outbox = dict[str, list[OutgoingMessage] | None]


@dataclass(frozen=True)
class EntryMark:
    """When a pending outbox entry was written (``at``: epoch milliseconds, an int) and
    by which :class:`~dedupstore.outbox.OutboxProcessor` ``run``, if it had one."""

    at: int
    run: str | None = None

    @functools.cached_property
    def _frame(self) -> tuple[str, str]:
        """The text of an entry around its messages (composed once per batch's mark)."""
        at = str(self.at) if type(self.at) is int else canonical.dumps(self.at)
        run = "" if self.run is None else f',"run":{canonical.string(self.run)}'
        return (f'{{"at":{at},"out":[', f"]{run}}}")


@dataclass(frozen=True)
class EntryTokens:
    """The tokens of one outbox entry, in token mode (see :mod:`dedupstore.tokens`).

    ``incoming``: the incoming message's token id, deleted at the clean-up (None: the
    message came without one and is recorded in the deduplication store instead).
    ``to``: per destination, the receiving endpoints of its outgoing messages, as
    subscribed when the entry was written (one token per message and endpoint).
    ``registered``: the nonces attempts recorded before creating their tokens, in
    order; ``made``: the one whose tokens were created and whose messages are
    dispatched (never created again). The others' tokens are garbage, and ``drop``
    holds the ids of those of a dispatched entry: both are deleted at the clean-up.
    ``letter``: the message was dead-lettered: the token of its redrive (the dead
    letter's id, the same nonce), created when the incoming token is deleted, so that
    the original is a duplicate and the redrive is processed once.
    """

    incoming: str | None = None
    to: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    registered: tuple[str, ...] = ()
    made: str | None = None
    drop: tuple[str, ...] = ()
    letter: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The JSON-compatible form saved in the entity (empty parts left out)."""
        data: dict[str, Any] = {}
        if self.incoming is not None:
            data["in"] = self.incoming
        if self.to:
            data["to"] = {d: list(e) for d, e in self.to.items()}
        if self.registered:
            data["reg"] = list(self.registered)
        if self.made is not None:
            data["made"] = self.made
        if self.drop:
            data["drop"] = list(self.drop)
        if self.letter is not None:
            data["letter"] = self.letter
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> EntryTokens:
        """The inverse of :meth:`to_json`."""
        return cls(
            data.get("in"),
            {str(d): tuple(map(str, e)) for d, e in (data.get("to") or {}).items()},
            tuple(map(str, data.get("reg") or ())),
            data.get("made"),
            tuple(map(str, data.get("drop") or ())),
            data.get("letter"),
        )


@dataclass
class Entity:
    """One entity: its id, state, outbox and the opaque version it was loaded at.

    ``version is None``: never saved (or loaded absent). ``marks``: the
    :class:`EntryMark` of pending entries (a mark whose entry is gone or dispatched is
    not saved). ``consumer``: the endpoint that wrote the entity (the
    :class:`~dedupstore.outbox.OutboxProcessor` and :func:`~dedupstore.outbox.sweep`
    refuse an entity of another consumer); ``None`` when nobody claimed it.
    ``attempts``: per incoming message id not applied yet, the runs of its handler
    begun after a consumer died holding it
    (:meth:`~dedupstore.outbox.OutboxProcessor.begin_attempt`). ``tokens``: the
    :class:`EntryTokens` of entries written in token mode, by incoming message id.
    """

    id: str
    state: dict[str, Any] = field(default_factory=dict)
    outbox: Outbox = field(default_factory=dict)
    version: Any = None
    marks: dict[str, EntryMark] = field(default_factory=dict)
    consumer: str | None = None
    attempts: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, EntryTokens] = field(default_factory=dict)
    #: ``(state, its canonical text)`` when the processor set the state from that text.
    _state_text: tuple[dict[str, Any], str] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    #: ``(state, the JSON text it was loaded from)``: never used to encode (a caller may
    #: change a loaded state in place), only to decode it again (:meth:`_source`).
    _loaded: tuple[dict[str, Any], str] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def _set_state(self, state: dict[str, Any], text: str) -> None:
        """Set ``state``, decoded from ``text`` and held by no one else: kept encoded."""
        self.state = state
        self._state_text = (state, text)

    def _source(self) -> str | None:
        """A JSON text that decodes to ``state`` (as set or loaded), if one is known."""
        for kept in (self._state_text, self._loaded):
            if kept is not None and kept[0] is self.state:
                return kept[1]
        return None

    def pending_since(self) -> int | None:
        """The oldest mark's ``at`` among pending entries (epoch ms), if any is marked."""
        times = [
            mark.at for mid, mark in self.marks.items() if self.outbox.get(mid, None) is not None
        ]
        return min(times, default=None)

    @property
    def pending(self) -> list[str]:
        """Incoming message ids whose outgoing messages still await dispatch."""
        return [mid for mid, entry in self.outbox.items() if entry is not None]

    @property
    def dispatched(self) -> list[str]:
        """Incoming message ids whose outgoing messages were dispatched (``None`` entries)."""
        return [mid for mid, entry in self.outbox.items() if entry is None]

    def copy(self) -> Entity:
        """A deep copy (the state and outbox can be changed without touching this one)."""
        return Entity(
            self.id,
            copy.deepcopy(self.state),
            dict(self.outbox),
            self.version,
            dict(self.marks),
            self.consumer,
            dict(self.attempts),
            dict(self.tokens),
        )


def canonical_json(value: Any) -> str:
    """``value`` as canonical JSON: sorted keys, no spaces, UTF-8 text, no NaN (equal
    values give equal text). Raises ``TypeError``/``ValueError`` when ``value`` is not
    JSON-compatible.
    """
    return canonical.dumps(value)


def json_size(value: Any) -> int:
    """UTF-8 bytes of :func:`canonical_json` of ``value``."""
    return len(canonical.dumps_bytes(value))


def _entry_text(entry: list[OutgoingMessage] | None, mark: EntryMark | None) -> str:
    """A dispatched entry is ``null``; a pending one ``{"at":..,"out":[..],"run":..}``."""
    if entry is None:
        return "null"
    out = message_text(entry[0]) if len(entry) == 1 else ",".join(map(message_text, entry))
    if mark is None:
        return f'{{"out":[{out}]}}'
    frame = mark._frame
    return f"{frame[0]}{out}{frame[1]}"


def entry_size(
    message_id: str, entry: list[OutgoingMessage] | None, mark: EntryMark | None = None
) -> int:
    """UTF-8 bytes of one outbox entry ``"<id>":<entry>`` in :func:`encode_entity`'s text."""
    return len(f"{canonical.string(message_id)}:{_entry_text(entry, mark)}".encode())


#: Bytes of :func:`encode_entity`'s text around the state and the entries: an entity
#: encodes to ``ENTITY_FRAME_BYTES + head_size(entity) + json_size(state) + sum(entry
#: sizes) + (n - 1)`` for ``n >= 1`` entries (the commas), without the last term with none.
ENTITY_FRAME_BYTES = len('{"outbox":{},"state":}')


def _head(entity: Entity) -> str:
    """The optional top-level keys of :func:`encode_entity`'s text, each followed by a
    comma (``""`` when none)."""
    consumer = entity.consumer
    head = "" if consumer is None else f'"consumer":{canonical.string(consumer)},'
    if entity.attempts:  # rare: only after a consumer died holding a message
        return f'"attempts":{canonical.dumps(entity.attempts)},{head}'
    return head


def _tail(entity: Entity) -> str:
    """The optional ``tokens`` key of :func:`encode_entity`'s text, after the state,
    with its leading comma (``""`` when no entry has tokens)."""
    tokens = entity.tokens
    if not tokens:
        return ""
    return f',"tokens":{canonical.dumps({m: t.to_json() for m, t in tokens.items()})}'


def head_size(entity: Entity) -> int:
    """UTF-8 bytes of the optional top-level keys of ``entity``'s text (``attempts``,
    ``consumer``, ``tokens``)."""
    head = _head(entity) + _tail(entity)
    return len(head) if head.isascii() else len(head.encode("utf-8"))


def encode_entity(entity: Entity) -> str:
    """``canonical_json({"attempts": ..., "consumer": ..., "outbox": {id: entry},
    "state": ..., "tokens": ...})`` (``attempts`` and ``tokens`` only when not empty,
    ``consumer`` only when set),
    composed from its parts' texts. Raises ``ValueError`` when the state or a message
    body is not JSON-compatible.
    """
    kept, marks = entity._state_text, entity.marks
    try:
        state = kept[1] if kept is not None and kept[0] is entity.state else None
        if state is None:
            state = canonical.dumps(entity.state, "state")
        outbox = entity.outbox
        if not outbox:
            entries = ""
        elif len(outbox) == 1:
            ((mid, entry),) = outbox.items()
            entries = f"{canonical.string(mid)}:{_entry_text(entry, marks.get(mid))}"
        else:
            entries = ",".join(
                [
                    f"{canonical.string(mid)}:{_entry_text(entry, marks.get(mid))}"
                    for mid, entry in sorted(outbox.items())
                ]
            )
    except InvalidValue as exc:
        raise InvalidValue(f"entity {entity.id!r:.80}: {exc}") from None
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"entity {entity.id!r:.80} is not JSON-compatible (state and message bodies must "
            f"be dicts, lists, str, int, float, bool or None): {exc}"
        ) from None
    return f'{{{_head(entity)}"outbox":{{{entries}}},"state":{state}{_tail(entity)}}}'


#: How :func:`encode_entity`'s text continues after its optional keys when the outbox
#: is empty: the state follows.
_EMPTY_OUTBOX = '"outbox":{},"state":'
#: How the text starts when it records a consumer, whose JSON string follows.
_CONSUMER = '{"consumer":"'


def decode_entity(entity_id: str, text: str | bytes, version: Any) -> Entity:
    """The inverse of :func:`encode_entity`."""
    if type(text) is str and text.endswith("}"):
        # Most entities have an empty outbox: decode the state alone (and the consumer's
        # string as is when it holds no escape).
        consumer: str | None = None
        start = 1
        if text.startswith(_CONSUMER):
            end = text.find('"', len(_CONSUMER))
            if end > 0 and "\\" not in text[len(_CONSUMER) : end]:
                consumer = text[len(_CONSUMER) : end]
                start = end + 2  # past '",'
            else:
                start = -1
        if start > 0 and text.startswith(_EMPTY_OUTBOX, start) and text[start - 1] in "{,":
            source = text[start + len(_EMPTY_OUTBOX) : -1]
            try:
                state = canonical.loads(source)
            except ValueError:
                state = None  # not this layout after all: decode the whole text
            if type(state) is dict:
                entity = Entity(entity_id, state, {}, version, {}, consumer)
                entity._loaded = (state, source)
                return entity
    data = canonical.loads(text)
    outbox: Outbox = {}
    marks: dict[str, EntryMark] = {}
    for mid, entry in data.get("outbox", {}).items():
        if entry is None:
            outbox[mid] = None
            continue
        outbox[mid] = [OutgoingMessage.from_json(m) for m in entry["out"]]
        if "at" in entry:
            marks[mid] = EntryMark(int(entry["at"]), entry.get("run"))
    attempts = {str(mid): int(n) for mid, n in data.get("attempts", {}).items()}
    consumer = data.get("consumer")
    tokens = {str(mid): EntryTokens.from_json(t) for mid, t in data.get("tokens", {}).items()}
    return Entity(
        entity_id, dict(data.get("state", {})), outbox, version, marks, consumer, attempts, tokens
    )


class EntityRecord(NamedTuple):
    """What a backend stores for one entity: the encoded body and scan metadata."""

    id: str
    body: str
    version: Any
    bucket: int
    pending: bool
    #: ``body`` encoded as UTF-8, in bytes (measured once, by the size check).
    size: int = 0


def groups_by_size(
    items: Sequence[T], max_bytes: int, size: Callable[[T], int]
) -> Iterator[list[T]]:
    """``items`` in order, in consecutive groups of at most ``max_bytes`` (by ``size``).

    An item larger than ``max_bytes`` alone makes a group of its own.
    """
    group: list[T] = []
    total = 0
    for item in items:
        n = size(item)
        if group and total + n > max_bytes:
            yield group
            group, total = [], 0
        group.append(item)
        total += n
    if group:
        yield group


class EntityStore(Client):
    """Entities, one record each, saved under an optimistic-concurrency token.

    Guarantees (every backend, checked by :mod:`dedupstore.testing`):

    * :meth:`save` writes only if nobody saved the entity since it was loaded (two
      creators of one new entity included), else raises ``ConcurrencyConflict``;
    * :meth:`save_many` saves each entity under its own token and returns the ids
      that conflicted; no entity is ever half-written;
    * reads are strongly consistent; ids follow the message-id rules
      (``InvalidMessageId`` before any I/O); an entity larger than
      :attr:`max_entity_bytes` raises ``EntityTooLarge`` before any I/O;
    * :meth:`pending_outboxes` segments are disjoint and complete.
    """

    #: Largest encoded entity (UTF-8 bytes of the canonical JSON) a record holds.
    max_entity_bytes: ClassVar[int] = 4 * 1024 * 1024
    #: Largest number of ids handed to one :meth:`_load` call: one answer holds at most
    #: ``max_load_batch * max_entity_bytes`` bytes.
    max_load_batch: ClassVar[int] = 100
    #: Largest number of records handed to one :meth:`_save` call (the backend may split
    #: them by bytes); set higher where one request saves them all (one flush).
    max_save_batch: ClassVar[int] = 100

    declared_options: ClassVar[OptionSet] = Client.declared_options
    primitives: ClassVar[tuple[str, ...]] = (
        "_load",
        "_save",
        "_load_with",
        "_save_with",
        "_save_unless",
        "_load_with_token",
        "_save_tokens",
    )

    # ------------------------------------------------------------------ public API
    # Each call is written once as steps (``_<name>_steps``), run in place here and
    # awaited by :class:`dedupstore.aio.AsyncEntityStore` and the async processor; a
    # primitive written as steps runs natively there (:meth:`Client._primitive`).

    def load(self, entity_id: str) -> Entity:
        """The entity (a new empty one, ``version None``, when absent). Raises
        ``InvalidMessageId`` before any I/O, ``StoreUnavailable``."""
        return run(self._load_steps(entity_id))

    def _load_steps(self, entity_id: str) -> Steps[Entity]:
        eid = validate_message_id(entity_id, "entity id")
        return (yield from self._load_many_steps([eid]))[eid]

    def load_many(self, entity_ids: Iterable[str]) -> dict[str, Entity]:
        """Every entity by id (absent ones new and empty); one round trip per chunk."""
        return run(self._load_many_steps(entity_ids))

    def _load_many_steps(self, entity_ids: Iterable[str]) -> Steps[dict[str, Entity]]:
        ids = list(dict.fromkeys(validate_ids(entity_ids, "entity id")))
        self.check_open()
        result: dict[str, Entity] = {}
        for start in range(0, len(ids), self.max_load_batch):
            chunk = ids[start : start + self.max_load_batch]
            with self.translating_errors("load"):
                found = yield from self._primitive("_load", chunk)
            for eid in chunk:
                record = found.get(eid)
                result[eid] = (
                    Entity(eid) if record is None else decode_entity(eid, record[0], record[1])
                )
        return result

    def save(self, entity: Entity) -> Entity:
        """Save ``entity`` if nobody saved it since it was loaded; return it (new version).
        Raises ``ConcurrencyConflict`` otherwise (reload and retry),
        ``EntityTooLarge``/``InvalidMessageId`` before any I/O, ``StoreUnavailable``."""
        return run(self._save_steps(entity))

    def _save_steps(self, entity: Entity) -> Steps[Entity]:
        record = self._record(entity, plain_ids([entity.id, *entity.outbox]))
        self.check_open()
        with self.translating_errors("save"):
            versions = yield from self._primitive("_save", [record])
        _take_version(entity, versions)
        return entity

    def save_many(self, entities: Sequence[Entity]) -> set[str]:
        """Save each entity under its own token; return the ids that conflicted (the others
        are saved, their ``version`` updated in place). Every entity is checked before any
        I/O; none is half-written. Raises what :meth:`save` raises but the conflict."""
        return run(self._save_many_steps(entities))

    def _save_many_steps(self, entities: Sequence[Entity]) -> Steps[set[str]]:
        checked = plain_ids([e.id for e in entities] + [m for e in entities for m in e.outbox])
        make = self._record
        records = [make(entity, checked) for entity in entities]
        if len({r.id for r in records}) != len(records):
            raise InvalidMessageId("save_many got the same entity id twice")
        self.check_open()
        by_id = {entity.id: entity for entity in entities}
        conflicts: set[str] = set()
        size = self.max_save_batch
        for start in range(0, len(records), size):
            chunk = records[start : start + size]
            with self.translating_errors("save"):
                versions = yield from self._primitive("_save", chunk)
            for record in chunk:
                if record.id in versions:
                    by_id[record.id].version = versions[record.id]
                else:
                    conflicts.add(record.id)
        return conflicts

    # ------------------------------------------------------------------ with a deduplication store

    #: The deduplication store class this store can share requests with (set by a
    #: backend that implements :meth:`_load_with` and :meth:`_save_with`).
    joins: ClassVar[type[Client] | None] = None

    def _joined(self, dedup: DeduplicationStore) -> bool:
        """Whether one request can do the work of this store and ``dedup`` together:
        ``dedup`` is of the class :attr:`joins` and shares this store's connection.
        Then :meth:`_load_checked`, :meth:`_save_checked` and :meth:`_save_recording`
        cost one round trip instead of two. The processor asks once; the calls assume it.
        """
        return (
            self.joins is not None
            and isinstance(dedup, self.joins)
            and self._shares_connection_with(dedup)
        )

    def _load_checked(
        self, entity_id: str, dedup: DeduplicationStore, key: str
    ) -> tuple[Entity, bool]:
        """The entity and whether ``key`` is recorded in ``dedup``, in one round trip.

        Only for a joined ``dedup`` (:meth:`_joined`). Raises what :meth:`load` and
        ``has_been_processed`` raise.
        """
        return run(self._load_checked_steps(entity_id, dedup, key))

    def _load_checked_steps(
        self, entity_id: str, dedup: DeduplicationStore, key: str
    ) -> Steps[tuple[Entity, bool]]:
        eid = validate_message_id(entity_id, "entity id")
        mid = validate_message_id(key)
        self.check_open()
        dedup.check_open()
        with self.translating_errors("load_and_check"):
            found, recorded = yield from self._primitive("_load_with", dedup, eid, mid)
        entity = Entity(eid) if found is None else decode_entity(eid, found[0], found[1])
        return entity, recorded

    def _save_recording(self, entity: Entity, dedup: DeduplicationStore, key: str) -> None:
        """``dedup.add(key)`` then :meth:`save` of ``entity``, in one atomic request.

        Only for a joined ``dedup`` (:meth:`_joined`). Raises ``ConcurrencyConflict``
        when the entity changed since it was loaded (``key`` is recorded all the same:
        the entry stays in the stored outbox for a retry), and what ``add`` and
        :meth:`save` raise.
        """
        run(self._save_recording_steps(entity, dedup, key))

    def _save_recording_steps(
        self, entity: Entity, dedup: DeduplicationStore, key: str
    ) -> Steps[None]:
        mid, record = self._joint_record(entity, dedup, key)
        versions: dict[str, Any] = {}

        def write(request: WriteRequest) -> Steps[set[str]]:
            added, saved = yield from self._primitive("_save_with", dedup, request, record)
            versions.update(saved)
            return cast(set[str], added)

        yield from dedup._write_chunk([mid], single=True, write=write, operation="add_and_save")
        _take_version(entity, versions)

    def _save_checked(self, entity: Entity, dedup: DeduplicationStore, key: str) -> bool:
        """Save ``entity`` unless ``dedup`` holds ``key``, in one request; whether it held it.

        Only for a joined ``dedup`` (:meth:`_joined`). True: the message is a duplicate
        and nothing was written. A save whose earlier attempt wrote it (a lost answer)
        reports False even when the id got recorded since. Raises what :meth:`save`
        and ``has_been_processed`` raise.
        """
        return run(self._save_checked_steps(entity, dedup, key))

    def _save_checked_steps(
        self, entity: Entity, dedup: DeduplicationStore, key: str
    ) -> Steps[bool]:
        mid, record = self._joint_record(entity, dedup, key)
        with self.translating_errors("check_and_save"):
            recorded, versions = yield from self._primitive("_save_unless", dedup, mid, record)
        if not recorded:
            _take_version(entity, versions)
        return bool(recorded)

    def _joint_record(
        self, entity: Entity, dedup: DeduplicationStore, key: str
    ) -> tuple[str, EntityRecord]:
        """A joint save's id and record, checked before any I/O; both stores open."""
        mid = validate_message_id(key)
        record = self._record(entity)
        self.check_open()
        dedup.check_open()
        return mid, record

    def _load_with(
        self, dedup: DeduplicationStore, entity_id: str, key: str
    ) -> Stepped[tuple[tuple[str, Any] | None, bool]]:
        """Joined backends: ``_load([entity_id])``'s record (or None) and whether
        ``dedup`` holds a live record of ``key``, read in one round trip."""
        raise NotImplementedError

    def _save_with(
        self, dedup: DeduplicationStore, request: WriteRequest, record: EntityRecord
    ) -> Stepped[tuple[set[str], dict[str, Any]]]:
        """Joined backends, atomically in one request: ``dedup._add_new(request)``,
        then ``_save([record])``; both results. Nothing of the save is written if the
        add fails."""
        raise NotImplementedError

    def _save_unless(
        self, dedup: DeduplicationStore, key: str, record: EntityRecord
    ) -> Stepped[tuple[bool, dict[str, Any]]]:
        """Joined backends, atomically in one request: whether ``dedup`` holds a live
        record of ``key``, and if not (or if this call's earlier attempt saved the
        record), ``_save([record])``'s result; nothing written when it does."""
        raise NotImplementedError

    # ------------------------------------------------------------------ with a token store

    #: The token store class this store can share requests with (set by a backend
    #: that implements :meth:`_save_tokens`).
    token_joins: ClassVar[type[Client] | None] = None
    #: Most token ids one entity's joint save may name (None: the token store's
    #: ``max_batch``); see :meth:`joint_token_limit`.
    max_joint_tokens: ClassVar[int | None] = None

    def joint_token_limit(self, tokens: TokenStore) -> int:
        """Most token ids one entity's :meth:`_save_tokened` may name with ``tokens``: the
        token store's ``max_batch``, or less where the joint request holds fewer
        (:attr:`max_joint_tokens`)."""
        own = self.max_joint_tokens
        return tokens.max_batch if own is None else min(own, tokens.max_batch)

    def _tokens_joined(self, tokens: TokenStore) -> bool:
        """Whether one request can save entities and write ``tokens`` together:
        ``tokens`` is of the class :attr:`token_joins` and shares this store's
        connection. Then :meth:`_save_tokened` folds token-mode steps into the saves.
        The processor asks once; the calls assume it."""
        return (
            self.token_joins is not None
            and isinstance(tokens, self.token_joins)
            and self._shares_connection_with(tokens)
        )

    def _load_tokened(
        self, entity_id: str, tokens: TokenStore, token_id: str
    ) -> tuple[Entity, bool]:
        """The entity, then whether the token ``token_id`` exists (read after it), in
        one round trip. Only for a joined ``tokens`` (:meth:`_tokens_joined`). Raises
        what :meth:`load` and ``tokens.present`` raise."""
        return run(self._load_tokened_steps(entity_id, tokens, token_id))

    def _load_tokened_steps(
        self, entity_id: str, tokens: TokenStore, token_id: str
    ) -> Steps[tuple[Entity, bool]]:
        eid = validate_message_id(entity_id, "entity id")
        tid = validate_message_id(token_id, "token id")
        self.check_open()
        tokens.check_open()
        with self.translating_errors("load_and_read_token"):
            found, present = yield from self._primitive("_load_with_token", tokens, eid, tid)
        entity = Entity(eid) if found is None else decode_entity(eid, found[0], found[1])
        return entity, present

    def _save_tokened(
        self,
        entities: Sequence[Entity],
        tokens: TokenStore,
        changes: Mapping[str, TokenChange],
    ) -> tuple[set[str], set[str]]:
        """:meth:`save_many` of ``entities``, each atomically with its token change
        (``changes[entity id]``, none for an id not there): an entity whose ``require``
        token is absent is not saved; one saved gets its tokens created and deleted in
        the same request, one not saved none. Returns ``(missing, conflicts)``: the ids
        not saved because a required token was absent, and because the save conflicted;
        nothing of either was written.

        Only for a joined ``tokens`` (:meth:`_tokens_joined`). One request per chunk of
        at most :attr:`max_save_batch` entities and ``tokens.max_batch`` token ids (a
        backend may split a chunk further by bytes; each entity stays whole). Raises
        ``InvalidMessageId`` and ``EntityTooLarge`` before any I/O, ``ValueError`` for
        one entity's change naming more than :meth:`joint_token_limit` ids, and
        ``StoreUnavailable`` (the chunks before it are written).
        """
        return run(self._save_tokened_steps(entities, tokens, changes))

    def _save_tokened_steps(
        self,
        entities: Sequence[Entity],
        tokens: TokenStore,
        changes: Mapping[str, TokenChange],
    ) -> Steps[tuple[set[str], set[str]]]:
        records = [self._record(entity) for entity in entities]
        limit = self.joint_token_limit(tokens)
        writes: dict[str, TokenWrites] = {}
        for eid, change in changes.items():
            if change.size > limit:
                raise ValueError(
                    f"entity {eid!r:.80}: a joint save names {change.size} tokens; at most "
                    f"{limit} fit in one request (joint_token_limit)"
                )
            writes[eid] = tokens._writes(change)
        self.check_open()
        tokens.check_open()
        by_id = {entity.id: entity for entity in entities}
        missing: set[str] = set()
        conflicts: set[str] = set()
        chunk: list[EntityRecord] = []
        named = 0

        def flush() -> Steps[None]:
            with self.translating_errors("save_with_tokens"):
                absent, versions = yield from self._primitive(
                    "_save_tokens",
                    tokens,
                    chunk,
                    {r.id: writes[r.id] for r in chunk if r.id in writes},
                )
            for record in chunk:
                if record.id in versions:
                    by_id[record.id].version = versions[record.id]
                elif record.id in absent:
                    missing.add(record.id)
                else:
                    conflicts.add(record.id)

        for record in records:
            size = changes[record.id].size if record.id in changes else 0
            if chunk and (len(chunk) >= self.max_save_batch or named + size > limit):
                yield from flush()
                chunk, named = [], 0
            chunk.append(record)
            named += size
        if chunk:
            yield from flush()
        return missing, conflicts

    def _load_with_token(
        self, tokens: TokenStore, entity_id: str, token_id: str
    ) -> Stepped[tuple[tuple[str, Any] | None, bool]]:
        """Token-joined backends: ``_load([entity_id])``'s record (or None), then whether
        the token ``token_id`` exists, read after it, in one round trip."""
        raise NotImplementedError

    def _save_tokens(
        self,
        tokens: TokenStore,
        records: list[EntityRecord],
        writes: Mapping[str, TokenWrites],
    ) -> Stepped[tuple[set[str], dict[str, Any]]]:
        """Token-joined backends: per record, atomically (one request for them all
        where it can): if ``writes[record.id].require`` names a token that is absent,
        nothing (its id is in the first set returned); else ``_save([record])``, and if
        that wrote it, ``tokens._create`` and ``tokens._delete`` of its writes. Returns
        the ids refused for a missing token and ``{id: new version}`` of the records
        saved. A record an earlier attempt of this very call saved (its answer lost)
        counts as saved, its token writes not made again."""
        raise NotImplementedError

    def pending_outboxes(self, segment: int = 0, segments: int = 1) -> Iterator[Entity]:
        """Entities whose outbox is not empty, in segment ``segment`` of ``segments``.

        Segments are disjoint and complete (by :func:`bucket_of`, or the database's
        own parallel scan). Streams page by page; each entity is as of its page's read
        (a stale one only costs a conflict). Raises ``ValueError`` for bad segments,
        ``StoreUnavailable``.
        """
        if not (isinstance(segments, int) and isinstance(segment, int) and segments >= 1):
            raise ValueError(f"segments must be an int >= 1, got {segments!r}")
        if not 0 <= segment < segments:
            raise ValueError(f"segment must be in 0..{segments - 1}, got {segment!r}")
        self.check_open()
        iterator = self._scan(segment, segments)
        while True:
            with self.translating_errors("scan"):
                item = next(iterator, None)
            if item is None:
                return
            eid, body, version = item
            yield decode_entity(eid, body, version)

    # ------------------------------------------------------------------ primitives

    @abc.abstractmethod
    def _load(self, ids: list[str]) -> Stepped[dict[str, tuple[str, Any]]]:
        """``{id: (body, version)}`` for the ids that exist; strongly consistent."""

    @abc.abstractmethod
    def _save(self, records: list[EntityRecord]) -> Stepped[dict[str, Any]]:
        """Write each record whose stored version is ``record.version`` (absent if None).

        Per record, atomically: compare the token and write the whole record, or
        write nothing. Return ``{id: new version}`` for the records written; the
        others conflicted.
        """

    @abc.abstractmethod
    def _scan(self, segment: int, segments: int) -> Iterator[tuple[str, str, Any]]:
        """``(id, body, version)`` of the pending entities whose bucket % segments == segment."""

    # ------------------------------------------------------------------ helpers

    def _record(self, entity: Entity, checked: bool = False) -> EntityRecord:
        """The record of ``entity``; ``checked``: its ids are known to be plain valid ids."""
        if checked:
            eid = entity.id
        else:
            eid = validate_message_id(entity.id, "entity id")
            for mid in entity.outbox:
                validate_message_id(mid)
        body = encode_entity(entity)
        size = len(body) if body.isascii() else len(body.encode("utf-8"))
        if size > self.max_entity_bytes:
            raise EntityTooLarge(
                f"entity {eid!r:.80} encodes to {size} bytes; {type(self).__name__} holds at "
                f"most {self.max_entity_bytes} bytes per entity (nothing was written)"
            )
        return EntityRecord(eid, body, entity.version, bucket_of(eid), bool(entity.outbox), size)


def _take_version(entity: Entity, versions: dict[str, Any]) -> None:
    """Give ``entity`` its new version from a save's answer, or raise its conflict."""
    if entity.id not in versions:
        raise ConcurrencyConflict(
            f"entity {entity.id!r:.80} was saved by someone else since it was loaded"
        )
    entity.version = versions[entity.id]
