"""Store URLs: parsing, option conversion and secret masking."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any
from urllib.parse import SplitResult, parse_qsl, urlsplit

from dedupstore.errors import ConfigurationError

__all__ = [
    "SECRET_OPTION_NAMES",
    "mask_options",
    "mask_url",
    "parse_bool",
    "parse_duration",
    "query_options",
    "split_url",
]

#: Option names (and URL query keys) whose values are never shown.
SECRET_OPTION_NAMES = frozenset(
    {
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
)

_MASK = "***"

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)?\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, None: 1}


def split_url(url: str) -> SplitResult:
    """Split ``url`` into its parts; raise ``ConfigurationError`` if it has no scheme."""
    if not isinstance(url, str):
        raise ConfigurationError(f"a store URL must be a str, got {type(url).__name__}")
    if "://" not in url:
        raise ConfigurationError(
            f"malformed store URL {mask_url(url)!r}: expected '<scheme>://...', "
            "for example 'sqlite:///.dedupstore/dedup.db' or 'redis://localhost:6379/0'"
        )
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - validates the port
    except ValueError as exc:
        raise ConfigurationError(f"malformed store URL {mask_url(url)!r}: {exc}") from exc
    if not parts.scheme or not re.fullmatch(r"[a-z][a-z0-9+.-]*", parts.scheme):
        raise ConfigurationError(f"malformed store URL {mask_url(url)!r}: bad scheme")
    return parts


def query_options(
    parts: SplitResult, converters: Mapping[str, Callable[[str], Any]]
) -> dict[str, Any]:
    """Turn the URL query into typed constructor options.

    Raises ``ConfigurationError`` naming an unknown or repeated key, or a value the
    converter refuses.
    """
    options: dict[str, Any] = {}
    for key, raw in parse_qsl(parts.query, keep_blank_values=True, strict_parsing=False):
        if key not in converters:
            known = ", ".join(sorted(converters)) or "none"
            raise ConfigurationError(
                f"unknown option {key!r} in the query of a {parts.scheme}:// URL "
                f"(known options: {known})"
            )
        if key in options:
            raise ConfigurationError(f"option {key!r} is given twice in the URL")
        try:
            options[key] = converters[key](raw)
        except (ValueError, TypeError) as exc:
            raise ConfigurationError(f"bad value for URL option {key!r}: {exc}") from exc
    return options


def parse_bool(value: str | bool) -> bool:
    """Parse ``true/false/1/0/yes/no/on/off`` (case-insensitive)."""
    if isinstance(value, bool):
        return value
    lowered = value.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off"}:
        return False
    raise ValueError(f"expected a boolean (true/false), got {value!r}")


def parse_duration(value: str | float | int | timedelta | None) -> timedelta | None:
    """Parse a retention: a ``timedelta``, seconds, or a string like ``'30d'``, ``'12h'``.

    ``None``, ``''`` and ``'none'`` mean "keep forever". Raises ``ValueError`` when the
    value is not a positive duration.
    """
    if value is None:
        return None
    if isinstance(value, timedelta):
        result = value
    elif isinstance(value, bool):
        raise ValueError(f"expected a duration, got {value!r}")
    elif isinstance(value, int | float):
        result = timedelta(seconds=value)
    elif isinstance(value, str):
        if value.strip().lower() in {"", "none", "forever"}:
            return None
        match = _DURATION.match(value)
        if not match:
            raise ValueError(
                f"expected a duration such as '90s', '15m', '12h', '30d' or seconds, got {value!r}"
            )
        result = timedelta(seconds=float(match.group(1)) * _UNIT_SECONDS[match.group(2)])
    else:
        raise ValueError(f"expected a duration, got {type(value).__name__}")
    if result <= timedelta(0):
        raise ValueError(f"a retention must be positive, got {value!r}")
    return result


def mask_url(url: str) -> str:
    """Return ``url`` with its password and secret query values replaced by ``***``."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    authority_end = len(rest)
    for stop in "/?#":
        index = rest.find(stop)
        if index != -1:
            authority_end = min(authority_end, index)
    authority, tail = rest[:authority_end], rest[authority_end:]
    userinfo, at, hostport = authority.rpartition("@")
    if at and ":" in userinfo:
        authority = f"{userinfo.split(':', 1)[0]}:{_MASK}@{hostport}"
    path, qmark, query = tail.partition("?")
    if qmark:
        query, hash_, fragment = query.partition("#")
        pieces = []
        for piece in query.split("&"):
            key, eq, _value = piece.partition("=")
            pieces.append(f"{key}={_MASK}" if eq and key.lower() in SECRET_OPTION_NAMES else piece)
        tail = f"{path}?{'&'.join(pieces)}{hash_}{fragment}"
    return f"{scheme}://{authority}{tail}"


def mask_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """Return a copy of ``options`` with secret values replaced by ``***``."""
    return {
        key: (_MASK if key.lower() in SECRET_OPTION_NAMES and value is not None else value)
        for key, value in options.items()
    }
