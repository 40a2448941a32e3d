"""The bench's token-mode section (``benchmarks.tokens_bench``) at a tiny size, on SQLite:
what it counts, and that RESULTS.md reports what was counted. No timing is asserted."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks import tokens_bench
from benchmarks.tokens_bench import Measured, TokenResults


@pytest.fixture(scope="module")
def results() -> TokenResults:
    return tokens_bench.run(
        sizes=(50, 100),
        left_batch=50,
        layouts=["sqlite", "sqlite+sqlite"],
        single=100,
        batched=200,
        seed=7,
        log=lambda text: None,
    )


def _run(results: TokenResults, mode: str, run: str, layout: str = "sqlite") -> Measured:
    found = tokens_bench._find(results.runs, layout, mode, run)
    assert found is not None
    return found


def test_token_mode_leaves_nothing_after_the_drain_and_retention_mode_every_id(
    results: TokenResults,
) -> None:
    left = results.left
    assert left is not None
    by_mode = {(r.mode, r.messages): r for r in left.rows}
    for size in (50, 100):
        assert by_mode["retention", size].dedup_rows == size
        assert by_mode["retention", size].tokens == 0
        assert by_mode["token", size].dedup_rows == 0
        assert by_mode["token", size].tokens == 0
    # in flight: the batch A minted and B has not taken yet, never more
    assert left.peak["token"] == 50
    assert by_mode["token", 100].bytes_in_use < by_mode["retention", 100].bytes_in_use


def test_round_trips_are_as_the_docs_table_says(results: TokenResults) -> None:
    """docs/tokens.md, "Round trips": with the tokens in a file of their own (nothing
    joined) token mode costs two more a message with subscribed outputs, and
    ``process_batch`` one request per step a batch; in the entity store's file the token
    writes are folded into its requests: two fewer than retention mode's (whose
    deduplication store SQLite does not join), and no minting steps in a batch."""
    retention = _run(results, "retention", "process", "sqlite+sqlite")
    relay = _run(results, "token relay", "process", "sqlite+sqlite")
    assert relay.per_message == pytest.approx(retention.per_message + 2)
    assert not retention.joined and not relay.folded
    # a receiver that mints nothing costs what retention mode costs; the sender the two
    assert _run(results, "token receive", "process", "sqlite+sqlite").calls == retention.calls
    assert _run(results, "token send", "process", "sqlite+sqlite").calls == relay.calls
    for run in ("batch 100", "batch 1000"):
        extra = (
            _run(results, "token relay", run, "sqlite+sqlite").per_batch
            - _run(results, "retention", run, "sqlite+sqlite").per_batch
        )
        assert extra == pytest.approx(2)  # create, save made: one request each a batch
        assert _run(results, "token relay", run, "sqlite+sqlite").minting == pytest.approx(2)
    # one file: folded
    retention = _run(results, "retention", "process")
    relay = _run(results, "token relay", "process")
    assert relay.folded and not retention.joined
    assert relay.per_message == pytest.approx(retention.per_message - 2)
    assert _run(results, "token receive", "process").calls == relay.calls
    assert _run(results, "token send", "process").calls == retention.calls
    for run in ("batch 100", "batch 1000"):
        folded = _run(results, "token relay", run)
        assert folded.per_batch == pytest.approx(_run(results, "retention", run).per_batch - 1)


def test_the_section_reports_what_was_counted(results: TokenResults) -> None:
    text = tokens_bench.render(results, "test")
    assert text.startswith(tokens_bench.BEGIN) and text.endswith(tokens_bench.END)
    assert "| 100 | token | 0 | 0 |" in text and "| 100 | retention | 100 | 0 |" in text
    retention = _run(results, "retention", "process").per_message
    assert f"| sqlite | retention | {retention:.3f} |" in text
    assert f"| sqlite | token relay | {retention - 2:.3f} |" in text
    lines = tokens_bench.targets(results.runs)
    shared = [line for line in lines if "sqlite (shared) token relay / retention, process" in line]
    assert len(shared) == 1 and shared[0].endswith(": met")  # 2.1 / 4.1: folded
    separate = [line for line in lines if "sqlite+sqlite (separate)" in line and "process" in line]
    assert len(separate) == 1 and separate[0].endswith(": met")  # +2 of at most +3
    # a shared layout whose token writes are not folded misses it, and says why
    unfolded = [
        replace(m, layout="sqlite") if m.layout == "sqlite+sqlite" else None for m in results.runs
    ]
    lines = tokens_bench.targets([m for m in unfolded if m is not None])
    assert any(line.endswith("NOT met") for line in lines)
    assert any("not folded: the token store does not share" in line for line in lines)
    assert next(line for line in lines if "batches keep" in line).endswith(": met")


def test_only_tokens_replaces_its_section_and_keeps_the_rest(tmp_path: Path) -> None:
    from benchmarks import bench

    out = tmp_path / "RESULTS.md"
    out.write_text("# Benchmark results\n\nids\n\n<!-- spark-bench -->\nspark\n", encoding="utf-8")
    args = [
        "--only",
        "tokens",
        "--tokens-sizes",
        "20",
        "--tokens-batch",
        "10",
        "--tokens-layouts",
        "sqlite",
        "--tokens-single",
        "20",
        "--tokens-messages",
        "40",
        "--out",
        str(out),
    ]
    for _ in range(2):
        assert bench.main(args) == 0
    text = out.read_text(encoding="utf-8")
    assert text.count(tokens_bench.BEGIN) == 1 and text.count(tokens_bench.END) == 1
    assert text.startswith("# Benchmark results\n\nids\n\n" + tokens_bench.BEGIN)
    assert text.endswith(tokens_bench.END + "\n\n<!-- spark-bench -->\nspark\n")
    assert "| 20 | token | 0 | 0 |" in text
