"""The drivers section of the bench (``benchmarks.aio_drivers``), with made-up numbers: the
decision its rule takes, and that the section replaces only its own part of RESULTS.md,
right after the async-face section. Pure logic: no server, no venv, no timing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks import aio_drivers
from benchmarks.aio_drivers import Measured

PINS = {
    "project": {"boto3": "1.44.8", "botocore": "1.44.8"},
    "drivers": {"aiobotocore": "3.10.0", "botocore": "1.43.117", "aiosqlite": "0.22.1"},
}


def _m(
    rate: float, memory: float, cpu: float = 300.0, server: float | None = None, pool: int = 64
) -> Any:
    return {
        "rate": rate,
        "p50_ms": 300.0,
        "p99_ms": 400.0,
        "memory_mib": memory,
        "cpu_us": cpu,
        "server_cores": server,
        "pool": pool,
        "load": 0.5,
    }


def _results() -> list[Measured]:
    dynamodb = Measured(
        "dynamodb",
        {
            "offload": _m(260, 13.0, 2000, 0.9),
            "native": _m(320, 20.0, 1800, 0.9),  # 1.23x the offload: the rule's bar met
            "threads": _m(300, 8.0, 2100, 0.9),  # but 1.07x, 2.5x the same write in threads
        },
    )
    sqlite = Measured(
        "sqlite",
        {
            "offload": _m(800, 20.0, pool=1),
            "native": _m(3000, 2.8),  # 3.75x, 0.14x the shipped offload's
            "threads": _m(1800, 15.0),
            "threads1": _m(2900, 4.6, pool=1),  # 1.03x, 0.61x: one sync thread does as well
        },
    )
    return [dynamodb, sqlite]


def test_the_rule_adopts_where_faster_or_markedly_smaller() -> None:
    dynamodb, sqlite = _results()
    assert aio_drivers.ratios(dynamodb).adopts
    assert not aio_drivers.ratios(dynamodb, "threads").adopts
    assert aio_drivers.ratios(sqlite).adopts
    assert not aio_drivers.ratios(sqlite, "threads1").adopts
    assert aio_drivers.Ratios(1.2, 1.0, 1.0).adopts and aio_drivers.Ratios(0.5, 0.5, 1.0).adopts
    assert not aio_drivers.Ratios(1.19, 0.51, 1.0).adopts


def test_the_section_reports_the_numbers_and_a_decision_per_backend() -> None:
    section = aio_drivers.render(_results(), 5000, 1000, PINS, "make bench-drivers")
    assert section.startswith(aio_drivers.BEGIN) and section.endswith(aio_drivers.END)
    assert "`make bench-drivers` (5,000 single-id writes" in section
    assert "| dynamodb | native | aiobotocore | 320 | 300.0 | 400.0 | 20.0 | 1,800 | 0.90 |" in (
        section
    )
    assert "| sqlite | offload | sqlite3 | 800 |" in section
    assert "| sqlite | offload | 3.75x | 0.14x | 1.00x | adopt |" in section
    assert "| sqlite | threads, 1 thread | 1.03x | 0.61x | 1.00x | keep the offload |" in section
    assert "aiobotocore 3.10.0, botocore 1.43.117, aiosqlite 0.22.1" in section
    assert "boto3 1.44.8, botocore 1.44.8" in section
    lines = section.splitlines()
    dynamodb = next(line for line in lines if line.startswith("- **dynamodb**: "))
    sqlite = next(line for line in lines if line.startswith("- **sqlite**: "))
    # the rule is met against the shipped offload, not against the same write in threads;
    # and aiobotocore cannot be installed beside the project's boto3
    assert dynamodb.startswith(
        "- **dynamodb**: keep the bounded offload: aiobotocore meets the rule against the "
        "offload as shipped (speed 1.23x, memory 1.54x, CPU/write 0.90x), but aiobotocore "
        "3.10.0 pins botocore behind the released one"
    )
    assert "in 64 threads (the same bound) it measured speed 1.07x, memory 2.50x" in dynamodb
    assert "what it gains over the shipped offload is the library's work" in dynamodb
    # the shipped offload is one writer per file; aiosqlite's margin over sqlite3 in one
    # thread, a ceiling, does not pay for a dependency
    assert sqlite.startswith(
        "- **sqlite**: keep the bounded offload, one writer thread per database file (the "
        "shipped offload: `SqliteConnection.offload_threads` = 1); against it aiosqlite meets "
        "the rule against the offload as shipped (speed 3.75x, memory 0.14x"
    )
    assert "in one thread (the same bound) it measured speed 1.03x" in sqlite
    assert "(misses the rule's bar)" in sqlite and "is itself a one-thread offload" in sqlite
    assert "on sqlite: in one thread the store's write (offload)" in section
    assert "the server is the bound" in section  # moto near one core in every run
    assert "Load (the 1-minute load average before each run): 0.5-0.5 on" in section


def test_the_section_goes_after_the_async_face_section_and_replaces_itself(
    tmp_path: Path,
) -> None:
    out = tmp_path / "RESULTS.md"
    out.write_text(
        "# Benchmark results\n\n<!-- aio-bench -->\naio\n<!-- /aio-bench -->\n\n"
        "<!-- tokens-bench -->\ntokens\n<!-- /tokens-bench -->\n"
    )
    first = aio_drivers.render(_results(), 5000, 1000, PINS, "make bench-drivers")
    aio_drivers.write(first, out)
    second = first.replace("5,000 single-id", "7,000 single-id")
    aio_drivers.write(second, out)  # again: replaced, not added
    text = out.read_text()
    assert text.count(aio_drivers.BEGIN) == 1 and "7,000 single-id" in text
    assert "5,000 single-id" not in text
    assert text.index("<!-- /aio-bench -->") < text.index(aio_drivers.BEGIN)
    assert text.index(aio_drivers.END) < text.index("<!-- tokens-bench -->")
    assert "\naio\n" in text and "\ntokens\n" in text


def test_without_the_async_face_section_it_goes_before_the_token_section(
    tmp_path: Path,
) -> None:
    out = tmp_path / "RESULTS.md"
    out.write_text("# Benchmark results\n\nkept\n\n<!-- tokens-bench -->\ntokens\n")
    aio_drivers.write(aio_drivers.render(_results(), 50, 10, PINS, "x"), out)
    text = out.read_text()
    assert "kept" in text and text.index(aio_drivers.END) < text.index("<!-- tokens-bench -->")


def test_rounds_are_summed_up_by_their_medians_and_the_rate_s_range() -> None:
    runs = [_m(100, 3.0), _m(300, 1.0), _m(200, 2.0)]
    runs[1]["load"] = 4.0
    summed = aio_drivers.summary(runs)
    assert summed["rate"] == 200 and summed["memory_mib"] == 2.0
    assert (summed["rate_min"], summed["rate_max"], summed["rounds"]) == (100, 300, 3)
    assert summed["server_cores"] is None and summed["load"] == 4.0
    section = aio_drivers.render(
        [Measured("sqlite", {v: summed for v in ("offload", "native", "threads")})],
        50,
        10,
        PINS,
        "x",
    )
    assert "| sqlite | native | aiosqlite | 200 (100-300) |" in section
    assert "Rounds: sqlite 3 " in section


def test_the_offload_is_kept_where_the_library_misses_the_rule() -> None:
    _, sqlite = _results()
    sqlite.variants["offload"] = _m(2800, 3.0)  # aiosqlite 1.07x as fast, 0.93x the memory
    line = aio_drivers.decision(sqlite, PINS)
    assert line.startswith(
        "- **sqlite**: keep the bounded offload, one writer thread per database file (the "
        "shipped offload: `SqliteConnection.offload_threads` = 64); against it aiosqlite "
        "misses the rule against the offload as shipped (speed 1.07x, memory 0.93x, "
        "CPU/write 1.00x: neither >= 1.2x"
    )
