"""``dedupstore check`` against every real server: success, warnings, one-line errors."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

from dedupstore.cli import main
from tests.servers import (
    CosmosEndpoint,
    DynamoDBEndpoint,
    MotoServer,
    RedisServer,
    Server,
    free_port,
)


@pytest.fixture(autouse=True)
def aws_environment(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fake AWS credentials from the environment; no config files."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing-secret-Qx")
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    yield


def _check(capsys: pytest.CaptureFixture[str], url: str) -> tuple[int, str, str]:
    code = main(["check", url])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _assert_one_line(err: str, *fragments: str, secret: str | None = None) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment.lower() in lines[0].lower(), lines[0]
    if secret:
        assert secret not in err


def _cosmos_url(server: CosmosEndpoint, container: str, query: str) -> str:
    netloc = urlsplit(server.endpoint_url).netloc
    return f"cosmos://{netloc}/cli/{container}?tls=false&endpoint_discovery=false&{query}"


# ---------------------------------------------------------------------- success


@pytest.mark.postgres
def test_check_postgres(capsys: pytest.CaptureFixture[str], postgres_server: Server) -> None:
    url = f"{postgres_server.url}?table=cli_check&create=true"
    code, out, err = _check(capsys, url)
    assert code == 0, err
    assert "PostgresDeduplicationStore" in out and out.rstrip().endswith("ok")
    assert ":dedup@" not in out  # the password is masked


@pytest.mark.redis
def test_check_redis_with_aof(capsys: pytest.CaptureFixture[str]) -> None:
    with RedisServer(appendonly=True, appendfsync="always") as server:
        code, out, err = _check(capsys, server.url)
    assert code == 0, err
    assert "warning" not in out and out.rstrip().endswith("ok")


@pytest.mark.redis
def test_check_warns_when_redis_has_no_append_only_file(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with RedisServer(appendonly=False) as server:
        code, out, err = _check(capsys, server.url)
    assert code == 0, err
    assert "warning" in out and "append" in out.lower()
    assert "with 1 warning" in out or "warning(s)" in out


@pytest.mark.dynamodb
def test_check_dynamodb(
    capsys: pytest.CaptureFixture[str], dynamodb_server: DynamoDBEndpoint
) -> None:
    table = f"cli-{uuid.uuid4().hex[:8]}"
    url = (
        f"dynamodb://{table}?region={dynamodb_server.region}"
        f"&endpoint_url={dynamodb_server.endpoint_url}&create=true"
    )
    code, out, err = _check(capsys, url)
    assert code == 0, err
    assert "DynamoDBDeduplicationStore" in out and "ok" in out


@pytest.mark.cosmos
def test_check_cosmos_emulator_with_the_unsafe_option(
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    cosmos_server: CosmosEndpoint,
) -> None:
    url = _cosmos_url(
        cosmos_server,
        f"c{uuid.uuid4().hex[:8]}",
        "allow_weak_consistency_for_emulator_only=true&create=true",
    )
    os.environ["COSMOS_KEY"] = cosmos_server.key
    try:
        code, out, err = _check(capsys, url)
    finally:
        del os.environ["COSMOS_KEY"]
    assert code == 0, err
    assert "warning" in out.lower()  # the unsafe option is reported
    assert cosmos_server.key not in out
    assert "UNSAFE" in caplog.text.upper()  # logged at open ...
    assert cosmos_server.key not in caplog.text  # ... without the key


# ---------------------------------------------------------------------- errors


@pytest.mark.postgres
def test_check_postgres_wrong_password(
    capsys: pytest.CaptureFixture[str], postgres_server: Server
) -> None:
    url = postgres_server.url.replace(":dedup@", ":not-the-password@")
    code, _, err = _check(capsys, url)
    assert code == 2
    _assert_one_line(err, "password", secret="not-the-password")


@pytest.mark.postgres
def test_check_postgres_missing_table(
    capsys: pytest.CaptureFixture[str], postgres_server: Server
) -> None:
    code, _, err = _check(capsys, f"{postgres_server.url}?table=no_such_table_here")
    assert code == 2
    _assert_one_line(err, "no_such_table_here")


@pytest.mark.postgres
def test_check_postgres_unknown_host(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _check(
        capsys, f"postgresql://dedup:secret-pw@127.0.0.1:{free_port()}/dedup?connect_timeout=3"
    )
    assert code == 3
    _assert_one_line(err, "unavailable", secret="secret-pw")


@pytest.mark.redis
def test_check_redis_wrong_password(capsys: pytest.CaptureFixture[str]) -> None:
    with RedisServer(requirepass="right-secret") as server:
        url = server.url.replace("redis://", "redis://:wrong-secret@")
        code, _, err = _check(capsys, url)
        assert code == 2
        _assert_one_line(err, "password", secret="wrong-secret")
        right = server.url.replace("redis://", "redis://:right-secret@")
        assert _check(capsys, right)[0] == 0


@pytest.mark.redis
def test_check_redis_unknown_host(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _check(capsys, f"redis://127.0.0.1:{free_port()}/0")
    assert code == 3
    _assert_one_line(err, "unavailable")


@pytest.mark.dynamodb
def test_check_dynamodb_missing_table(
    capsys: pytest.CaptureFixture[str], dynamodb_server: DynamoDBEndpoint
) -> None:
    url = (
        f"dynamodb://no-such-table?region={dynamodb_server.region}"
        f"&endpoint_url={dynamodb_server.endpoint_url}"
    )
    code, _, err = _check(capsys, url)
    assert code == 2
    _assert_one_line(err, "no-such-table")


@pytest.mark.dynamodb
def test_check_dynamodb_wrong_credentials(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("INITIAL_NO_AUTH_ACTION_COUNT", "0")  # moto checks every signature
    with MotoServer() as server:
        url = f"dynamodb://dedup?region=us-east-1&endpoint_url={server.endpoint_url}"
        code, _, err = _check(capsys, url)
    assert code == 2
    _assert_one_line(err, secret="testing-secret-Qx")


@pytest.mark.dynamodb
def test_check_dynamodb_unknown_host(capsys: pytest.CaptureFixture[str]) -> None:
    url = (
        f"dynamodb://dedup?region=us-east-1&endpoint_url=http://127.0.0.1:{free_port()}"
        "&retries=0&connect_timeout=2"
    )
    code, _, err = _check(capsys, url)
    assert code == 3
    _assert_one_line(err, "unavailable")


@pytest.mark.cosmos
def test_check_refuses_a_cosmos_account_weaker_than_strong(
    capsys: pytest.CaptureFixture[str], cosmos_server: CosmosEndpoint
) -> None:
    url = _cosmos_url(cosmos_server, "any", f"key={cosmos_server.key}")
    code, _, err = _check(capsys, url)
    assert code == 2
    _assert_one_line(err, "strong", secret=cosmos_server.key)


@pytest.mark.cosmos
def test_check_cosmos_missing_container(
    capsys: pytest.CaptureFixture[str], cosmos_server: CosmosEndpoint
) -> None:
    url = _cosmos_url(
        cosmos_server,
        "no-such-container",
        f"allow_weak_consistency_for_emulator_only=true&key={cosmos_server.key}",
    )
    code, _, err = _check(capsys, url)
    assert code == 2
    _assert_one_line(err, "does not exist", secret=cosmos_server.key)
    assert "no-such-container" in err or "database 'cli'" in err


# ---------------------------------------------------------------------- never create


def _read_only_commands(url: str) -> list[list[str]]:
    """Commands that must never create a store, on a URL that would otherwise create it."""
    return [
        ["has", url, "a"],
        ["purge", url],
        ["entities", "show", url, "e1"],
        ["entities", "pending", url],
        ["entities", "sweep", url, "--dedup", url],
    ]


def _assert_never_created(capsys: pytest.CaptureFixture[str], url: str, *names: str) -> None:
    for argv in _read_only_commands(url):
        assert main(argv) == 2, argv
        _assert_one_line(capsys.readouterr().err, "no such store", *names)


@pytest.mark.postgres
def test_read_only_commands_never_create_a_postgres_table(
    capsys: pytest.CaptureFixture[str], postgres_server: Server
) -> None:
    from dedupstore import ConfigurationError, open_store

    table = f"cli_missing_{uuid.uuid4().hex[:8]}"
    _assert_never_created(capsys, f"{postgres_server.url}?table={table}&create=true", table)
    code, _, err = _check(capsys, f"{postgres_server.url}?table={table}")
    assert code == 2
    _assert_one_line(err, "no such store", table)
    with pytest.raises(ConfigurationError, match="does not exist"):
        open_store(f"{postgres_server.url}?table={table}")


@pytest.mark.dynamodb
def test_read_only_commands_never_create_a_dynamodb_table(
    capsys: pytest.CaptureFixture[str], dynamodb_server: DynamoDBEndpoint
) -> None:
    from dedupstore import ConfigurationError, open_store

    table = f"cli-missing-{uuid.uuid4().hex[:8]}"
    base = (
        f"dynamodb://{table}?region={dynamodb_server.region}"
        f"&endpoint_url={dynamodb_server.endpoint_url}"
    )
    _assert_never_created(capsys, f"{base}&create=true", table)
    with pytest.raises(ConfigurationError, match="does not exist"):
        open_store(base)


@pytest.mark.cosmos
def test_read_only_commands_never_create_a_cosmos_container(
    capsys: pytest.CaptureFixture[str],
    cosmos_server: CosmosEndpoint,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from dedupstore import ConfigurationError, open_store

    monkeypatch.setenv("COSMOS_KEY", cosmos_server.key)
    container = f"missing{uuid.uuid4().hex[:8]}"
    weak = "allow_weak_consistency_for_emulator_only=true"
    _assert_never_created(capsys, _cosmos_url(cosmos_server, container, f"{weak}&create=true"))
    with pytest.raises(ConfigurationError, match="does not exist"):
        open_store(_cosmos_url(cosmos_server, container, weak))
