"""The fast canonical JSON (:mod:`dedupstore.canonical`) gives the reference's bytes.

The reference is the standard library with the canonical settings. Every value
hypothesis draws (floats of every magnitude, NaN and infinities, integers beyond 64
bits, non-ASCII and control characters, int keys, tuples, deep nesting) must encode
to the same text or fail the same way, and decode to the same value, integers exact.
An anti-test shows the property catches a plain ``orjson`` encoder.
"""

from __future__ import annotations

import copy
import enum
import json
import math
import struct
import uuid
from collections.abc import Callable
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dedupstore import canonical
from dedupstore.dispatch import CallableDispatcher
from dedupstore.entities import (
    EntryMark,
    OutgoingMessage,
    body_text,
    canonical_json,
    encode_entity,
    message_text,
)
from dedupstore.errors import InvalidValue
from dedupstore.ids import OUTGOING_NAMESPACE, outgoing_id

pytestmark = pytest.mark.memory


def reference(value: Any) -> str:
    """The standard library's canonical text; a dict key that is not ``str`` refused
    (``ValueError``, as ``InvalidValue`` is one), where the library writes it as text."""
    if _other_key(value):
        raise ValueError("dict keys must be str")
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    )


def _other_key(value: Any) -> bool:
    """Whether ``value`` holds a dict key that is not ``str``, at any depth."""
    if isinstance(value, dict):
        return any(not isinstance(k, str) or _other_key(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return any(_other_key(v) for v in value)
    return False


# text with every kind of character, control characters and lone surrogates included
_text = st.text(st.characters(codec=None, categories=None), max_size=12) | st.sampled_from(
    ["", "e-5", "1e-7,", "null", "\x00\x1f\x7f\u2028", "\ud800", "é😀"]
)
_floats = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(
    [1e-7, -2.5e-5, 1e16, 1e22, 5e-324, -0.0, 1e-10, 123456789012345678.0]
)
_ints = st.integers() | st.sampled_from(
    [2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1]
)
_scalars = st.none() | st.booleans() | _ints | _floats | _text
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=3).map(tuple)
        | st.dictionaries(_text, inner, max_size=4)
        | st.dictionaries(st.integers(-5, 5), inner, max_size=2)
    ),
    max_leaves=12,
)


def outcome(fn: Callable[[Any], Any], value: Any) -> tuple[str, Any]:
    try:
        return "ok", fn(value)
    except (TypeError, ValueError) as exc:
        return "error", type(exc).__name__ if not isinstance(exc, ValueError) else "ValueError"


def exact(value: Any) -> Any:
    """``value`` with types made visible (so 1 and 1.0 and True differ)."""
    if isinstance(value, dict):
        return {k: exact(v) for k, v in value.items()}
    if isinstance(value, list):
        return [exact(v) for v in value]
    return (type(value).__name__, value if not isinstance(value, float) else value.hex())


@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_values)
def test_dumps_gives_the_reference_text(value: Any) -> None:
    assert outcome(canonical.dumps, value) == outcome(reference, value)
    assert outcome(canonical_json, value) == outcome(reference, value)


@settings(max_examples=1000, deadline=None)
@given(_values)
def test_loads_and_normalized_give_the_reference_values(value: Any) -> None:
    try:
        text = reference(value)
        text.encode("utf-8")
    except (TypeError, ValueError):
        return
    assert exact(canonical.loads(text)) == exact(json.loads(text))
    assert exact(canonical.loads(text.encode("utf-8"))) == exact(json.loads(text))
    normal, normal_text = canonical.normalized(value)
    assert exact(normal) == exact(json.loads(text))
    assert normal_text == reference(json.loads(text))  # the text encoding it again gives
    # the processor's outgoing bodies: the same text, the value decoded from it or kept
    lazy, lazy_text = canonical._normalized_text(value)
    assert lazy_text == normal_text
    lazy = canonical.loads(lazy_text) if lazy is canonical._UNDECODED else lazy
    assert exact(lazy) == exact(normal)
    copied = canonical.copy(json.loads(text))
    assert exact(copied) == exact(json.loads(text))


@settings(max_examples=3000, deadline=None)
@given(st.integers(0, 2**64 - 1))
def test_every_float_bit_pattern_gives_the_reference_text(bits: int) -> None:
    value = struct.unpack("<d", bits.to_bytes(8, "little"))[0]
    for shaped in (value, [value, "x"], {"a": value}):
        assert outcome(canonical.dumps, shaped) == outcome(reference, shaped)


