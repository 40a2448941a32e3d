"""Options declared once per backend, applied alike to URL queries, keywords and config files.

A backend declares each option once (:class:`Option`); :meth:`OptionSet.resolve` turns
the URL's query values and the keyword arguments into typed values with the same
converters (:func:`boolean`, :func:`integer`, :func:`seconds`, ...), so ``"false"`` is
``False`` everywhere, an unknown option is the same ``ConfigurationError`` on every
backend, and a URL value contradicting a keyword is refused. ``repr``, pickling and
``dedupstore config`` read the same declaration.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from dedupstore.errors import ConfigurationError
from dedupstore.masking import MASK, is_secret
from dedupstore.urls import StoreURL

__all__ = [
    "Option",
    "OptionSet",
    "Options",
    "boolean",
    "choice",
    "format_duration",
    "integer",
    "optional",
    "parse_duration",
    "seconds",
    "text",
]

Converter = Callable[[Any], Any]

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)?\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, None: 1}
#: A compound duration such as ``1h30m`` or ``2s500ms``: units largest first, each once.
_DURATION_PART = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)")
_UNIT_ORDER = ("w", "d", "h", "m", "s", "ms")
#: A duration of zero, as text (``0``, ``0.0s``, ``0ms``): taken where zero is allowed.
_ZERO = re.compile(r"0+(?:\.0+)?\s*(?:ms|s|m|h|d|w)?")
#: The units :func:`format_duration` writes, in microseconds.
_FORMAT_UNITS = (("d", 86_400_000_000), ("h", 3_600_000_000), ("m", 60_000_000), ("s", 1_000_000))
#: Longest duration accepted anywhere (1000 years): larger values are typos.
MAX_DURATION_SECONDS = 1000 * 365.25 * 86400


@dataclass(frozen=True)
class Option:
    """One option of a backend.

    ``convert`` turns a string (URL query, environment) or a Python value (keyword,
    TOML) into the typed value, raising ``ValueError``/``TypeError`` when it cannot.
    ``in_url``: may come from a URL query or a configuration file (``False`` for
    live objects such as ``client``). ``pickled``: replayed when an unpickled copy
    reopens. ``driver``: handed to the driver library as is. ``doc``: what the
    option is, named when a value is refused.
    """

    name: str
    convert: Converter
    default: Any = None
    doc: str = ""
    secret: bool = False
    in_url: bool = True
    pickled: bool = True
    driver: bool = False


class OptionSet(Mapping[str, Option]):
    """A backend's declared options (immutable); ``extend`` makes a subclass's set.

    ``driver_params`` says which undeclared URL query keys pass through to the
    driver (libpq's ``sslmode``, ...); without it every undeclared key is refused.
    """

    def __init__(
        self, *options: Option, driver_params: Callable[[str], bool] | None = None
    ) -> None:
        self._options: dict[str, Option] = {option.name: option for option in options}
        #: The names of the options declared ``secret`` (masked wherever this set is known).
        self.secret_names: frozenset[str] = frozenset(
            name for name, option in self._options.items() if option.secret
        )
        self.driver_params = driver_params

    def extend(
        self,
        *options: Option,
        remove: Iterable[str] = (),
        driver_params: Callable[[str], bool] | None = None,
    ) -> OptionSet:
        """A new set: these options added (replacing same-named ones), ``remove`` dropped."""
        dropped = set(remove)
        kept = [o for name, o in self._options.items() if name not in dropped]
        return OptionSet(*kept, *options, driver_params=driver_params or self.driver_params)

    def __getitem__(self, name: str) -> Option:
        return self._options[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._options)

    def __len__(self) -> int:
        return len(self._options)

    def _unknown(self, owner: str, name: str, where: str) -> ConfigurationError:
        known = ", ".join(n for n, o in self._options.items() if o.in_url or where != "in the URL")
        return ConfigurationError(
            f"unknown option {name!r} for {owner} ({where}); known options: {known or 'none'}"
        )

    def convert(self, owner: str, name: str, value: object) -> Any:
        """Convert ``value`` for option ``name``, or raise ``ConfigurationError``.

        The message names the option, ``owner`` and what the option is (its ``doc``).
        """
        option = self._options[name]
        try:
            return option.convert(value)
        except (ValueError, TypeError, OverflowError) as exc:
            what = f"{name!r} of {owner}" + (f" ({option.doc})" if option.doc else "")
            if option.secret:
                raise ConfigurationError(
                    f"bad value for option {what}, value hidden: {type(exc).__name__}"
                ) from None
            raise ConfigurationError(f"bad value for option {what}: {exc}") from None

    def resolve(self, owner: str, url: StoreURL, keywords: Mapping[str, object]) -> Options:
        """Typed values of every option, from ``url``'s query and ``keywords``.

        Raises ``ConfigurationError`` naming the option and ``owner`` for an unknown
        option, a bad value, a key repeated in the URL, or a URL/keyword conflict.
        """
        in_url: dict[str, str] = {}
        driver: dict[str, str] = {}
        for key, raw in url.query:
            option = self._options.get(key)
            if option is None and self.driver_params and self.driver_params(key):
                target = driver
            elif option is None or not option.in_url:
                raise self._unknown(owner, key, "in the URL")
            else:
                target = in_url
            if key in target:
                raise ConfigurationError(f"option {key!r} is given twice in the URL")
            target[key] = raw
        values: dict[str, Any] = {}
        given: dict[str, Any] = {}
        for key, value in keywords.items():
            if key not in self._options:
                if self.driver_params and self.driver_params(key):
                    if not isinstance(value, str | int | float) or isinstance(value, bool):
                        raise ConfigurationError(
                            f"driver parameter {key!r} of {owner} must be a string or a number"
                        )
                    if key in driver and driver[key] != str(value):
                        raise self._conflict(owner, key)
                    driver[key] = str(value)
                    continue
                raise self._unknown(owner, key, "as a keyword argument")
            given[key] = self.convert(owner, key, value)
        for name, option in self._options.items():
            if name in in_url:
                from_url = self.convert(owner, name, in_url[name])
                if name in given and given[name] != from_url:
                    raise self._conflict(owner, name)
                values[name] = from_url
            else:
                values[name] = given.get(name, option.default)
        return Options(self, values, given, frozenset(in_url), driver)

    def _conflict(self, owner: str, name: str) -> ConfigurationError:
        return ConfigurationError(
            f"option {name!r} of {owner} is set both in the URL and as a keyword argument, "
            "to different values; give it once"
        )


class Options(Mapping[str, Any]):
    """The resolved, typed options of one store object (read-only)."""

    def __init__(
        self,
        declaration: OptionSet,
        values: dict[str, Any],
        given: dict[str, Any],
        from_url: frozenset[str],
        driver_params: dict[str, str],
    ) -> None:
        self.declaration = declaration
        self._values = values
        self._given = given
        self.from_url = from_url
        #: Undeclared URL query parameters (and keywords) handed to the driver.
        self.driver_params: Mapping[str, str] = dict(driver_params)

    def __getitem__(self, name: str) -> Any:
        return self._values[name]

    def __contains__(self, name: object) -> bool:
        return name in self._values

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def pickled_keywords(self) -> dict[str, Any]:
        """The keyword options to replay on unpickling (URL options travel in the URL)."""
        return {
            name: value
            for name, value in self._given.items()
            if self.declaration[name].pickled and name not in self.from_url
        }

    def shown(self) -> dict[str, Any]:
        """Options that differ from their defaults, secrets masked (for ``repr``)."""
        return {
            name: (MASK if (self.declaration[name].secret or is_secret(name)) else value)
            for name, value in self._values.items()
            if value is not None
            and value != self.declaration[name].default
            and self.declaration[name].pickled
        }

    def driver_kwargs(self) -> dict[str, Any]:
        """Declared options marked ``driver=True`` that are set (not ``None``)."""
        return {
            name: value
            for name, value in self._values.items()
            if self.declaration[name].driver and value is not None
        }


# --------------------------------------------------------------------------- converters


def boolean(value: object) -> bool:
    """``True``/``False``, or ``true/false/1/0/yes/no/on/off`` (any case), or 0/1."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        lowered = value.strip().lower()
        if lowered in {"1", "true", "yes", "on"}:
            return True
        if lowered in {"0", "false", "no", "off"}:
            return False
    raise ValueError(f"expected true or false, got {value!r}")


def integer(minimum: int | None = None, maximum: int | None = None) -> Converter:
    """An ``int`` (or its decimal string) within ``[minimum, maximum]``."""

    def convert(value: object) -> int:
        if isinstance(value, bool):
            raise TypeError(f"expected an integer, got {value!r}")
        if isinstance(value, int):
            number = value
        elif (isinstance(value, float) and value.is_integer()) or (
            isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value)
        ):
            number = int(value)
        else:
            raise ValueError(f"expected an integer, got {value!r}")
        if minimum is not None and number < minimum:
            raise ValueError(f"expected an integer >= {minimum}, got {value!r}")
        if maximum is not None and number > maximum:
            raise ValueError(f"expected an integer <= {maximum}, got {value!r}")
        return number

    return convert


