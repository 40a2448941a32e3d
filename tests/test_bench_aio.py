"""The bench's async section (``benchmarks.aio_bench``) at a tiny size on the suite's
Redis: both variants run in their own processes and report what they measured, and the
section replaces only its part of RESULTS.md. No timing is asserted."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import aio_bench
from tests.servers import Server

pytestmark = pytest.mark.redis


def test_both_variants_run_and_the_section_reports_them(
    redis_server: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(aio_bench, "THREADS", 4)
    monkeypatch.setattr(aio_bench, "COROUTINES", 10)
    threads = aio_bench._measure("threads", "redis", redis_server.url, 60)
    coroutines = aio_bench._measure("coroutines", "redis", redis_server.url, 60)
    even = aio_bench._measure("coroutines", "redis", redis_server.url, 60, 4)
    for measured in (threads, coroutines, even):
        assert measured["rate"] > 0 and measured["p99_ms"] >= measured["p50_ms"] > 0
        assert measured["memory_mib"] >= 0
    section = aio_bench.render(
        [aio_bench.Measured("redis", threads, coroutines, even)], 60, "durable", "make bench"
    )
    assert section.startswith(aio_bench.BEGIN) and section.endswith(aio_bench.END)
    assert "| redis | 4 threads |" in section and "| redis | 10 coroutines |" in section
    assert "| redis | 4 coroutines |" in section and "At the threads' concurrency" in section
    out = tmp_path / "RESULTS.md"
    out.write_text("# Benchmark results\n\nkept\n\n<!-- tokens-bench -->\ntokens\n")
    aio_bench.write(section, out)
    aio_bench.write(section, out)  # again: replaced, not added
    text = out.read_text()
    assert text.count(aio_bench.BEGIN) == 1 and "kept" in text
    assert text.index(aio_bench.END) < text.index("<!-- tokens-bench -->")
