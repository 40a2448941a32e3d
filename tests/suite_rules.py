"""Suite-wide rules, serial or under pytest-xdist: the ``spark`` marker, the xdist groups,
and no silent skips in CI.

* Every test of a ``test_spark*.py`` file, and every test using the ``spark`` session
  fixture, is marked ``spark`` (``make test-fast`` leaves them out).
* Tests that hold a Spark session (the ``spark`` fixture: a JVM per engine) form the xdist
  group ``spark``, so under ``--dist loadgroup`` one worker starts the JVMs, once per engine.
* The consumer chaos suites (each several consumer processes, killed at random, and its
  own servers) form the group ``chaos``: they run one after another on one worker instead
  of competing with each other for the cores.
* Under ``CI=true`` a skipped test fails the run. With xdist the workers send their
  reports to the controller, whose ``pytest_runtest_logreport`` sees every test of every
  worker: the controller counts the skips and sets the exit status.
"""

from __future__ import annotations

import os

import pytest

#: xdist group of the tests that use a Spark session fixture.
SPARK_GROUP = "spark"
#: xdist group of the consumer chaos suites.
CHAOS_GROUP = "chaos"
_CHAOS_MODULES = {"test_consumer_chaos.py", "test_consumer_chaos_rabbitmq.py"}

_skipped: list[str] = []


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in {"1", "true", "yes"}


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects and xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the Spark tests and put the tests that must share a worker in their group."""
    for item in items:
        module = item.path.name
        uses_session = "spark" in getattr(item, "fixturenames", ())
        if uses_session or module.startswith("test_spark"):
            item.add_marker(pytest.mark.spark)
        if uses_session:
            item.add_marker(pytest.mark.xdist_group(SPARK_GROUP))
        elif module in _CHAOS_MODULES:
            item.add_marker(pytest.mark.xdist_group(CHAOS_GROUP))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Remember every test that was reported as not run (on the controller too)."""
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
