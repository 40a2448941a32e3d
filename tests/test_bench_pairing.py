"""The bench's paired ratios (``benchmarks.cpu_compare.paired``): pure arithmetic."""

from __future__ import annotations

import pytest

from benchmarks.cpu_compare import Measured, paired


def test_a_ratio_is_the_median_of_the_rounds_ratios_not_of_the_medians() -> None:
    this = Measured("this", [1.0, 3.0, 2.0], 100)
    other = Measured("other", [3.0, 2.0, 6.0], 100)
    # rounds: 3x, 0.67x, 3x -> 3x; the medians alone (2 s against 3 s) would say 1.5x
    assert paired(this, other) == pytest.approx(3.0)
    assert this.median / other.median != pytest.approx(3.0)


def test_runs_of_different_sizes_are_paired_by_rate() -> None:
    this = Measured("batch", [1.0, 1.0, 1.0], 1000)  # 1,000 messages per second
    other = Measured("powertools", [0.5, 0.5, 0.5], 100)  # 200 per second
    assert paired(this, other) == pytest.approx(5.0)
    assert paired(other, this) == pytest.approx(0.2)


def test_runs_of_different_rounds_are_refused() -> None:
    with pytest.raises(ValueError):
        paired(Measured("a", [1.0, 1.0], 10), Measured("b", [1.0], 10))


def test_the_spark_bench_states_the_ceilings_its_measurements_leave() -> None:
    """Per core: loop / (loop + Spark's own part); scaling: cores / cores busy."""
    import os

    from benchmarks.spark_bench import _measured

    costs = {"redis": {"loop": 5.10, "spark part local[1]": 0.48, "cores busy local[1]": 1.14}}
    per_core, scaling = _measured("redis", costs)
    assert "took 0.48 s, the loop 5.10 s" in per_core and "reach 0.91x" in per_core
    cores = os.cpu_count() or 1
    assert f"it could be at most {cores / 1.14:.2f}x as fast" in scaling
    assert _measured("sqlite", costs) == ("", "")  # nothing measured: nothing said
