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
    [prod.options]
    pool_max_size = 20

``${VAR}`` is expanded from the environment everywhere (``$$`` is a literal ``$``).
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dedupstore.errors import ConfigurationError
from dedupstore.urls import mask_options, mask_url, parse_duration

__all__ = ["DEFAULT_URL", "ResolvedConfig", "find_config_file", "resolve_config"]

#: The embedded default store.
DEFAULT_URL = "sqlite:///.dedupstore/dedup.db"

_ENV_KEYS = frozenset({"url", "endpoint", "retention", "options"})
_TOP_KEYS = frozenset({"default_env"})
_VAR = re.compile(r"\$\$|\$\{([^}]*)\}")


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
        raise ConfigurationError(f"cannot read configuration file {path}: {exc}") from exc


def _expand(value: Any, where: str, environ: Mapping[str, str]) -> Any:
    if isinstance(value, str):

        def substitute(match: re.Match[str]) -> str:
            if match.group(0) == "$$":
                return "$"
            name = match.group(1)
            if name not in environ:
                raise ConfigurationError(
                    f"{where} uses ${{{name}}}, but the environment variable {name} is not set"
                )
            return environ[name]

        return _VAR.sub(substitute, value)
    if isinstance(value, dict):
        return {k: _expand(v, f"{where}.{k}", environ) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand(v, where, environ) for v in value]
    return value


def resolve_config(
    path: Path | None = None, environ: Mapping[str, str] | None = None
) -> ResolvedConfig:
    """Resolve the URL and options for ``open_store()`` without a URL.

    Raises ``ConfigurationError`` for an unknown key, a missing environment, an
    unset ``${VAR}`` or a malformed file, naming which.
    """
    env = os.environ if environ is None else environ
    override = env.get("DEDUPSTORE_URL") or None
    config_path = path if path is not None else find_config_file()
    if config_path is None:
        if override:
            return ResolvedConfig(override, {}, "DEDUPSTORE_URL")
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
        return ResolvedConfig(override, {}, "DEDUPSTORE_URL")
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
    table = _expand(table, f"{label} [{name}]", env)
    options: dict[str, Any] = dict(table.get("options", {}))
    if not isinstance(table.get("options", {}), dict):
        raise ConfigurationError(f"{label} [{name}]: 'options' must be a table")
    if "endpoint" in table:
        options["endpoint"] = table["endpoint"]
    if "retention" in table:
        try:
            options["retention"] = parse_duration(table["retention"])
        except ValueError as exc:
            raise ConfigurationError(f"{label} [{name}]: bad retention: {exc}") from exc
    url = override or table.get("url")
    if not url:
        raise ConfigurationError(f"{label} [{name}] has no 'url' and DEDUPSTORE_URL is not set")
    if not isinstance(url, str):
        raise ConfigurationError(f"{label} [{name}]: 'url' must be a string")
    source = f"{label} [{name}]" + (" with DEDUPSTORE_URL" if override else "")
    return ResolvedConfig(url, options, source, name)
