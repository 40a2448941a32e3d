"""Canonical JSON, encoded and decoded fast: :func:`dumps`, :func:`loads`, :func:`normalized`.

The canonical form is the standard library's ``json.dumps(value, sort_keys=True,
separators=(",", ":"), ensure_ascii=False, allow_nan=False)``. ``orjson`` writes the
same bytes ten times faster for almost every value; where it would not (a float below
``1e-4`` in magnitude, NaN or infinity, integers beyond 64 bits, subclasses of ``str``,
``int``, ``dict`` or ``list``, nesting deeper than 254) the standard library encodes.
``uuid.UUID`` encodes as its text, an enum member as its value. A dict key that is not
``str``, a dataclass or a pydantic model is refused (:class:`~dedupstore.errors.InvalidValue`,
a ``TypeError`` naming its path, found by a walk only when ``orjson`` refused the value);
NaN, infinity or a circular reference raise ``ValueError``.

Decoding is ``orjson`` unless the text holds a run of 19 digits (an integer it might
read as a float) or something it refuses: then the standard library, exact.
"""

from __future__ import annotations

import copy as _copy
import dataclasses
import enum
import json
import re
import uuid
from typing import Any

import orjson

from dedupstore.errors import InvalidValue

__all__ = ["check", "copy", "dumps", "dumps_bytes", "loads", "normalized", "string"]

_OPTIONS = (
    orjson.OPT_SORT_KEYS
    | orjson.OPT_PASSTHROUGH_SUBCLASS
    | orjson.OPT_PASSTHROUGH_DATETIME
    | orjson.OPT_PASSTHROUGH_DATACLASS
)


def _extra(value: Any) -> Any:
    """What the standard library encodes for the types ``orjson`` knows beyond JSON."""
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, enum.Enum):
        return value.value
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _refuse(value: Any) -> Any:
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


_REFERENCE = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False, default=_extra
)
#: A number orjson writes with a one-digit negative exponent (``1e-7``; the reference:
#: ``1e-07``); ``0.00001`` for ``1e-05`` is found by ``"0.0000" in``. (A string may
#: match too: the reference then encodes it, to the same text.)
_SHORT_EXPONENT = re.compile(r"e-[0-9](?:[,}\]]|$)")
#: ``bytes.translate`` table: digits stay ``0``, everything else becomes a space.
_DIGITS = bytes(48 if 48 <= i <= 57 else 32 for i in range(256))
_LONG_NUMBER = "0" * 19


def _fast(value: Any, name: str) -> tuple[str, bytes, Any] | None:
    """``orjson``'s encoding when it is the canonical text (as text and as bytes),
    else ``None``; with the decoded value when checking the text decoded it (else
    ``_UNDECODED``). The checks look at the text (``in`` on ``str`` is the fast one).
    Raises ``InvalidValue`` for what :func:`check` refuses (``name``: the value's)."""
    try:
        out = orjson.dumps(value, default=_refuse, option=_OPTIONS)
    except TypeError:  # orjson.JSONEncodeError: a type, size or depth it does not take
        check(value, name)
        return None
    text = out.decode("utf-8")
    if "0.0000" in text or ("e-" in text and _SHORT_EXPONENT.search(text)):
        return None
    if "null" not in text:
        return text, out, _UNDECODED
    # orjson writes NaN and infinity as null: a null that decodes unequal was one
    # (or a tuple, which compares unequal to a list: the reference then encodes it)
    decoded = orjson.loads(out)
    return None if decoded != value else (text, out, decoded)


#: What :func:`_normalized_text` (and ``_fast``) give for a value they did not decode.
_UNDECODED: Any = object()


def dumps(value: Any, name: str = "value") -> str:
    """``value`` as canonical JSON text.

    Raises ``InvalidValue`` (a ``TypeError``, its text starting with the path of the
    culprit under ``name``) for a value JSON cannot hold as given, and ``ValueError``
    for NaN, infinity or a circular reference.
    """
    fast = _fast(value, name)
    return _REFERENCE.encode(value) if fast is None else fast[0]


def string(value: str) -> str:
    """A ``str`` as a JSON string (any other value as :func:`dumps` encodes it)."""
    if type(value) is str:
        # printable ASCII but for the two JSON escapes: the text between quotes
        if value.isascii() and value.isprintable() and '"' not in value and "\\" not in value:
            return f'"{value}"'
        try:
            return orjson.dumps(value).decode("utf-8")
        except TypeError:  # a lone surrogate: the reference keeps it, as text
            pass
    return dumps(value)


def dumps_bytes(value: Any, name: str = "value") -> bytes:
    """:func:`dumps` as UTF-8 bytes (raises ``UnicodeEncodeError`` for a lone surrogate)."""
    fast = _fast(value, name)
    return _REFERENCE.encode(value).encode("utf-8") if fast is None else fast[1]