def test_the_cases_orjson_gets_wrong_on_its_own() -> None:
    """Each case where plain orjson differs: the reference's text or error instead."""
    assert canonical.dumps([1e-7, 2.5e-5, 1e-5, 1e-4]) == "[1e-07,2.5e-05,1e-05,0.0001]"
    assert canonical.dumps({"e-5": "1e-7,"}) == '{"e-5":"1e-7,"}'
    assert canonical.dumps(2**64) == str(2**64)
    with pytest.raises(InvalidValue, match=r"^value\[2\]: dict keys must be str"):
        canonical.dumps({2: "a", 1: None})  # the reference writes '{"1":null,"2":"a"}'
    assert canonical.dumps([None, (1, 2)]) == "[null,[1,2]]"
    for bad in (math.nan, [math.inf], {"a": [None, -math.inf]}):
        with pytest.raises(ValueError):
            canonical.dumps(bad)
    deep: Any = "x"
    for _ in range(300):
        deep = [deep]
    assert canonical.dumps(deep) == reference(deep)
    circular: list[Any] = []
    circular.append(circular)
    with pytest.raises(ValueError, match="Circular"):
        canonical.dumps(circular)
    with pytest.raises(TypeError):
        canonical.dumps({"when": object()})
    # integers beyond 64 bits decode exact (orjson alone reads them as floats)
    assert canonical.loads(f"[{2**70},{-(2**65)}]") == [2**70, -(2**65)]
    assert canonical.loads('"\\ud800"') == "\ud800"


def test_uuids_and_enums_encode_as_orjson_does_whichever_path() -> None:
    class Colour(enum.Enum):
        RED = "red"

    ident = uuid.UUID(int=7)
    assert canonical.dumps({"id": ident, "c": Colour.RED}) == (
        '{"c":"red","id":"00000000-0000-0000-0000-000000000007"}'
    )
    # a value orjson refuses sends it to the reference path: the same text
    assert canonical.dumps({"1": ident, "2": Colour.RED, "n": 2**64}) == (
        f'{{"1":"00000000-0000-0000-0000-000000000007","2":"red","n":{2**64}}}'
    )


def test_a_plain_orjson_encoder_fails_the_property() -> None:
    """Anti-test: the property above catches an encoder that trusts orjson alone."""

    def plain(value: Any) -> str:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()

    caught = []
    for value in ([1e-7], [2.5e-5], math.nan, {1: 2}, 2**64):
        if outcome(plain, value) != outcome(reference, value):
            caught.append(value)
    assert len(caught) == 5


@settings(max_examples=500, deadline=None)
@given(
    st.dictionaries(_text, _values, max_size=3),
    st.dictionaries(
        st.text(min_size=1, max_size=8).filter(lambda t: "\x00" not in t),
        st.none()
        | st.lists(
            st.tuples(_values, st.dictionaries(st.text(max_size=3), st.text(max_size=3))),
            max_size=2,
        ),
        max_size=3,
    ),
    st.booleans(),
)
def test_an_entity_encodes_as_the_reference_would(
    state: dict[str, Any], outbox: dict[str, Any], marked: bool
) -> None:
    """encode_entity composes its text from parts: the reference's text of the whole."""
    from dedupstore.entities import Entity

    entity = Entity("e", state)
    for position, (mid, entry) in enumerate(outbox.items()):
        if entry is None:
            entity.outbox[mid] = None
            continue
        made = []
        for n, (body, headers) in enumerate(entry):
            ok, normal = outcome(canonical.normalized, body)
            if ok == "ok":  # as the processor makes them: the body's text kept
                made.append(OutgoingMessage._encoded(f"{mid}{n}", "dest", *normal, headers))
            else:
                made.append(OutgoingMessage(f"{mid}{n}", "dest", body, headers))
        entity.outbox[mid] = made
        if marked:
            entity.marks[mid] = EntryMark(
                1_700_000_000_000 + position, "run-1" if position else None
            )
    whole = {
        "state": state,
        "outbox": {
            mid: None
            if entry is None
            else {
                **(_mark_fields(entity.marks[mid]) if mid in entity.marks else {}),
                "out": [m.to_json() for m in entry],
            }
            for mid, entry in entity.outbox.items()
        },
    }
    expected = outcome(reference, whole)
    got = outcome(encode_entity, entity)
    assert got == expected
    for entry in entity.outbox.values():
        for m in entry or ():
            assert outcome(message_text, m) == outcome(reference, m.to_json())
            assert outcome(body_text, m) == outcome(reference, m.body)


def _mark_fields(mark: EntryMark) -> dict[str, Any]:
    """The fields a mark adds to a pending entry (the documented layout)."""
    return {"at": mark.at} if mark.run is None else {"at": mark.at, "run": mark.run}


