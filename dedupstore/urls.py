"""Store URLs: parsed once into :class:`StoreURL`; secrets masked from the raw text.

Masking works on the raw text before any parsing, so a malformed URL can never
print its password: everything between the first ``:`` of the user-info and the
``@`` that ends it becomes ``***``, and so does the value of every secret query
option (``password``, ``key``, ...). A password holding ``/ ? # @`` must be
percent-encoded in a URL; ``${VAR}`` substitutions into the user-info of a URL in
a configuration file are encoded automatically (see :mod:`dedupstore.config`).
"""

from __future__ import annotations

import math
import re
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit

from dedupstore.errors import ConfigurationError

__all__ = [
    "MASK",
    "StoreURL",
    "authority_bounds",
    "format_duration",
    "mask_text",
    "mask_url",
    "parse_duration",
    "register_secret_name",
    "secret_names",
]

MASK = "***"

#: Option names (and URL query keys) whose values are never shown. Backends add
#: theirs through their option declarations (``Option(secret=True)``).
_SECRET_NAMES: set[str] = {
    "password",
    "sslpassword",
    "key",
    "master_key",
    "account_key",
    "credential",
    "token",
    "secret",
    "aws_secret_access_key",
    "aws_session_token",
    "client",
}
_secret_lock = threading.Lock()

_SCHEME = re.compile(r"[a-z][a-z0-9+.-]*")
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]*")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)?\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, None: 1}
#: A compound duration such as ``1h30m`` or ``2s500ms``: units largest first, each once.
_DURATION_PART = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)")
_UNIT_ORDER = ("w", "d", "h", "m", "s", "ms")
#: The units :func:`format_duration` writes, in microseconds.
_FORMAT_UNITS = (("d", 86_400_000_000), ("h", 3_600_000_000), ("m", 60_000_000), ("s", 1_000_000))
#: Longest duration accepted anywhere (1000 years): larger values are typos.
MAX_DURATION_SECONDS = 1000 * 365.25 * 86400


def register_secret_name(name: str) -> None:
    """Mask the values of option/query key ``name`` everywhere from now on."""
    with _secret_lock:
        _SECRET_NAMES.add(name.lower())


def secret_names() -> frozenset[str]:
    """The option names whose values are masked."""
    with _secret_lock:
        return frozenset(_SECRET_NAMES)


def authority_bounds(rest: str) -> tuple[int, int]:
    """(end of the user-info, end of the authority) in ``rest`` (the text after ``://``).

    The user-info end is -1 when there is none. A ``:`` before the first ``/ ? #``
    with an ``@`` only after it means a raw reserved character in a password: the
    user-info is then taken to run to the last ``@`` (masking too much, never too
    little).
    """
    stops = [i for i in (rest.find(c) for c in "/?#") if i != -1]
    authority_end = min(stops) if stops else len(rest)
    at = rest.rfind("@", 0, authority_end)
    if at == -1 and ":" in rest[:authority_end] and "@" in rest[authority_end:]:
        at = rest.rfind("@")
        stops = [i for i in (rest.find(c, at) for c in "/?#") if i != -1]
        authority_end = min(stops) if stops else len(rest)
    return at, authority_end


