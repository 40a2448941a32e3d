"""The ``dedupstore`` command and the demo job."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dedupstore import open_store
from dedupstore.cli import main
from dedupstore.demo import run_demo

pytestmark = pytest.mark.sqlite


@pytest.fixture(autouse=True)
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    for var in ("DEDUPSTORE_ENV", "DEDUPSTORE_URL", "DEDUPSTORE_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path


def test_add_and_has(capsys: pytest.CaptureFixture[str]) -> None:
    url = "sqlite:///cli.db"
    assert main(["add", url, "a", "b", "a"]) == 0
    assert capsys.readouterr().out.splitlines() == ["a\tadded", "b\tadded"]
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
        (["check", "postgresql://u:hunter2@127.0.0.1:1/x"], 2, "dedupstore"),
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
    err = capsys.readouterr().err
    assert fragment in err
    assert len(err.strip().splitlines()) == 1
    assert "Traceback" not in err and "hunter2" not in err


def test_console_script_runs_the_demo(in_tmp: Path) -> None:
    exe = shutil.which("dedupstore") or str(Path(sys.executable).with_name("dedupstore"))
    result = subprocess.run(
        [exe, "demo", "--messages", "300", "--threads", "3", "--seed", "7"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "each message processed exactly once: yes" in result.stdout
    assert (in_tmp / ".dedupstore" / "dedup.db").is_file()


def test_demo_report_counts() -> None:
    with open_store("memory://demo", endpoint="demo") as store:
        report = run_demo(store, messages=500, threads=4, burst=50, seed=3)
    assert report.exactly_once
    assert report.processed == 500
    assert report.concurrent_copies == 200
    assert report.duplicates == report.delivered - 500 > 200


def test_demo_detects_double_processing() -> None:
    """The verdict is not a constant: a store that forgets makes it fail."""

    class Forgetful:
        url, endpoint = "memory://forgetful", "x"

        def add(self, mid: str) -> bool:
            return True

        def add_many(self, ids: list[str]) -> set[str]:
            return set(ids)

    report = run_demo(Forgetful(), messages=100, threads=2, burst=10, seed=1)  # type: ignore[arg-type]
    assert not report.exactly_once
    assert "NO" in report.render()