def test_a_kept_state_text_is_used_only_for_the_object_it_was_made_from() -> None:
    from dedupstore.entities import Entity

    entity = Entity("e")
    state, text = canonical.normalized({"n": 1})
    entity._set_state(state, text)
    assert encode_entity(entity) == '{"outbox":{},"state":{"n":1}}'
    entity.state = {"n": 2}  # replaced: the kept text is not this state's
    assert encode_entity(entity) == '{"outbox":{},"state":{"n":2}}'
    copied = copy.copy(entity)
    copied.state = {"n": 3}
    assert encode_entity(copied) == '{"outbox":{},"state":{"n":3}}'


@given(st.text(max_size=20), st.text(min_size=1, max_size=20), st.integers(-1, 50))
def test_outgoing_ids_are_uuid5(consumer: str, cid: str, position: int) -> None:
    name = f"{consumer}\x00{cid}\x00mid\x00{position}"
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return
    expected = str(uuid.uuid5(OUTGOING_NAMESPACE, name))
    assert outgoing_id(consumer, cid, "mid", position) == expected
    assert outgoing_id(consumer, cid, "mid", position) == expected, "the same id every time"


def test_a_deep_copy_of_a_state_shares_nothing() -> None:
    state = {"a": [1, {"b": None}], "c": {"d": 1.5}}
    copied = canonical.copy(state)
    assert copied == state
    copied["a"][1]["b"] = 2
    assert state["a"][1]["b"] is None
    assert canonical.copy({"x": math.nan})["x"] != canonical.copy({"x": math.nan})["x"]
    big = {"n": 2**80}
    assert canonical.copy(big) == big and canonical.copy(big) is not big
    assert copy.deepcopy(state) == canonical.copy(state)


def test_what_the_processor_saves_is_what_a_reload_encodes_again() -> None:
    """A body and a state orjson refuses (an integer beyond 64 bits) or writes
    differently (1e-05, a tuple): the text the processor keeps and saves is the one the
    reloaded entity encodes to, so a re-dispatch after a reload sends the same bytes."""
    from dedupstore import open_entity_store, open_store
    from dedupstore.outbox import Message, OutboxProcessor, Send

    tag = uuid.uuid4().hex
    entities = open_entity_store(f"memory://canonical-e-{tag}")
    dedup = open_store(f"memory://canonical-d-{tag}")

    def refuse(messages: Any) -> None:
        raise ConnectionError("the broker is down: the entry stays pending")

    def handler(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
        return {"2": "b", "1": 2**65, "10": (1e-5, None)}, [
            Send("out", {"2": "b", "1": 2**70, "10": ("c",)})
        ]

    processor = OutboxProcessor(entities, dedup, CallableDispatcher(refuse))
    with pytest.raises(ConnectionError):
        processor.process_batch([Message("m1", "e1", {})], handler)
    saved, _ = entities._load(["e1"])["e1"]  # type: ignore[attr-defined]
    reloaded = entities.load("e1")
    assert encode_entity(reloaded) == saved
    assert '"body":{"1":1180591620717411303424,"10":["c"],"2":"b"}' in saved
    assert '"state":{"1":36893488147419103232,"10":[1e-05,null],"2":"b"}' in saved


_HEADER_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=8)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    headers=st.dictionaries(_HEADER_TEXT, _HEADER_TEXT, max_size=4),
    body=st.dictionaries(
        st.text(max_size=5),
        st.one_of(
            st.integers(), st.text(max_size=5), st.floats(allow_nan=False, allow_infinity=False)
        ),
        max_size=4,
    ),
    destination=st.sampled_from(["out", "Ωmega", "a:b/c", "x" * 200]),
)
def test_a_processor_made_message_dispatches_as_the_same_fields_would(
    headers: dict[Any, Any], body: dict[str, Any], destination: str
) -> None:
    """``encode_messages`` takes the texts the processor kept (skipping the checks it
    made): they are the texts of a plain message of the same fields, checked."""
    from dedupstore import open_entity_store, open_store
    from dedupstore.dispatch import encode_messages
    from dedupstore.entities import OutgoingMessage
    from dedupstore.outbox import Message, OutboxProcessor, Send

    tag = uuid.uuid4().hex
    sent: list[OutgoingMessage] = []
    processor = OutboxProcessor(
        open_entity_store(f"memory://made-e-{tag}"),
        open_store(f"memory://made-d-{tag}"),
        CallableDispatcher(sent.extend),
    )
    processor.process(Message("m1", "e1", {}), lambda s, m: (s, [Send(destination, body, headers)]))
    (made,) = sent
    assert made._body_text is not None  # the processor's: the kept texts are used
    plain = OutgoingMessage(made.id, made.destination, made.body, dict(made.headers))
    ((fast,), (checked,)) = encode_messages([made]), encode_messages([plain])
    assert (fast.body, fast.headers) == (checked.body, checked.headers)
    assert fast.decoded() == checked.decoded()