def parse_duration(value: object) -> timedelta | None:
    """Parse a retention: a ``timedelta``, seconds, or a string like ``'30d'``, ``'12h'``.

    ``None``, ``''`` and ``'none'`` mean "keep forever". Raises ``ValueError`` when the
    value is not a positive, finite duration of at most 1000 years.
    """
    if value is None:
        return None
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, bool):
        raise ValueError(f"expected a duration, got {value!r}")
    elif isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        if value.strip().lower() in {"", "none", "forever"}:
            return None
        match = _DURATION.match(value)
        if not match:
            compound = _compound_duration(value)
            check_seconds(compound.total_seconds(), value)
            return compound
        seconds = float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
    else:
        raise ValueError(f"expected a duration, got {type(value).__name__}")
    return timedelta(seconds=check_seconds(seconds, value))


def _compound_duration(text: str) -> timedelta:
    """``'1h30m'``, ``'2s500ms'``: parts summed exactly (each part to the microsecond)."""
    total, position, last = timedelta(), 0, -1
    while position < len(text.rstrip()):
        part = _DURATION_PART.match(text, position)
        rank = -1 if part is None else _UNIT_ORDER.index(part.group(2))
        if part is None or rank <= last:
            raise ValueError(
                "expected a duration such as '90s', '15m', '12h', '30d', '1h30m' or seconds "
                f"(units largest first, each once), got {text!r}"
            )
        total += timedelta(seconds=float(part.group(1)) * _UNIT_SECONDS[part.group(2)])
        position, last = part.end(), rank
    return total