def mask_url(url: str) -> str:
    """Return ``url`` with its password and secret query values replaced by ``***``.

    Works on any text, parsable or not.
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    at, authority_end = authority_bounds(rest)
    head, tail = rest[:authority_end], rest[authority_end:]
    if at != -1:
        userinfo, hostport = rest[:at], rest[at + 1 : authority_end]
        if ":" in userinfo:
            userinfo = f"{userinfo.split(':', 1)[0]}:{MASK}"
        head = f"{userinfo}@{hostport}"
    path, qmark, query = tail.partition("?")
    if qmark:
        names = secret_names()
        query, hash_, fragment = query.partition("#")
        pieces = []
        for piece in query.split("&"):
            key, eq, _value = piece.partition("=")
            secret = eq and unquote(key).lower() in names
            pieces.append(f"{key}={MASK}" if secret else piece)
        tail = f"{path}?{'&'.join(pieces)}{hash_}{fragment}"
    return f"{scheme}://{head}{tail}"


def mask_text(text: str) -> str:
    """Mask every URL found in free text (error messages, driver messages)."""
    return _URL_IN_TEXT.sub(lambda match: mask_url(match.group(0)), text)


@dataclass(frozen=True, repr=False)
class StoreURL:
    """A store URL parsed once; every later step reads its fields.

    ``username`` and ``password`` are percent-decoded; ``path`` is as written;
    ``query`` holds the decoded ``(key, value)`` pairs in order. ``str()`` and
    ``repr()`` are masked; ``text`` is the URL as given (secrets included).
    """

    text: str
    scheme: str
    username: str | None
    password: str | None = field(compare=False)
    host: str | None
    port: int | None
    path: str
    query: tuple[tuple[str, str], ...]
    fragment: str

    @classmethod
    def parse(cls, text: object) -> StoreURL:
        """Parse ``text``; raise ``ConfigurationError`` (with secrets masked) if malformed."""
        if isinstance(text, StoreURL):
            return text
        if not isinstance(text, str):
            raise ConfigurationError(f"a store URL must be a str, got {type(text).__name__}")
        shown = mask_url(text)
        if "://" not in text:
            raise ConfigurationError(
                f"malformed store URL {shown!r}: expected '<scheme>://...', "
                "for example 'sqlite:///.dedupstore/dedup.db' or 'redis://localhost:6379/0'"
            )
        scheme, _, rest = text.partition("://")
        if not _SCHEME.fullmatch(scheme):
            raise ConfigurationError(
                f"malformed store URL {shown!r}: the scheme must be lower-case letters, "
                "digits, '+', '-' or '.', starting with a letter"
            )
        at, _ = authority_bounds(rest)
        if at != -1 and any(c in rest[:at] for c in "/?#"):
            raise ConfigurationError(
                f"malformed store URL {shown!r}: the user name or password contains '/', '?', "
                "'#' or '@'; percent-encode it (urllib.parse.quote(password, safe='')); a "
                "${VAR} in the user-info of a configured URL is encoded automatically"
            )
        try:
            parts = urlsplit(text)
            port = parts.port
            query = tuple(parse_qsl(parts.query, keep_blank_values=True))
        except ValueError as exc:
            raise ConfigurationError(f"malformed store URL {shown!r}: {exc}") from None
        return cls(
            text=text,
            scheme=scheme,
            username=None if parts.username is None else unquote(parts.username),
            password=None if parts.password is None else unquote(parts.password),
            host=parts.hostname,
            port=port,
            path=parts.path,
            query=query,
            fragment=parts.fragment,
        )

    @property
    def masked(self) -> str:
        """The URL with its secrets replaced by ``***``."""
        return mask_url(self.text)

    @property
    def netloc(self) -> str:
        """The raw ``[user[:password]@]host[:port]`` part (secrets included)."""
        return urlsplit(self.text).netloc

    def with_query(self, pairs: list[tuple[str, str]] | tuple[tuple[str, str], ...]) -> StoreURL:
        """The same URL with its query replaced by ``pairs`` (encoded)."""
        # string surgery: urlunsplit() drops the empty host of 'sqlite:////abs/path'
        scheme, _, rest = self.text.partition("://")
        _, authority_end = authority_bounds(rest)
        path = re.split(r"[?#]", rest[authority_end:], maxsplit=1)[0]
        base = f"{scheme}://{rest[:authority_end]}{path}"
        encoded = urlencode(list(pairs), quote_via=quote)
        return StoreURL.parse(f"{base}?{encoded}" if encoded else base)

    def __str__(self) -> str:
        return self.masked

    def __repr__(self) -> str:
        return f"StoreURL({self.masked!r})"


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
