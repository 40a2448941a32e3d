"""Secrets masked out of URLs and free text; imports nothing of dedupstore, keeps no state.

Masking works on the raw text before any parsing, so a malformed URL never prints its
password: the user-info's password and the value of every secret query option become
``***``. The secret names are :data:`SECRET_NAMES` plus those a caller passes (an object
opened by URL passes its declaration's ``OptionSet.secret_names``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from urllib.parse import unquote

__all__ = [
    "MASK",
    "SECRET_NAMES",
    "authority_bounds",
    "is_secret",
    "mask_options",
    "mask_text",
    "mask_url",
    "scrub",
]

MASK = "***"

#: Option names (and URL query keys) whose values are never shown, on every backend.
#: A test checks that every option a built-in backend declares ``secret`` is here.
SECRET_NAMES: frozenset[str] = frozenset(
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
        # libpq keywords (passed through to the driver, not declared as options)
        "oauth_client_secret",
        "scram_client_key",
        "scram_server_key",
    }
)

#: Secrets shorter than this are masked only as whole words, so a one-letter password
#: does not mask every matching letter.
_SHORT_SECRET = 8

_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]*")


def is_secret(name: str, secret_names: Iterable[str] = ()) -> bool:
    """Whether the value of option (or query key) ``name`` must be masked.

    ``secret_names`` adds names to :data:`SECRET_NAMES` (compared case-insensitively).
    """
    lowered = name.lower()
    return lowered in SECRET_NAMES or any(lowered == extra.lower() for extra in secret_names)


def authority_bounds(rest: str) -> tuple[int, int]:
    """(end of the user-info or -1, end of the authority) in ``rest`` (after ``://``).

    A ``:`` before the first ``/ ? #`` with an ``@`` only after it means a raw reserved
    character in a password: the user-info then runs to the last ``@`` (masking too
    much, never too little).
    """
    stops = [i for i in (rest.find(c) for c in "/?#") if i != -1]
    authority_end = min(stops) if stops else len(rest)
    at = rest.rfind("@", 0, authority_end)
    if at == -1 and ":" in rest[:authority_end] and "@" in rest[authority_end:]:
        at = rest.rfind("@")
        stops = [i for i in (rest.find(c, at) for c in "/?#") if i != -1]
        authority_end = min(stops) if stops else len(rest)
    return at, authority_end


def mask_url(url: str, secret_names: Iterable[str] = ()) -> str:
    """Return ``url`` with its password and secret query values replaced by ``***``.

    Works on any text, parsable or not; ``secret_names`` adds to :data:`SECRET_NAMES`.
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
        extra = tuple(secret_names)
        query, hash_, fragment = query.partition("#")
        pieces = []
        for piece in query.split("&"):
            key, eq, _value = piece.partition("=")
            secret = eq and is_secret(unquote(key), extra)
            pieces.append(f"{key}={MASK}" if secret else piece)
        tail = f"{path}?{'&'.join(pieces)}{hash_}{fragment}"
    return f"{scheme}://{head}{tail}"


def mask_text(text: str, secret_names: Iterable[str] = ()) -> str:
    """Mask every URL found in free text (error messages, driver messages)."""
    extra = tuple(secret_names)
    return _URL_IN_TEXT.sub(lambda match: mask_url(match.group(0), extra), text)


def mask_options(
    options: Mapping[str, object], secret_names: Iterable[str] = ()
) -> dict[str, object]:
    """``options`` with the values of secret names replaced by ``***``."""
    extra = tuple(secret_names)
    return {k: MASK if is_secret(k, extra) else v for k, v in options.items()}


def scrub(text: str, secrets: Iterable[str | None], secret_names: Iterable[str] = ()) -> str:
    """``text`` without the values ``secrets`` (short ones only as whole words; empty
    ones ignored), then :func:`mask_text`."""
    for secret in sorted({s for s in secrets if s}, key=len, reverse=True):
        if len(secret) >= _SHORT_SECRET:
            text = text.replace(secret, MASK)
        else:
            text = re.sub(rf"(?<![\w]){re.escape(secret)}(?![\w])", MASK, text)
    return mask_text(text, secret_names)
