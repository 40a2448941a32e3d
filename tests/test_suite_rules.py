"""The suite's own rules (``tests/suite_rules.py``), serial and on pytest-xdist workers."""

from __future__ import annotations

import textwrap

import pytest

_SUITE = textwrap.dedent(
    """
    import pytest

    def test_runs():
        pass

    def test_is_skipped():
        pytest.skip("no server")
    """
)


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["serial", "xdist"])
def test_under_ci_a_skip_on_any_worker_fails_the_run(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, workers: list[str]
) -> None:
    pytester.makepyfile(test_some=_SUITE)
    monkeypatch.setenv("CI", "true")
    result = pytester.runpytest_subprocess(
        "-p", "tests.suite_rules", "-p", "no:cacheprovider", *workers
    )
    result.assert_outcomes(passed=1, skipped=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*CI=true: 1 skipped test(s) count as failures*"])


def test_outside_ci_a_skip_is_only_reported(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(test_some=_SUITE)
    monkeypatch.delenv("CI", raising=False)
    result = pytester.runpytest_subprocess("-p", "tests.suite_rules", "-n", "2")
    result.assert_outcomes(passed=1, skipped=1)
    assert result.ret == pytest.ExitCode.OK


def test_spark_tests_are_grouped_by_engine_and_chaos_suites_have_one_per_file(
    pytester: pytest.Pytester,
) -> None:
    pytester.makeconftest(
        textwrap.dedent(
            """
            import pytest

            @pytest.fixture(scope="session")
            def spark(request):
                return getattr(request, "param", "local")
            """
        )
    )
    pytester.makepyfile(
        test_spark_jobs="def test_submits():\n    pass\n",
        test_uses=textwrap.dedent(
            """
            import pytest

            def test_with_session(spark):
                pass

            @pytest.mark.parametrize("spark", ["connect", "cluster"], indirect=True)
            def test_on_engine(spark):
                pass

            def test_without():
                pass
            """
        ),
        test_consumer_chaos="def test_kills():\n    pass\n",
    )
    items, _ = pytester.inline_genitems("-p", "tests.suite_rules")
    marks = {
        item.name.replace("test_on_engine", "engine"): (
            item.get_closest_marker("spark") is not None,
            [m.args[0] for m in item.iter_markers("xdist_group")],
        )
        for item in items
    }
    assert marks == {
        "test_submits": (True, ["spark-jobs"]),
        "test_with_session": (True, ["spark-local"]),
        "engine[connect]": (True, ["spark-connect"]),
        "engine[cluster]": (True, ["spark-cluster"]),
        "test_without": (False, []),
        "test_kills": (False, ["chaos-redis"]),
    }


def test_under_loadgroup_each_group_runs_on_one_worker(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        textwrap.dedent(
            """
            import pytest

            @pytest.fixture(scope="session")
            def spark(request):
                return getattr(request, "param", "local")
            """
        )
    )
    for name in ("a", "b", "c"):
        pytester.makepyfile(
            **{
                f"test_{name}": textwrap.dedent(
                    """
                    import pytest

                    @pytest.mark.parametrize("spark", ["local", "connect"], indirect=True)
                    @pytest.mark.parametrize("n", range(3))
                    def test_on_engine(spark, n):
                        pass

                    @pytest.mark.parametrize("n", range(6))
                    def test_plain(n):
                        pass
                    """
                )
            }
        )
    result = pytester.runpytest_subprocess(
        "-p", "tests.suite_rules", "-p", "no:cacheprovider", "-n", "3", "--dist", "loadgroup", "-v"
    )
    result.assert_outcomes(passed=36)
    workers: dict[str, set[str]] = {}
    for line in result.outlines:
        if line.startswith("[gw") and "PASSED" in line and "@" in line:
            workers.setdefault(line.rsplit("@", 1)[1].strip(), set()).add(line.split("]")[0])
    assert set(workers) == {"spark-local", "spark-connect"}
    assert all(len(ran_on) == 1 for ran_on in workers.values()), workers


_FAKE_CONNECT = textwrap.dedent(
    """
    import os
    import pytest

    @pytest.fixture(scope="session")
    def spark(request):
        if request.param == "connect":  # as PySpark does: set while the session lives
            os.environ["SPARK_CONNECT_MODE_ENABLED"] = "1"
        return request.param
    """
)

_AFTER_CONNECT = textwrap.dedent(
    """
    import os
    import subprocess
    import sys
    import pytest

    @pytest.mark.parametrize("spark", ["connect"], indirect=True)
    def test_on_connect(spark):
        assert os.environ["SPARK_CONNECT_MODE_ENABLED"] == "1"

    def test_after_it():
        child = "import os; print('SPARK_CONNECT_MODE_ENABLED' in os.environ)"
        out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True)
        assert "SPARK_CONNECT_MODE_ENABLED" not in os.environ
        assert out.stdout.strip() == "False"
    """
)


@pytest.mark.parametrize("plugin", ["tests.spark_fixtures", None], ids=["hidden", "anti-test"])
def test_connect_mode_is_hidden_from_tests_not_on_connect(
    pytester: pytest.Pytester, plugin: str | None
) -> None:
    """A worker whose Connect session still lives runs other tests (and their children)
    outside Connect mode; without the fixture that hides it, the check fails."""
    pytester.makeconftest(_FAKE_CONNECT)
    pytester.makepyfile(test_after_connect=_AFTER_CONNECT)
    options = ["-p", plugin] if plugin else []
    result = pytester.runpytest_subprocess(*options, "-p", "no:cacheprovider", "-p", "no:xdist")
    if plugin:
        result.assert_outcomes(passed=2)
    else:
        result.assert_outcomes(passed=1, failed=1)
