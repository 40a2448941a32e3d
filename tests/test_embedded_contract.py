"""The shipped contract suite against the embedded backends."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dedupstore import DeduplicationStore, InvalidMessageId, StoreUnavailable, open_store
from dedupstore.backends.memory import MemoryDeduplicationStore
from dedupstore.store import WriteRequest
from dedupstore.testing import DeduplicationStoreContract, MultiProcessContract, StoreFactory


@pytest.mark.memory
class TestMemoryStore(DeduplicationStoreContract):
    @pytest.fixture
    def store_factory(self) -> StoreFactory:
        url = f"memory://{uuid.uuid4().hex}"

        def make(**options: Any) -> DeduplicationStore:
            return open_store(url, **options)

        return make


@pytest.mark.sqlite
class TestSqliteStore(DeduplicationStoreContract, MultiProcessContract):
    @pytest.fixture
    def store_factory(self, tmp_path: Path) -> StoreFactory:
        url = f"sqlite:///{tmp_path}/dedup.db"

        def make(**options: Any) -> DeduplicationStore:
            return open_store(url, **options)

        return make


class _SmallConcurrentChunks(MemoryDeduplicationStore):
    """Tiny chunks, several in flight: exercises the base class's chunk machinery."""

    max_write_batch = 7
    max_read_batch = 5
    chunk_concurrency = 3


@pytest.mark.memory
class TestConcurrentChunksStore(DeduplicationStoreContract):
    @pytest.fixture
    def store_factory(self) -> StoreFactory:
        url = f"memory://{uuid.uuid4().hex}"
        return lambda **options: _SmallConcurrentChunks(url, **options)


class _LosesAnswers(_SmallConcurrentChunks):
    """Writes the chunk holding ``"boom"`` for real, then loses the answer (once)."""

    lose_answer = True

    def _add_new(self, request: WriteRequest) -> set[str]:
        added = super()._add_new(request)
        if self.lose_answer and "boom" in request.ids:
            type(self).lose_answer = False
            time.sleep(0.05)  # let the chunks in flight beside it finish first
            raise StoreUnavailable("injected: the answer was lost after the write")
        return added


@pytest.fixture
def losing() -> Iterator[type[_LosesAnswers]]:
    _LosesAnswers.lose_answer = True
    yield _LosesAnswers


@pytest.mark.memory
def test_a_failing_chunk_reports_what_the_others_recorded(
    losing: type[_LosesAnswers],
) -> None:
    url = f"memory://{uuid.uuid4().hex}"
    store = losing(url)
    ids = [f"id-{n}" for n in range(100)]
    batch = [*ids[:50], "boom", *ids[50:]]
    with pytest.raises(StoreUnavailable) as info:
        store.add_many(batch)
    recorded, unknown = info.value.recorded, info.value.unknown
    assert "boom" in unknown
    assert not recorded & unknown
    assert recorded, "the chunks in flight beside the failing one finished and are reported"
    assert store.processed_among(recorded) == set(recorded)
    chunks = [batch[i : i + store.max_write_batch] for i in range(0, len(batch), 7)]
    for chunk in chunks:  # each chunk is wholly recorded, wholly unknown, or not written
        assert (
            set(chunk) <= recorded
            or set(chunk) <= unknown
            or set(chunk).isdisjoint(recorded | unknown | store.processed_among(chunk))
        )
    other = losing(url)
    assert not other.add_many(unknown), "another object must not claim the lost chunk"
    retry = store.add_many(batch)
    assert not retry & recorded
    assert retry | recorded == set(batch), "every id is reported as recorded exactly once"
    assert store.add_many(batch) == set()


@pytest.mark.memory
def test_a_single_add_whose_answer_was_lost_is_reported_by_the_retry(
    losing: type[_LosesAnswers],
) -> None:
    url = f"memory://{uuid.uuid4().hex}"
    store, other = losing(url), losing(url)
    with pytest.raises(StoreUnavailable) as info:
        store.add("boom")
    assert info.value.unknown == {"boom"} and not info.value.recorded
    assert other.add("boom") is False
    assert store.add("boom") is True
    assert store.add("boom") is False


@pytest.mark.memory
def test_a_bad_id_in_a_later_chunk_of_a_stream_reports_the_earlier_chunks() -> None:
    store = _SmallConcurrentChunks(f"memory://{uuid.uuid4().hex}")
    good = [f"g-{n}" for n in range(30)]
    with pytest.raises(InvalidMessageId) as info:
        store.add_many(iter([*good, ""]))
    assert info.value.recorded == store.processed_among(good)
    assert info.value.recorded, "chunks before the bad one were written"