def format_duration(duration: timedelta) -> str:
    """``duration`` as compact text: ``'30d'``, ``'1h30m'``, ``'10s'``, ``'2s500ms'``.

    The inverse of :func:`parse_duration`: parsing the text gives ``duration`` back
    exactly (to the microsecond; below a millisecond as ``'0.001ms'``). Days are the
    largest unit; zero is ``'0s'``. Raises ``ValueError`` for a negative duration.
    """
    micro = duration // timedelta(microseconds=1)
    if micro < 0:
        raise ValueError(f"a duration must not be negative, got {duration!r}")
    if micro == 0:
        return "0s"
    parts = []
    for unit, size in _FORMAT_UNITS:
        count, micro = divmod(micro, size)
        if count:
            parts.append(f"{count}{unit}")
    if micro:
        millis, fraction = divmod(micro, 1000)
        parts.append(f"{millis}.{fraction:03d}".rstrip("0").rstrip(".") + "ms")
    return "".join(parts)


def check_seconds(seconds: float, given: object) -> float:
    """Return ``seconds`` if positive, finite and at most 1000 years, else ``ValueError``."""
    if math.isnan(seconds) or math.isinf(seconds):
        raise ValueError(f"expected a finite duration, got {given!r}")
    if seconds <= 0:
        raise ValueError(f"a duration must be positive, got {given!r}")
    if seconds > MAX_DURATION_SECONDS:
        raise ValueError(f"a duration must be at most 1000 years, got {given!r}")
    return seconds