def loads(data: str | bytes) -> Any:
    """The value of JSON text (``str`` or UTF-8 ``bytes``); integers of any size exact.

    Raises ``ValueError`` (``json.JSONDecodeError``) for text that is not JSON.
    """
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    # (``in`` on ``str`` is several times faster than on ``bytes``)
    if _LONG_NUMBER not in raw.translate(_DIGITS).decode("latin-1"):
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
    return json.loads(data)


def normalized(value: Any, name: str = "value") -> tuple[Any, str]:
    """``value`` as a reload will show it (tuples become lists, ...), and that value's
    canonical text (what encoding it again gives): one encoding, one decoding, unless
    ``orjson`` does not give the canonical text.

    Raises what :func:`dumps` raises.
    """
    try:  # _fast, inline: this runs for every new state and outgoing body
        out = orjson.dumps(value, default=_refuse, option=_OPTIONS)
    except TypeError:
        check(value, name)
        return _normalized_slowly(value)
    text = out.decode("utf-8")
    if "0.0000" in text or ("e-" in text and _SHORT_EXPONENT.search(text)):
        return _normalized_slowly(value)
    decoded = orjson.loads(out)
    if "null" in text and decoded != value:  # a NaN or infinity (or a tuple holding null)
        return _normalized_slowly(value)
    return decoded, text


def _normalized_text(value: Any, name: str = "value") -> tuple[Any, str]:
    """:func:`normalized`, but ``_UNDECODED`` for the value where the text alone shows
    that decoding it gives ``value`` back (no ``null``): for the processor's outgoing
    bodies, most never read back. Raises what :func:`dumps` raises.
    """
    fast = _fast(value, name)
    return _normalized_slowly(value) if fast is None else (fast[2], fast[0])


def _normalized_slowly(value: Any) -> tuple[Any, str]:
    """:func:`normalized` where ``orjson`` does not give the canonical text (its callers
    found so): through the reference encoder; the text of the decoded value is the one
    every later encoding gives."""
    normal = json.loads(_REFERENCE.encode(value))
    return normal, dumps(normal)


#: Types a value may hold at any depth (the reference encodes their subclasses too).
_PLAIN = (str, int, float, type(None), uuid.UUID, enum.Enum)


def check(value: Any, name: str = "value") -> None:
    """Raise ``InvalidValue`` naming the first place in ``value`` (``name`` and its path,
    such as ``state["a"][0][3]``) that holds a dict key that is not ``str``, a
    dataclass, a pydantic model or another type JSON has no form for; else return.

    A walk of the whole value: called where ``orjson`` refused it, never on the fast
    path. What it lets through (integers beyond 64 bits, nesting deeper than ``orjson``
    takes, a circular reference) is the reference encoder's to encode or refuse.
    """
    seen: set[int] = set()
    stack: list[tuple[Any, str]] = [(value, name)]
    while stack:
        item, path = stack.pop()
        if isinstance(item, _PLAIN):
            continue
        if isinstance(item, dict | list | tuple):
            if id(item) in seen:  # shared, or circular: the reference refuses a cycle
                continue
            seen.add(id(item))
            if isinstance(item, dict):
                for key in item:
                    if not isinstance(key, str):
                        raise InvalidValue(
                            f"{path}[{key!r:.60}]: dict keys must be str, got "
                            f"{type(key).__name__} (JSON would store it as text, and a "
                            "reload would not give the value back)"
                        )
                children = [(v, f"{path}[{string(k)[:60]}]") for k, v in item.items()]
            else:
                children = [(v, f"{path}[{i}]") for i, v in enumerate(item)]
            stack.extend(reversed(children))
            continue
        raise InvalidValue(f"{path}: {_unsupported(item)}")


def _unsupported(item: Any) -> str:
    """Why ``item`` (not a JSON value) is refused, and what to pass instead."""
    kind = type(item).__name__
    if dataclasses.is_dataclass(item) and not isinstance(item, type):
        return (
            f"a dataclass ({kind}) is not JSON-compatible: pass dataclasses.asdict(value) "
            "(dedupstore stores canonical JSON and converts no class itself)"
        )
    if callable(getattr(type(item), "model_dump", None)):
        return (
            f"a pydantic model ({kind}) is not JSON-compatible: pass "
            'value.model_dump(mode="json") (dedupstore stores canonical JSON and converts '
            "no class itself)"
        )
    return f"a {kind} is not JSON-compatible (expected dict, list, str, int, float, bool, None)"


def copy(value: Any) -> Any:
    """A deep copy of a JSON value (through ``orjson``: several times faster than
    ``copy.deepcopy``; ``copy.deepcopy`` where ``orjson`` could not give it exactly)."""
    try:
        out = orjson.dumps(value, default=_refuse, option=_OPTIONS)
    except TypeError:
        return _copy.deepcopy(value)
    copied = orjson.loads(out)
    if b"null" in out and copied != value:  # a NaN or infinity, which orjson wrote as null
        return _copy.deepcopy(value)
    return copied
