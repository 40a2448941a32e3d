"""Per-environment configuration.

``open_store()`` without a URL reads, in order:

1. ``DEDUPSTORE_URL`` (overrides the URL of the selected environment);
2. the file named by ``DEDUPSTORE_CONFIG``, else the first ``dedupstore.toml`` or
   ``pyproject.toml`` with a ``[tool.dedupstore]`` table found from the current
   directory upwards;
3. the embedded default, SQLite in ``./.dedupstore/``.

The file holds one table per environment, selected by ``DEDUPSTORE_ENV`` (else the
file's ``default_env``, else ``default``)::

    default_env = "dev"

    [dev]
    url = "sqlite:///.dedupstore/dev.db"

    [prod]
    url = "postgresql://app:${PGPASSWORD}@db.internal/app"
    endpoint = "orders"
    retention = "30d"
    entities_url = "postgresql://app:${PGPASSWORD}@db.internal/app"
    [prod.options]
    pool_max_size = 20
    [prod.entities_options]
    table = "order_entities"

``url``/``options`` are for ``open_store()``, ``entities_url``/``entities_options``
for ``open_entity_store()`` (``DEDUPSTORE_ENTITIES_URL`` overrides the latter),
``tokens_url``/``tokens_options`` for ``open_token_store()``, token mode's token store
(``DEDUPSTORE_TOKENS_URL`` overrides it): what ``--tokens config`` opens, and what
``dedupstore stats`` shows without arguments. A token store never expires anything, so
its table takes no ``endpoint`` or ``retention``.

Relative paths in a configuration file are relative to the file's directory, not to
the current one, so every command finds the same store from any subdirectory: the
path of a ``sqlite:///relative.db`` URL (``url``, ``entities_url``, ``tokens_url``) and the
values of the options naming files (:data:`PATH_OPTIONS`: ``ssl_ca_certs``, libpq's
``sslrootcert``, ``sslcert``, ``sslkey``, ...), in a table or in a URL's query. A URL
from ``DEDUPSTORE_URL`` / ``DEDUPSTORE_ENTITIES_URL`` / ``DEDUPSTORE_TOKENS_URL`` and the
embedded default (``./.dedupstore/``) stay relative to the current directory.

``${VAR}`` is expanded from the environment everywhere (``$$`` is a literal ``$``);
a value inserted into the user-info of a URL (a password) is percent-encoded, so a
generated secret holding ``/``, ``#``, ``?`` or ``@`` still makes a valid URL. An
option may be given once per environment: as a key of the table, in its
``options`` table or in the URL's query (two places are refused, even when equal
values would be harmless, so nobody wonders which one wins).
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

from dedupstore.errors import ConfigurationError
from dedupstore.masking import authority_bounds, mask_options, mask_url
from dedupstore.urls import StoreURL

__all__ = [
    "DEFAULT_URL",
    "PATH_OPTIONS",
    "NotConfigured",
    "ResolvedConfig",
    "find_config_file",
    "resolve_config",
]

#: The embedded default store.
DEFAULT_URL = "sqlite:///.dedupstore/dedup.db"

_ENV_KEYS = frozenset(
    {
        "url",
        "endpoint",
        "retention",
        "options",
        "entities_url",
        "entities_options",
        "tokens_url",
        "tokens_options",
    }
)
_TOP_KEYS = frozenset({"default_env"})
#: Options (and URL query keys) whose value is a file path: relative to the
#: configuration file when given there. Redis's CA bundle and libpq's file parameters.
PATH_OPTIONS = frozenset(
    {"ssl_ca_certs", "sslrootcert", "sslcert", "sslkey", "sslcrl", "sslcrldir", "passfile"}
)
#: Values of path options that are not paths (libpq's ``sslrootcert=system``).
_NOT_PATHS = frozenset({"", "system"})
#: Schemes whose URL path is a file path.
_FILE_SCHEMES = frozenset({"sqlite"})
_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$\{[^}]*\}?")


class NotConfigured(ConfigurationError):
    """The selected environment names no URL of the store asked for (``key``: ``url``,
    ``entities_url`` or ``tokens_url``) and its override variable is not set."""

    def __init__(self, text: str, key: str) -> None:
        super().__init__(text)
        self.key = key


@dataclass(frozen=True)
class ResolvedConfig:
    """The URL and options ``open_store()`` will use, and where they came from."""

    url: str
    options: dict[str, Any] = field(default_factory=dict)
    source: str = "embedded default"
    environment: str | None = None

    def masked(self) -> dict[str, Any]:
        """Return a printable view with passwords and keys masked."""
        return {
            "url": mask_url(self.url),
            "options": mask_options(self.options),
            "source": self.source,
            "environment": self.environment,
        }

    def __repr__(self) -> str:
        shown = self.masked()
        return (
            f"ResolvedConfig(url={shown['url']!r}, options={shown['options']!r}, "
            f"source={self.source!r}, environment={self.environment!r})"
        )


def find_config_file(start: Path | None = None) -> Path | None:
    """Return the configuration file in effect, or ``None``."""
    explicit = os.environ.get("DEDUPSTORE_CONFIG")
    if explicit:
        path = Path(explicit)
        if not path.is_file():
            raise ConfigurationError(f"DEDUPSTORE_CONFIG names {explicit!r}, which is not a file")
        return path
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        candidate = folder / "dedupstore.toml"
        if candidate.is_file():
            return candidate
        pyproject = folder / "pyproject.toml"
        if pyproject.is_file() and "dedupstore" in _read_toml(pyproject).get("tool", {}):
            return pyproject
    return None


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigurationError(f"cannot read configuration file {path}: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigurationError(
            f"cannot read configuration file {path}: it is not UTF-8 text ({exc.reason} at "
            f"byte {exc.start})"
        ) from None


def _substitute(text: str, where: str, environ: Mapping[str, str], encode: bool) -> str:
    def replace(match: re.Match[str]) -> str:
        token = match.group(0)
        if token == "$$":
            return "$"
        name = match.group(1)
        if name is None:
            raise ConfigurationError(
                f"{where}: {token!r} is not a variable reference; write ${{NAME}} (letters, "
                "digits, '_') or $$ for a literal $"
            )
        if name not in environ:
            raise ConfigurationError(
                f"{where} uses ${{{name}}}, but the environment variable {name} is not set"
            )
        return quote(environ[name], safe="") if encode else environ[name]

    return _VAR.sub(replace, text)


def _expand_url(template: str, where: str, environ: Mapping[str, str]) -> str:
    """Expand ``${VAR}``; values in the user-info (before the host's ``@``) are encoded."""
    scheme, sep, rest = template.partition("://")
    at, _ = authority_bounds(rest)
    if not sep or at == -1:
        return _substitute(template, where, environ, encode=False)
    userinfo = _substitute(rest[:at], where, environ, encode=True)
    tail = _substitute(rest[at:], where, environ, encode=False)
    return f"{_substitute(scheme, where, environ, encode=False)}://{userinfo}{tail}"


def _anchor_path(value: object, base: Path) -> object:
    """A relative path (text) made absolute against ``base``; anything else unchanged."""
    if not isinstance(value, str) or value in _NOT_PATHS:
        return value
    path = Path(value).expanduser()
    return value if path.is_absolute() else str(base / path)


def _anchor_url(url: str, base: Path) -> str:
    """``url`` with its relative file path and path-valued query options against ``base``."""
    parsed = StoreURL.parse(url)
    if any(key in PATH_OPTIONS for key, _ in parsed.query):
        query = [
            (k, str(_anchor_path(v, base)) if k in PATH_OPTIONS else v) for k, v in parsed.query
        ]
        parsed = parsed.with_query(query)
    if parsed.scheme not in _FILE_SCHEMES or parsed.netloc or not parsed.path[1:]:
        return parsed.text
    path = unquote(parsed.path[1:])
    if path == ":memory:" or Path(path).is_absolute():
        return parsed.text
    tail = parsed.text[len(f"{parsed.scheme}://{parsed.path}") :]
    return f"{parsed.scheme}:///{quote(str(base / path))}{tail}"


def _expand(value: Any, where: str, environ: Mapping[str, str]) -> Any:
    if isinstance(value, str):
        return _substitute(value, where, environ, encode=False)
    if isinstance(value, dict):
        return {k: _expand(v, f"{where}.{k}", environ) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand(v, where, environ) for v in value]
    return value


def resolve_config(
    path: Path | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    entities: bool = False,
    tokens: bool = False,
) -> ResolvedConfig:
    """Resolve the URL and options for ``open_store()`` without a URL.

    With ``entities=True``, for ``open_entity_store()`` instead: the environment's
    ``entities_url`` and ``entities_options``, overridden by
    ``DEDUPSTORE_ENTITIES_URL``; with no configuration at all, the embedded SQLite
    file (the entities have their own table there). With ``tokens=True``, for
    ``open_token_store()``: ``tokens_url`` and ``tokens_options``, overridden by
    ``DEDUPSTORE_TOKENS_URL``; with no configuration at all, the embedded SQLite
    file (the tokens have their own table there).

    Raises ``ConfigurationError`` for an unknown key, a missing environment, an
    unset ``${VAR}``, a malformed file or both ``entities`` and ``tokens``, naming
    which; :class:`NotConfigured` (a ``ConfigurationError``) for an environment without
    the URL asked for.
    """
    env = os.environ if environ is None else environ
    if entities and tokens:
        raise ConfigurationError("resolve_config: ask for entities or tokens, not both")
    url_key, options_key, own_keys, override_var = (
        ("entities_url", "entities_options", (), "DEDUPSTORE_ENTITIES_URL")
        if entities
        else ("tokens_url", "tokens_options", (), "DEDUPSTORE_TOKENS_URL")
        if tokens
        else ("url", "options", ("endpoint", "retention"), "DEDUPSTORE_URL")
    )
    override = env.get(override_var) or None
    config_path = path if path is not None else find_config_file()
    if config_path is None:
        if override:
            return ResolvedConfig(override, {}, override_var)
        if env.get("DEDUPSTORE_ENV"):
            raise ConfigurationError(
                f"DEDUPSTORE_ENV={env['DEDUPSTORE_ENV']!r} names an environment, but there is no "
                "configuration file (dedupstore.toml, [tool.dedupstore] in pyproject.toml, or "
                "DEDUPSTORE_CONFIG) to define it; unset DEDUPSTORE_ENV to use the embedded default"
            )
        return ResolvedConfig(DEFAULT_URL)

    document = _read_toml(config_path)
    if config_path.name == "pyproject.toml":
        document = document.get("tool", {}).get("dedupstore", {})
        label = f"{config_path} [tool.dedupstore]"
    else:
        label = str(config_path)
    environments = {k: v for k, v in document.items() if isinstance(v, dict)}
    for key in document:
        if key not in environments and key not in _TOP_KEYS:
            raise ConfigurationError(
                f"{label}: unknown top-level key {key!r} (expected environment tables "
                "and optionally default_env)"
            )
    name = env.get("DEDUPSTORE_ENV") or document.get("default_env") or "default"
    if name not in environments and override and not env.get("DEDUPSTORE_ENV"):
        return ResolvedConfig(override, {}, override_var)
    if name not in environments:
        known = ", ".join(sorted(environments)) or "none"
        how = "DEDUPSTORE_ENV" if env.get("DEDUPSTORE_ENV") else "the default environment"
        raise ConfigurationError(
            f"{label} has no environment {name!r} (selected by {how}); environments: {known}"
        )
    table = environments[name]
    for key in table:
        if key not in _ENV_KEYS:
            raise ConfigurationError(
                f"{label}: unknown key {key!r} in environment [{name}] "
                f"(allowed: {', '.join(sorted(_ENV_KEYS))})"
            )
    where = f"{label} [{name}]"
    raw_options = table.get(options_key, {})
    if not isinstance(raw_options, dict):
        raise ConfigurationError(
            f"{where}: {options_key!r} must be a table of option = value, got "
            f"{type(raw_options).__name__}"
        )
    raw_url = table.get(url_key)
    if raw_url is not None and not isinstance(raw_url, str):
        raise ConfigurationError(f"{where}: {url_key!r} must be a string")
    table = _expand({k: v for k, v in table.items() if k != url_key}, where, env)
    options: dict[str, Any] = dict(table.get(options_key, {}))
    for key in own_keys:
        if key in table:
            if key in options:
                raise ConfigurationError(
                    f"{where}: {key!r} is set both in the table and under its options; set it once"
                )
            options[key] = table[key]
    base = config_path.absolute().parent
    options = {k: _anchor_path(v, base) if k in PATH_OPTIONS else v for k, v in options.items()}
    url = override or (None if raw_url is None else _expand_url(raw_url, where, env))
    if not url:
        raise NotConfigured(f"{where} has no {url_key!r} and {override_var} is not set", url_key)
    if not override:
        url = _anchor_url(url, base)
    in_query = {key for key, _ in StoreURL.parse(url).query} & set(options)
    if in_query:
        raise ConfigurationError(
            f"{where}: {', '.join(sorted(in_query))} set both in the URL's query and in the "
            "environment's table; set each once"
        )
    source = f"{label} [{name}]" + (f" with {override_var}" if override else "")
    return ResolvedConfig(url, options, source, name)