def seconds(maximum: float | None = None, *, zero: bool = False) -> Converter:
    """A positive, finite number of seconds (at most ``maximum``): ``5``, ``2.5``, ``"5"``,
    ``"5s"``, ``"250ms"``, ``"1h30m"``, a ``timedelta`` (with ``zero``, 0 too: ``"0s"``)."""

    def convert(value: object) -> float:
        if zero and _is_zero(value):
            return 0.0
        if isinstance(value, bool):
            raise TypeError(f"expected a number of seconds, got {value!r}")
        if isinstance(value, timedelta):
            result = value.total_seconds()
        elif isinstance(value, int | float):
            result = float(value)
        elif isinstance(value, str):
            duration = parse_duration(value)
            if duration is None:
                raise ValueError(f"expected a number of seconds, got {value!r}")
            result = duration.total_seconds()
        else:
            raise TypeError(f"expected a number of seconds, got {type(value).__name__}")
        result = check_seconds(result, value)
        if maximum is not None and result > maximum:
            raise ValueError(f"expected at most {maximum:g} seconds, got {value!r}")
        return result

    return convert


def _is_zero(value: object) -> bool:
    """Whether ``value`` is a duration of zero: ``0``, ``timedelta(0)``, ``"0s"``, ..."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int | float | timedelta):
        return not value
    return isinstance(value, str) and _ZERO.fullmatch(value.strip()) is not None


def text(pattern: str | None = None, what: str = "a string") -> Converter:
    """A ``str``, optionally matching ``pattern`` entirely (``what`` names the shape)."""
    compiled = re.compile(pattern) if pattern else None

    def convert(value: object) -> str:
        if not isinstance(value, str):
            raise TypeError(f"expected {what}, got {type(value).__name__} {value!r:.60}")
        if compiled is not None and not compiled.fullmatch(value):
            raise ValueError(f"expected {what}, got {value!r:.80}")
        return value

    return convert


def choice(*allowed: str) -> Converter:
    """One of ``allowed`` (compared case-insensitively; returned as declared)."""
    lookup = {a.lower(): a for a in allowed}

    def convert(value: object) -> str:
        if isinstance(value, str) and value.strip().lower() in lookup:
            return lookup[value.strip().lower()]
        raise ValueError(f"expected one of {', '.join(allowed)}, got {value!r}")

    return convert


def optional(convert: Converter) -> Converter:
    """``None`` (or ``''`` / ``'none'``) stays ``None``; anything else goes to ``convert``."""

    def wrapped(value: object) -> Any:
        if value is None or (isinstance(value, str) and value.strip().lower() in {"", "none"}):
            return None
        return convert(value)

    return wrapped


def anything(value: object) -> object:
    """Any object (for keyword-only live objects such as ``client``)."""
    return value


def callable_(value: object) -> object:
    """A callable (for ``clock``)."""
    if value is not None and not callable(value):
        raise TypeError(f"expected a callable, got {type(value).__name__}")
    return value


# --------------------------------------------------------------------------- shared options


def timeout_option(default: float, what: str) -> Option:
    """``timeout``: how long one request to the server may take before ``StoreUnavailable``."""
    return Option("timeout", seconds(), default, what)


def connect_timeout_option(default: float = 5.0) -> Option:
    """``connect_timeout``: how long opening a connection may take."""
    return Option(
        "connect_timeout",
        seconds(),
        default,
        "seconds to open a connection before StoreUnavailable",
    )


def retries_option(default: int, what: str) -> Option:
    """``retries``: how often a failed request is retried (0: never)."""
    return Option("retries", integer(0, 100), default, what)


def create_option(default: bool, what: str) -> Option:
    """``create``: create the table / schema / container when it is missing."""
    return Option("create", boolean, default, what)


def client_option(what: str) -> Option:
    """``client``: a ready driver client (keyword only, not pickled, not closed by us)."""
    return Option("client", anything, None, what, in_url=False, pickled=False, secret=True)
