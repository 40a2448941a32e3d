"""Suite-wide configuration: real servers, and no silent skips in CI."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Child processes (Spark's Python workers, the CLI in a subprocess, worker scripts) import
# the tests' handler modules (``tests.*``): the project's root goes first on their path
# (the editable install maps the packages, not the root).
_ROOT = str(Path(__file__).resolve().parents[1])
os.environ["PYTHONPATH"] = os.pathsep.join(
    [_ROOT, *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != _ROOT)]
)

pytest_plugins = [
    "pytester",
    "tests.server_fixtures",
    "tests.outbox_backends",
    "tests.spark_fixtures",
]

_skipped: list[str] = []


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Remember every test that was reported as not run."""
    if report.skipped:
        _skipped.append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Under CI=true a skipped test fails the run: a backend must never be skipped."""
    if _in_ci() and _skipped and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Say loudly why a green-looking run failed in CI."""
    if _in_ci() and _skipped:
        terminalreporter.write_line(
            f"CI=true: {len(_skipped)} skipped test(s) count as failures, e.g. {_skipped[0]}",
            red=True,
        )
