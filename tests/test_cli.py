"""The ``dedupstore`` command (the demo job and the Spark sweep: tests/test_spark.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

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
    open_store("sqlite:///cli.db").close()
    assert main(["check", "sqlite:///cli.db"]) == 0
    out = capsys.readouterr().out
    assert "SqliteDeduplicationStore" in out and "ms" in out and out.rstrip().endswith("ok")
    with open_store("sqlite:///cli.db", endpoint="default") as store:
        assert store.processed_among(["x"]) == set()  # the probe lives under its own endpoint


def test_check_of_a_store_that_loses_its_probe_exits_2(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from dedupstore.backends.sqlite import SqliteDeduplicationStore

    open_store("sqlite:///cli.db").close()
    monkeypatch.setattr(SqliteDeduplicationStore, "_contains_one", lambda *_: False)
    monkeypatch.setattr(SqliteDeduplicationStore, "_find", lambda *_: set())
    assert main(["check", "sqlite:///cli.db"]) == 2
    assert "probe round trip failed" in capsys.readouterr().err


def test_purge(capsys: pytest.CaptureFixture[str]) -> None:
    open_store("sqlite:///cli.db").close()
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
        (["add", "sqlite:///cli.db?create_schema=false", "a"], 2, "unknown option 'create_schema'"),
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
    assert main(["check", "sqlite:///cli.db?synchronous=off&create=true"]) == 0
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
    assert main(["entities", "show", "config", "nobody"]) == 1
    assert capsys.readouterr().out == ""
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
    # the processor records message_key(entity, id): --entity finds them
    assert main(["has", "config", "--entity", "order-0", "m0", "m2", "m4"]) == 0
    assert main(["has", "config", "--entity", "order-1", "m1", "m3"]) == 0
    assert main(["has", "config", "--entity", "order-1", "m0"]) == 1
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


# ---------------------------------------------------------------------- configuration paths


@pytest.mark.parametrize("file_name", ["dedupstore.toml", "pyproject.toml"])
def test_relative_sqlite_paths_in_a_config_file_are_relative_to_the_file(
    in_tmp: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    file_name: str,
) -> None:
    table = "[tool.dedupstore.default]" if file_name == "pyproject.toml" else "[default]"
    (in_tmp / file_name).write_text(
        f"{table}\nurl = 'sqlite:///data/dedup.db'\nentities_url = 'sqlite:///data/ents.db'\n"
    )
    assert main(["add", "config", "a"]) == 0
    sub = in_tmp / "pkg" / "deeper"
    sub.mkdir(parents=True)
    monkeypatch.chdir(sub)
    capsys.readouterr()
    assert main(["has", "config", "a"]) == 0, capsys.readouterr()
    assert capsys.readouterr().out == "a\tprocessed\n"
    assert main(["add", "config", "a"]) == 0
    assert capsys.readouterr().out == "a\tduplicate\n"
    assert not (sub / "data").exists(), "nothing may be created beside the current directory"
    assert main(["config"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["url"] == f"sqlite:///{in_tmp / 'data' / 'dedup.db'}"
    assert shown["entities_url"] == f"sqlite:///{in_tmp / 'data' / 'ents.db'}"


def test_path_options_in_a_config_file_are_relative_to_the_file(
    in_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dedupstore.config import resolve_config

    (in_tmp / "conf").mkdir()
    (in_tmp / "conf" / "dedupstore.toml").write_text(
        "[default]\nurl = 'rediss://cache:6380/0'\n"
        "entities_url = 'postgresql://app@db/app?sslrootcert=certs/root.pem&sslmode=verify-full'\n"
        "[default.options]\nssl_ca_certs = 'certs/ca.pem'\n"
        "[default.entities_options]\nsslkey = '/etc/abs.key'\nsslcert = 'certs/c.pem'\n"
    )
    monkeypatch.setenv("DEDUPSTORE_CONFIG", str(in_tmp / "conf" / "dedupstore.toml"))
    base = in_tmp / "conf"
    assert resolve_config().options == {"ssl_ca_certs": str(base / "certs" / "ca.pem")}
    entities = resolve_config(entities=True)
    assert f"sslrootcert={base}/certs/root.pem".replace("/", "%2F") in entities.url
    assert "sslmode=verify-full" in entities.url
    assert entities.options == {"sslkey": "/etc/abs.key", "sslcert": str(base / "certs" / "c.pem")}
    # a URL from the environment is relative to the current directory, as any command line
    monkeypatch.setenv("DEDUPSTORE_URL", "sqlite:///here.db")
    assert resolve_config().url == "sqlite:///here.db"


# ---------------------------------------------------------------------- read-only commands


READ_ONLY = [
    pytest.param(["has", "{url}", "a"], id="has"),
    pytest.param(["purge", "{url}"], id="purge"),
    pytest.param(["check", "{url}"], id="check"),
    pytest.param(["entities", "show", "{url}", "e1"], id="entities-show"),
    pytest.param(["entities", "pending", "{url}"], id="entities-pending"),
    pytest.param(["entities", "sweep", "{url}", "--dedup", "{url}"], id="entities-sweep"),
    pytest.param(["stats", "--entities", "{url}", "--store", "{url}"], id="stats"),
    pytest.param(["stats", "--store", "{url}", "--json"], id="stats-store"),
]


@pytest.mark.parametrize("argv", READ_ONLY)
def test_read_only_commands_never_create_a_missing_file(
    in_tmp: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    url = "sqlite:///typo/dedpu.db"
    assert main([a.replace("{url}", url) for a in argv]) == 2
    err = capsys.readouterr().err
    assert "no such store" in err and str(in_tmp / "typo" / "dedpu.db") in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert list(in_tmp.iterdir()) == [], "nothing may be created"


@pytest.mark.parametrize("argv", READ_ONLY)
def test_read_only_commands_never_create_a_missing_table(
    in_tmp: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    import sqlite3

    sqlite3.connect(in_tmp / "other.db").execute("CREATE TABLE unrelated (x)").connection.close()
    url = "sqlite:///other.db"
    assert main([a.replace("{url}", url) for a in argv]) == 2
    err = capsys.readouterr().err
    assert "no such store" in err and "does not exist" in err, err
    assert "dedup_records" in err or "dedup_entities" in err
    tables = sqlite3.connect(in_tmp / "other.db").execute("SELECT name FROM sqlite_master")
    assert [row[0] for row in tables] == ["unrelated"]


def test_read_only_commands_on_the_configured_store_create_nothing(
    in_tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["has", "config", "a"]) == 2
    assert "no such store" in capsys.readouterr().err
    assert main(["entities", "show", "config", "e1"]) == 2
    assert "no such store" in capsys.readouterr().err
    assert main(["stats"]) == 2
    assert "no such store" in capsys.readouterr().err
    assert not (in_tmp / ".dedupstore").exists()


def test_the_spark_sweep_refuses_a_missing_store_before_starting_spark(
    in_tmp: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import dedupstore.spark.session

    def no_spark(*_: object) -> None:
        raise AssertionError("Spark must not start for a missing store")

    monkeypatch.setattr(dedupstore.spark.session, "local_session", no_spark)
    url = "sqlite:///typo.db"
    assert main(["sweep", "--entities", url, "--store", url]) == 2
    err = capsys.readouterr().err
    assert "no such store" in err and str(in_tmp / "typo.db") in err
    assert list(in_tmp.iterdir()) == []


def test_check_creates_only_when_asked(in_tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "sqlite:///new.db"]) == 2
    assert "no such store" in capsys.readouterr().err
    assert main(["check", "sqlite:///new.db?create=true"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("ok")
    assert main(["check", "sqlite:///new.db"]) == 0


def test_must_exist_is_a_keyword_option_of_every_store(in_tmp: Path) -> None:
    from dedupstore import ConfigurationError, open_entity_store

    with pytest.raises(ConfigurationError, match="no such store"):
        open_store("sqlite:///x.db?create=true", must_exist=True)
    with pytest.raises(ConfigurationError, match="no such store"):
        open_entity_store("sqlite:///x.db", must_exist=True)
    assert not (in_tmp / "x.db").exists()
    with pytest.raises(ConfigurationError, match="unknown option 'must_exist'"):
        open_store("sqlite:///x.db?must_exist=true")
    open_store("sqlite:///x.db").close()
    with open_store("sqlite:///x.db", must_exist=True) as store:
        assert store.add("a") and "must_exist=True" in repr(store)
    # memory:// has nothing to create: every name exists
    open_store("memory://anything", must_exist=True).close()


# ---------------------------------------------------------------------- operating-system errors


@pytest.mark.parametrize(
    ("path", "fragment"),
    [
        ("/proc/x/y.db", "/proc/x"),
        ("/proc/self/y.db", "/proc/self"),
        ("/sys/kernel/y.db", "/sys/kernel"),
        ("{tmp}/a-file/y.db", "a-file"),
        ("{tmp}/a-dir", "a-dir"),
    ],
)
def test_os_errors_that_cannot_heal_are_configuration_errors(
    in_tmp: Path, capsys: pytest.CaptureFixture[str], path: str, fragment: str
) -> None:
    (in_tmp / "a-file").write_text("not a directory")
    (in_tmp / "a-dir").mkdir()
    url = "sqlite:///" + path.replace("{tmp}", str(in_tmp)) + "?timeout=2"
    assert main(["add", url, "a"]) == 2
    err = capsys.readouterr().err
    assert fragment in err and "retry later" not in err, err
    assert len(err.strip().splitlines()) == 1


def test_a_read_only_directory_is_a_configuration_error(
    in_tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import os
    import subprocess
    import sys

    if os.geteuid() != 0:
        (in_tmp / "ro").mkdir(mode=0o500)
        try:
            assert main(["add", "sqlite:///ro/x.db?timeout=2", "a"]) == 2
        finally:
            (in_tmp / "ro").chmod(0o700)
        err = capsys.readouterr().err
        assert "ro" in err and "ermission denied" in err, err
        return
    # root writes anywhere: the command runs as root without the capabilities that
    # override file permissions (util-linux setpriv), so the directory's mode applies
    (in_tmp / "ro").mkdir(mode=0o555)
    drop = "-dac_override,-dac_read_search"
    command = [
        *("setpriv", f"--inh-caps={drop}", f"--bounding-set={drop}", "--"),
        *(sys.executable, "-m", "dedupstore.cli", "add", "sqlite:///ro/x.db?timeout=2", "a"),
    ]
    try:
        done = subprocess.run(command, cwd=in_tmp, capture_output=True, text=True, timeout=120)
    finally:
        (in_tmp / "ro").chmod(0o700)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "ro" in done.stderr and "ermission denied" in done.stderr, done.stderr


# ---------------------------------------------------------------------- entities show


def test_entities_show_of_an_unknown_entity_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    _outbox_fixture()
    capsys.readouterr()
    assert main(["entities", "show", "config", "nobody"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "entity 'nobody' does not exist" in captured.err


# ---------------------------------------------------------------------- Spark commands


def test_the_command_list_and_other_commands_never_import_pyspark(in_tmp: Path) -> None:
    """``sweep`` and ``demo`` are command plugins (dedupstore.spark.cli): listing them
    imports no pyspark, and a built-in command does not load them at all."""
    import subprocess
    import textwrap

    code = textwrap.dedent(
        """
        import contextlib, io, sys
        from dedupstore.cli import main

        def spark():
            return sorted(m for m in sys.modules if m.split(".")[0] == "pyspark"
                          or m.startswith("dedupstore.spark"))

        assert main(["add", "sqlite:///x.db", "a"]) == 0
        assert spark() == [], spark()
        listed = io.StringIO()
        with contextlib.redirect_stdout(listed), contextlib.suppress(SystemExit):
            main(["--help"])
        assert "the Spark sweep" in listed.getvalue() and "the order pipeline" in listed.getvalue()
        assert spark() == ["dedupstore.spark", "dedupstore.spark.cli"], spark()
        print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=in_tmp, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["a\tadded", "ok"]


