"""Suite-wide rules, serial or under pytest-xdist: the ``spark`` marker, the xdist groups,
and no silent skips in CI.

* Every test of a ``test_spark*.py`` file, and every test using the ``spark`` session
  fixture, is marked ``spark`` (``make test-fast`` leaves them out).
* Every Spark test is in an xdist group of its engine: ``spark-local``,
  ``spark-connect``, ``spark-cluster`` (the session fixture's parameter, ``local`` when
  it has none), and ``spark-jobs`` for the Spark tests without a session (jobs run by
  ``spark-submit`` or in a subprocess). Each group runs on one worker, which starts
  that engine's JVMs once; the four run side by side. While a Connect session lives,
  PySpark keeps its process in "Connect mode" (an environment variable every child
  inherits): ``tests/spark_fixtures.py`` hides it from every test that is not on
  ``connect``, so a worker that ran the Connect group runs any other test as before.
* Each consumer chaos suite (several consumer processes, killed at random, around its
  own servers) is a group, ``chaos-redis`` and ``chaos-rabbitmq``: its tests run one
  after another instead of competing with each other for the cores.
* Under ``CI=true`` a skipped test fails the run. With xdist the workers send their
  reports to the controller, whose ``pytest_runtest_logreport`` sees every test of every
  worker: the controller counts the skips and sets the exit status.
"""

from __future__ import annotations

import os

import pytest

#: xdist group of the Spark tests without a session fixture.
SPARK_JOBS_GROUP = "spark-jobs"
#: xdist group of each consumer chaos suite, by module.
CHAOS_GROUPS = {
    "test_consumer_chaos.py": "chaos-redis",
    "test_consumer_chaos_rabbitmq.py": "chaos-rabbitmq",
}

_skipped: list[str] = []


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def pytest_itemcollected(item: pytest.Item) -> None:
    """Mark a Spark test, and put a test that must share a worker in its group.

    Done as each test is collected, before any ``pytest_collection_modifyitems``: ``-m``
    deselects there, and pytest-xdist reads the groups there (in whatever hook order).
    """
    module = item.path.name
    uses_session = "spark" in getattr(item, "fixturenames", ())
    if uses_session or module.startswith("test_spark") or item.get_closest_marker("spark"):
        item.add_marker(pytest.mark.spark)
        item.add_marker(
            pytest.mark.xdist_group(spark_group(item) if uses_session else SPARK_JOBS_GROUP)
        )
    elif module in CHAOS_GROUPS:
        item.add_marker(pytest.mark.xdist_group(CHAOS_GROUPS[module]))


def spark_group(item: pytest.Item) -> str:
    """The xdist group of a test that uses the ``spark`` session: its engine's."""
    callspec = getattr(item, "callspec", None)
    engine = callspec.params.get("spark", "local") if callspec is not None else "local"
    return f"spark-{engine}"


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
