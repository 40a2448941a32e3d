"""The ``dedupstore`` command (the demo job and the Spark sweep: tests/test_spark.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from dedupstore import open_store
from dedupstore.cli import main

pytestmark = pytest.mark.sqlite


@pytest.fixture(autouse=True)
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    for var in ("DEDUPSTORE_ENV", "DEDUPSTORE_URL", "DEDUPSTORE_CONFIG", "DEDUPSTORE_ENTITIES_URL"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path


def test_add_and_has(capsys: pytest.CaptureFixture[str]) -> None:
    url = "sqlite:///cli.db"
    assert main(["add", url, "a", "b", "a"]) == 0
    # one line per argument: the repeated "a" is a duplicate of the first
    assert capsys.readouterr().out.splitlines() == ["a\tadded", "b\tadded", "a\tduplicate"]
    assert main(["add", url, "b", "c"]) == 0
    assert capsys.readouterr().out.splitlines() == ["b\tduplicate", "c\tadded"]
    assert main(["has", url, "a", "c"]) == 0
    assert main(["has", url, "a", "zzz"]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == "zzz\tnot processed"
    assert main(["has", url, "--endpoint", "other", "a"]) == 1


def test_check_round_trips_a_probe(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "sqlite:///cli.db"]) == 0
    out = capsys.readouterr().out
    assert "SqliteDeduplicationStore" in out and "ms" in out and out.rstrip().endswith("ok")
    with open_store("sqlite:///cli.db", endpoint="default") as store:
        assert store.processed_among(["x"]) == set()  # the probe lives under its own endpoint


def test_purge(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["purge", "sqlite:///cli.db"]) == 0
    assert "purged 0 expired record(s)" in capsys.readouterr().out


def test_config_masks_secrets(
    in_tmp: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (in_tmp / "dedupstore.toml").write_text(
        "[default]\nurl = 'postgresql://app:${PW}@db/app'\n[default.options]\npassword='${PW}'\n"
    )
    monkeypatch.setenv("PW", "hunter2-secret")
    assert main(["config"]) == 0
    out = capsys.readouterr().out
    assert "hunter2" not in out and "***" in out


@pytest.mark.parametrize(
    ("argv", "code", "fragment"),
    [
        (["add", "foo://x", "a"], 2, "unknown store URL scheme"),
        (["add", "sqlite:///cli.db", ""], 2, "must not be empty"),
        (["has", "sqlite:///cli.db", "a\x00b"], 2, "NUL"),
        (["check", "sqlite:///cli.db?bogus=1"], 2, "unknown option 'bogus'"),
        (
            ["check", "postgresql://u:hunter2@127.0.0.1:1/x"],
            2,
            "pip install 'dedupstore[postgres]'",
        ),
        (["check", "sqlite://u:hunter2@host/x.db"], 2, "'sqlite://u:***@host/x.db'"),
        (["add", "postgresql://u:hun/ter2#?@db/x", "a"], 2, "percent-encode it"),
        (["add", "sqlite:///cli.db?timeout=-1", "a"], 2, "bad value for option 'timeout'"),
        (["add", "sqlite:///cli.db?timeout=nan", "a"], 2, "bad value for option 'timeout'"),
        (["add", "sqlite:///cli.db?synchronous=3", "a"], 2, "expected one of OFF, NORMAL"),
        (["add", "sqlite:///cli.db?retention=99999999999d", "a"], 2, "at most 1000 years"),
        (["add", "sqlite:///cli.db?create_schema=false", "a"], 2, "is now called 'create'"),
    ],
)
def test_errors_are_one_line_without_traceback(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
    code: int,
    fragment: str,
) -> None:
    if argv[1].startswith("postgresql"):
        monkeypatch.setitem(sys.modules, "psycopg", None)
    assert main(argv) == code
    captured = capsys.readouterr()
    assert fragment in captured.err
    assert len(captured.err.strip().splitlines()) == 1
    assert captured.out == ""
    assert "hunter2" not in captured.err and "hun/ter2" not in captured.err


@pytest.mark.parametrize(
    ("toml", "fragment"),
    [
        ("[default]\nurl = 'sqlite:///x.db'\n[default.options]\ntimeout = '5'\n", None),
        ("[default]\nurl = 'sqlite:///x.db'\n[default.options]\ntimeout = 1e400\n", "finite"),
        ("[default]\nurl = 'sqlite:///x.db'\noptions = 5\n", "'options' must be a table"),
        ("[default]\nurl = 'memory://${X'\n", "not a variable reference"),
        (
            "[default]\nurl = 'sqlite:///x.db'\nretention = '1h'\n"
            "[default.options]\nretention = '2h'\n",
            "set both in the table and under its options",
        ),
        (
            "[default]\nurl = 'sqlite:///x.db?timeout=2'\n[default.options]\ntimeout = 3\n",
            "set both",
        ),
        ("[default]\nurl = 'sqlite:///x.db'\nretention = '99999999999d'\n", "1000 years"),
    ],
)
def test_config_values_give_one_line_errors(
    in_tmp: Path, capsys: pytest.CaptureFixture[str], toml: str, fragment: str | None
) -> None:
    (in_tmp / "dedupstore.toml").write_text(toml)
    code = main(["add", "config", "a"])
    captured = capsys.readouterr()
    if fragment is None:
        assert code == 0, captured.err
        assert captured.out == "a\tadded\n"
    else:
        assert code == 2
        assert fragment in captured.err and len(captured.err.splitlines()) == 1


def test_a_non_utf8_config_file_is_a_one_line_error(
    in_tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (in_tmp / "dedupstore.toml").write_bytes(b"[default]\nurl = 'sqlite:///\xff.db'\n")
    assert main(["add", "config", "a"]) == 2
    assert "not UTF-8" in capsys.readouterr().err


def test_an_environment_nobody_defines_is_an_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], in_tmp: Path
) -> None:
    monkeypatch.setenv("DEDUPSTORE_ENV", "prod")
    assert main(["add", "config", "a"]) == 2
    assert "DEDUPSTORE_ENV='prod'" in capsys.readouterr().err
    assert not (in_tmp / ".dedupstore").exists(), "nothing may be written to the embedded store"


def test_a_generated_password_is_encoded_into_the_url(
    in_tmp: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from dedupstore.config import resolve_config
    from dedupstore.urls import StoreURL

    (in_tmp / "dedupstore.toml").write_text("[default]\nurl = 'postgresql://app:${PW}@db/app'\n")
    monkeypatch.setenv("PW", "a/b#c?d@e")
    url = StoreURL.parse(resolve_config().url)
    assert url.password == "a/b#c?d@e" and url.host == "db" and url.path == "/app"
    monkeypatch.setitem(sys.modules, "psycopg", None)
    assert main(["config"]) == 0
    out = capsys.readouterr().out
    assert "a/b#c" not in out and "a%2Fb" not in out and "***" in out


def test_sqlite_check_warns_about_weak_synchronous(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "sqlite:///cli.db?synchronous=off"]) == 0
    out = capsys.readouterr().out
    assert "warning:   synchronous=OFF" in out and "ok with 1 warning(s)" in out


def _outbox_fixture() -> None:
    """Five messages over two entities, processed with deferred clean-up (ids in outboxes)."""
    from dedupstore import open_entity_store
    from dedupstore.outbox import InMemoryDispatcher, Message, OutboxProcessor, Send

    with open_entity_store() as entities, open_store() as dedup:
        processor = OutboxProcessor(entities, dedup, InMemoryDispatcher(), cleanup="deferred")
        for n in range(5):
            processor.process(
                Message(f"m{n}", f"order-{n % 2}", n),
                lambda state, m: ({"n": state.get("n", 0) + 1}, [Send("x", {"m": m.id})]),
            )


def test_entities_show_pending_and_sweep(capsys: pytest.CaptureFixture[str]) -> None:
    _outbox_fixture()
    assert main(["entities", "show", "config", "order-1"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["state"] == {"n": 2} and shown["outbox"] == {"m1": None, "m3": None}
    assert main(["entities", "show", "config", "nobody"]) == 0
    assert json.loads(capsys.readouterr().out)["version"] is None
    assert main(["entities", "pending", "config", "--list"]) == 0
    out = capsys.readouterr().out
    assert "order-0\tpending=0\tdispatched=3" in out
    assert out.endswith("2 entities with 5 outbox entries (segment 0 of 1)\n")
    counted = 0
    for segment in range(3):
        assert (
            main(["entities", "pending", "config", "--segment", str(segment), "--segments", "3"])
            == 0
        )
        counted += int(capsys.readouterr().out.split()[0])
    assert counted == 2, "segments are disjoint and complete"
    assert main(["entities", "sweep", "config"]) == 0
    assert json.loads(capsys.readouterr().out)["ids_moved"] == 5
    assert main(["has", "config", "m0", "m1", "m2", "m3", "m4"]) == 0
    capsys.readouterr()
    assert main(["entities", "pending", "config"]) == 0
    assert capsys.readouterr().out.startswith("0 entities")


def test_entities_bad_input_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["entities", "pending", "config", "--segment", "3", "--segments", "2"]) == 2
    assert "--segment must be below" in capsys.readouterr().err
    assert main(["entities", "show", "config", "bad\x00id"]) == 2
    assert main(["entities", "show", "nosuch://x", "e"]) == 2
    err = capsys.readouterr().err
    assert "unknown entity store URL scheme" in err and "Traceback" not in err