def test_the_core_cli_names_no_spark_module() -> None:
    source = (Path(__file__).resolve().parents[1] / "dedupstore" / "cli.py").read_text()
    assert "dedupstore.spark" not in source and "spark_integration" not in source


# ---------------------------------------------------------------------- demo


def test_demo_help_lists_the_job_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--orders" in out and "--master" in out


def test_demo_hands_its_arguments_to_the_job(monkeypatch: pytest.MonkeyPatch) -> None:
    import dedupstore.spark.order_pipeline as job

    seen: list[list[str]] = []
    monkeypatch.setattr(job, "main", lambda argv=None, **_: seen.append(list(argv)) or 0)
    assert main(["demo", "--orders", "10", "--seed", "3"]) == 0
    assert main(["demo"]) == 0
    assert seen == [["--orders", "10", "--seed", "3"], []]


# ---------------------------------------------------------------------- config output


def test_config_shows_entities_url_and_compact_durations(
    in_tmp: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (in_tmp / "dedupstore.toml").write_text(
        "[default]\nurl = 'sqlite:///d.db'\nretention = '30d'\n"
        "entities_url = 'postgresql://app:${PW}@db/app?table=ents'\n"
    )
    monkeypatch.setenv("PW", "hunter2-secret")
    monkeypatch.setitem(sys.modules, "psycopg", None)
    assert main(["config"]) == 0
    out = capsys.readouterr().out
    shown = json.loads(out)
    assert shown["options"]["retention"] == "30d"
    assert shown["entities_url"] == "postgresql://app:***@db/app?table=ents"
    assert "hunter2" not in out and "days" not in out


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30d", 30 * 86400),
        ("1h30m", 5400),
        ("10s", 10),
        ("1d2h3m4s", 93784),
        ("250ms", 0.25),
        ("1m0.5s", 60.5),
        ("2s500ms", 2.5),
        ("1.5ms", 0.0015),
        ("365250d", 365250 * 86400),
    ],
)
def test_durations_round_trip(text: str, seconds: float) -> None:
    from datetime import timedelta

    from dedupstore.options import format_duration, parse_duration

    duration = parse_duration(text)
    assert duration == timedelta(seconds=seconds)
    assert format_duration(duration) == text.replace("1m0.5s", "1m500ms")
    assert parse_duration(format_duration(duration)) == duration


