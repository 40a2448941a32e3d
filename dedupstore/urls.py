"""Store URLs: parsed once into :class:`StoreURL`.

Secrets are masked by :mod:`dedupstore.masking` on the raw text, before any
parsing. A password holding ``/ ? # @`` must be percent-encoded in a URL;
``${VAR}`` substitutions into the user-info of a URL in a configuration file are
encoded automatically (see :mod:`dedupstore.config`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit

from dedupstore.errors import ConfigurationError
from dedupstore.masking import authority_bounds, mask_url

__all__ = ["StoreURL"]

_SCHEME = re.compile(r"[a-z][a-z0-9+.-]*")


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

    @property
    def secrets(self) -> set[str]:
        """The password, decoded and as written (maybe percent-encoded); empty if none."""
        raw_userinfo = self.netloc.rpartition("@")[0]
        written = raw_userinfo.split(":", 1)[1] if ":" in raw_userinfo else ""
        return {self.password or "", written} - {""}

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
