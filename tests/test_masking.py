"""Masking: one stateless module; every secret of every backend masked everywhere."""

from __future__ import annotations

import ast
import logging
from pathlib import Path
from typing import Any, ClassVar

import psycopg
import pytest

import dedupstore.masking
from dedupstore import ConfigurationError, DeduplicationStore, StoreUnavailable
from dedupstore.cli import main
from dedupstore.config import ResolvedConfig
from dedupstore.errors import format_error
from dedupstore.masking import MASK, SECRET_NAMES, mask_text, mask_url
from dedupstore.options import Option, OptionSet, text
from dedupstore.registry import known, resolve

pytestmark = pytest.mark.memory

SECRET = "Sup3rSecretValue-Xq"


BUILTIN_SCHEMES = ("memory", "sqlite", "postgresql", "redis", "dynamodb", "cosmos")


def _classes() -> list[type[Any]]:
    """Every built-in class (other tests may register schemes of their own)."""
    return [
        resolve(kind, scheme)
        for kind in ("store", "entity_store", "dispatcher")
        for scheme in BUILTIN_SCHEMES
        if scheme in known(kind)
    ]


def test_masking_imports_nothing_of_dedupstore() -> None:
    tree = ast.parse(Path(dedupstore.masking.__file__).read_text(encoding="utf-8"))
    imported = [
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    ]
    assert not [name for name in imported if name and name.startswith("dedupstore")], imported


def test_every_builtin_secret_option_is_masked_without_its_declaration() -> None:
    """Context-free masking (error texts, StoreURL) covers every built-in secret option."""
    declared = {
        name for cls in _classes() for name, option in cls.declared_options.items() if option.secret
    }
    assert declared >= {"aws_secret_access_key", "aws_session_token", "key", "password", "client"}
    assert declared <= SECRET_NAMES, declared - SECRET_NAMES


def test_every_secret_libpq_keyword_is_masked() -> None:
    """libpq flags its secret keywords (passed through to the driver) with dispchar '*'."""
    secret = {o.keyword.decode() for o in psycopg.pq.Conninfo.get_defaults() if o.dispchar == b"*"}
    assert "password" in secret
    assert secret <= SECRET_NAMES, secret - SECRET_NAMES


def test_importing_backends_changes_no_masking() -> None:
    before = mask_url(f"x://h/?api_token={SECRET}")
    _classes()  # imports every built-in backend
    assert mask_url(f"x://h/?api_token={SECRET}") == before
    assert SECRET in before, "an undeclared name is not a secret by itself"


@pytest.mark.parametrize(
    "url",
    [
        f"postgresql://app:{SECRET}@db:5432/x",
        f"postgresql://app@db/x?sslpassword={SECRET}",
        f"postgresql://db/x?password={SECRET}&oauth_client_secret={SECRET}",
        f"redis://:{SECRET}@h:6379/0",
        f"redis://h/0?password={SECRET}",
        f"cosmos://h/db/c?key={SECRET}&tls=false",
        f"dynamodb://table?aws_secret_access_key={SECRET}&aws_session_token={SECRET}",
        f"dynamodb://table?AWS_SECRET_ACCESS_KEY={SECRET}",
    ],
)
def test_secrets_are_masked_in_urls_and_text(url: str) -> None:
    assert SECRET not in mask_url(url)
    assert SECRET not in mask_text(f"cannot open {url}: refused")
    assert SECRET not in format_error(ConfigurationError(f"bad {url}"))
    assert SECRET not in repr(ResolvedConfig(url))


class _ThirdParty(DeduplicationStore):
    """A backend outside the library with a secret option of its own name."""

    schemes: ClassVar[tuple[str, ...]] = ("thirdparty",)
    declared_options: ClassVar[OptionSet] = DeduplicationStore.declared_options.extend(
        Option("api_token", text(), None, "a secret of its own", secret=True)
    )

    def _add_new(self, request: Any) -> set[str]:
        raise NotImplementedError

    def _find(self, ids: list[str], now: float) -> set[str]:
        raise NotImplementedError

    def _purge(self, now: float) -> int:
        raise NotImplementedError

    def _count(self, now: float) -> int:
        raise NotImplementedError

    def _close(self) -> None:
        pass


def test_a_declared_secret_is_masked_in_its_objects_url_repr_and_errors(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = _ThirdParty(f"thirdparty://h/?api_token={SECRET}")
    assert SECRET not in store.url and f"api_token={MASK}" in store.url
    assert SECRET not in repr(store)
    error = store.make_error(
        ConfigurationError, "add", f"refused by thirdparty://h/?api_token={SECRET}"
    )
    assert SECRET not in str(error)
    assert SECRET not in store.scrub(f"the driver says {SECRET}")
    kw = _ThirdParty("thirdparty://h/", api_token=SECRET)
    assert SECRET not in repr(kw)
    caplog.set_level(logging.INFO, logger="dedupstore")
    with pytest.raises(StoreUnavailable) as info, kw.translating_errors("add"):
        raise ConnectionError(f"thirdparty://h/?api_token={SECRET} refused {SECRET}")
    assert SECRET not in str(info.value)
    assert "store unavailable" in caplog.text
    assert SECRET not in caplog.text


def test_the_cli_config_masks_every_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    for var in ("DEDUPSTORE_ENV", "DEDUPSTORE_URL", "DEDUPSTORE_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "dedupstore.toml").write_text(
        "[default]\n"
        'url = "dynamodb://orders?region=us-east-1&aws_access_key_id=AKIA"\n'
        f'entities_url = "cosmos://localhost:8081/db/entities?key={SECRET}"\n'
        "[default.options]\n"
        f'aws_secret_access_key = "{SECRET}"\n'
        f'aws_session_token = "{SECRET}"\n',
        encoding="utf-8",
    )
    assert main(["config"]) == 0
    out = capsys.readouterr().out
    assert SECRET not in out
    assert MASK in out