def test_formatted_durations_parse_back_exactly() -> None:
    import random
    from datetime import timedelta

    from dedupstore.options import format_duration, parse_duration

    rng = random.Random(7)
    for _ in range(2000):
        duration = timedelta(microseconds=rng.randint(1, 3 * 10**16))
        assert parse_duration(format_duration(duration)) == duration, duration
    assert format_duration(timedelta(weeks=2)) == "14d"
    assert format_duration(timedelta(hours=1, microseconds=1)) == "1h0.001ms"


# ---------------------------------------------------------------------- message identity


def test_has_and_add_with_entity_use_the_processor_key(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from dedupstore.ids import message_key

    url = "sqlite:///ids.db"
    with open_store(url) as store:
        store.add(message_key("alice", "txn-1"))
    assert main(["has", url, "txn-1", "--entity", "alice"]) == 0
    assert capsys.readouterr().out == "txn-1\tprocessed\n"
    assert main(["has", url, "txn-1", "--entity", "bob"]) == 1
    assert main(["has", url, "txn-1"]) == 1, "without --entity the bare id is checked"
    capsys.readouterr()
    assert main(["add", url, "--entity", "bob", "txn-1"]) == 0
    assert capsys.readouterr().out == "txn-1\tadded\n"
    with open_store(url) as store:
        assert store.has_been_processed(message_key("bob", "txn-1"))
        assert not store.has_been_processed("txn-1")
    assert main(["has", url, "txn-1", "--entity", "bad\x00"]) == 2
    assert "entity" in capsys.readouterr().err


@pytest.mark.parametrize(
    "url", ["postgres://", "postgresql:///db", "redis://", "rediss:///0", "cosmos://"]
)
def test_a_url_without_a_host_is_a_configuration_error(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not "retry later" (exit 3) after a connection refused on a default host: exit 2."""
    from dedupstore.cli import main

    assert main(["add", url, "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dedupstore: error:") and "host" in err, err


# ---------------------------------------------------------------------- the consumer's identity


def _deposit(state: dict[str, Any], message: Any) -> tuple[dict[str, Any], list[Any]]:
    return {"balance": state.get("balance", 0) + message.body["amount"]}, []


def _accounts_deposit(url: str) -> Any:
    """An `accounts` consumer with deferred clean-up processes one deposit of 100."""
    from dedupstore import open_entity_store
    from dedupstore.outbox import InMemoryDispatcher, Message, OutboxProcessor

    deposit = Message("dep-1", "acct-1", {"amount": 100})
    with open_entity_store(url) as entities, open_store(url, endpoint="accounts") as dedup:
        processor = OutboxProcessor(entities, dedup, InMemoryDispatcher(), cleanup="deferred")
        assert processor.process(deposit, _deposit).outcome == "processed"
    return deposit


def _again(url: str, deposit: Any) -> tuple[str, dict[str, Any]]:
    from dedupstore import open_entity_store
    from dedupstore.outbox import InMemoryDispatcher, OutboxProcessor

    with open_entity_store(url) as entities, open_store(url, endpoint="accounts") as dedup:
        processor = OutboxProcessor(entities, dedup, InMemoryDispatcher(), cleanup="deferred")
        outcome = processor.process(deposit, _deposit).outcome
        return outcome, entities.load("acct-1").state


def test_a_sweep_without_endpoint_moves_ids_to_the_consumer_recorded_with_the_entities(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Issue 36, 1: the README's sweep line, no --endpoint, after an `accounts` consumer."""
    url = "sqlite:///sw.db"
    deposit = _accounts_deposit(url)
    assert main(["entities", "sweep", url, "--dedup", url]) == 0
    assert json.loads(capsys.readouterr().out)["ids_moved"] == 1
    with open_store(url, endpoint="accounts") as dedup, open_store(url) as default:
        assert dedup.count() == 1 and default.count() == 0
    assert _again(url, deposit) == ("duplicate", {"balance": 100})


def test_a_sweep_under_another_endpoint_is_refused_before_any_write(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from dedupstore import open_entity_store

    url = "sqlite:///sw.db"
    deposit = _accounts_deposit(url)
    assert main(["entities", "sweep", url, "--dedup", url, "--endpoint", "default"]) == 2
    err = capsys.readouterr().err
    assert "'accounts'" in err and "'default'" in err and "acct-1" in err, err
    with open_store(url) as default, open_entity_store(url) as entities:
        assert default.count() == 0
        assert entities.load("acct-1").outbox == {"dep-1": None}, "the outbox kept its id"
    # a configured endpoint is an endpoint given: refused the same way
    assert main(["entities", "sweep", url, "--dedup", url + "?endpoint=billing"]) == 2
    assert "'billing'" in capsys.readouterr().err
    assert _again(url, deposit) == ("duplicate", {"balance": 100})


def test_a_sweep_without_endpoint_of_a_store_of_two_consumers_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from dedupstore import open_entity_store
    from dedupstore.outbox import InMemoryDispatcher, Message, OutboxProcessor

    url = "sqlite:///sw.db"
    _accounts_deposit(url)
    with open_entity_store(url) as entities, open_store(url, endpoint="billing") as dedup:
        processor = OutboxProcessor(entities, dedup, InMemoryDispatcher(), cleanup="deferred")
        processor.process(Message("b-1", "invoice-1", {"amount": 1}), _deposit)
    assert main(["entities", "sweep", url, "--dedup", url]) == 2
    err = capsys.readouterr().err
    assert "'accounts', 'billing'" in err and "--endpoint" in err, err
    with open_entity_store(url) as entities:
        assert entities.load("acct-1").outbox == {"dep-1": None}
        assert entities.load("invoice-1").outbox == {"b-1": None}


def test_has_finds_an_id_awaiting_the_sweep_in_its_entity_outbox(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Issue 36: under deferred clean-up `has` said "not processed" for a processed message."""
    url = "sqlite:///sw.db"
    _accounts_deposit(url)
    argv = ["has", url, "--endpoint", "accounts", "--entity", "acct-1", "dep-1", "dep-2"]
    assert main([*argv, "--entities", url]) == 1
    assert capsys.readouterr().out.splitlines() == ["dep-1\tprocessed", "dep-2\tnot processed"]
    assert main(argv) == 1  # the deduplication store alone: says where else to look
    assert "--entities" in capsys.readouterr().err
    # another consumer's entity says nothing about this one: refused
    assert main(["has", url, "--entity", "acct-1", "dep-1", "--entities", url]) == 2
    assert "'accounts'" in capsys.readouterr().err
    assert main(["has", url, "dep-1", "--entities", url]) == 2, "--entities needs --entity"
    capsys.readouterr()
    # after the sweep the id is in the deduplication store: the same answer
    assert main(["entities", "sweep", url, "--dedup", url]) == 0
    capsys.readouterr()
    assert main([*argv[:-1], "--entities", url]) == 0
    assert main(argv[:-1]) == 0
