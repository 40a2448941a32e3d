"""The token store contract as a pytest base class: :class:`TokenStoreContract`.

Subclass it and provide one fixture, ``token_store_factory``: a callable
``(**options) -> TokenStore`` where every call opens a NEW client of the SAME fresh,
empty storage, reserved for the current test. The suite passes ``clock`` (a
:class:`~dedupstore.testing.FakeClock`) where it checks mint times.
"""

from __future__ import annotations

import pickle
import threading
import uuid
from collections.abc import Callable, Iterator

import pytest

from dedupstore.errors import ConfigurationError, InvalidMessageId, StoreClosed
from dedupstore.testing.contract import (
    HOSTILE_IDS,
    INVALID_IDS,
    FakeClock,
    closing_clients,
    random_valid_ids,
    run_concurrently,
)
from dedupstore.tokens import TokenCount, TokenRecord, TokenStore

__all__ = ["TokenStoreContract", "TokenStoreFactory"]

TokenStoreFactory = Callable[..., TokenStore]


def _fresh(count: int, prefix: str = "t") -> list[str]:
    return [f"{prefix}-{uuid.uuid4()}" for _ in range(count)]


def _paging(tokens: TokenStore, size: int) -> TokenStore:
    """``tokens``, asking ``size`` tokens per page of ``scan`` (shadows the class's)."""
    tokens.__dict__["page_size"] = size
    return tokens


class TokenStoreContract:
    """What every token store guarantees (:class:`~dedupstore.tokens.TokenStore`).

    Provide ``token_store_factory``; everything else is inherited.
    """

    @pytest.fixture
    def token_store_factory(self) -> TokenStoreFactory:
        """Open a new client of this test's fresh storage: override in the subclass."""
        raise NotImplementedError("provide a token_store_factory fixture")

    @pytest.fixture
    def token_clients(self, token_store_factory: TokenStoreFactory) -> Iterator[TokenStoreFactory]:
        """``token_store_factory``, every store it opens closed after the test."""
        yield from closing_clients(token_store_factory)

    @pytest.fixture
    def tokens(self, token_clients: TokenStoreFactory) -> TokenStore:
        """A token store, closed after the test."""
        return token_clients()

    # ------------------------------------------------------------------ basics

    def test_a_created_token_is_present_until_deleted(self, tokens: TokenStore) -> None:
        one, other = _fresh(2)
        assert tokens.present(one) is False
        tokens.create({one: "billing"})
        assert tokens.present(one) is True
        assert tokens.present(other) is False
        assert tokens.present_among([one, other]) == {one}
        tokens.delete([one])
        assert tokens.present(one) is False
        assert tokens.present_among([one, other]) == set()

    def test_creating_a_token_again_changes_nothing(self, token_clients: TokenStoreFactory) -> None:
        clock = FakeClock(1_000_000.0)
        tokens = token_clients(clock=clock)
        (token,) = _fresh(1)
        tokens.create({token: "billing"})
        clock.advance(60)
        tokens.create({token: "shipping"})  # an earlier try of the same creation
        assert tokens.present(token)
        assert tokens.outstanding() == {"billing": TokenCount(1, 1_000_000.0)}

    def test_delete_is_idempotent(self, tokens: TokenStore) -> None:
        kept, gone, never = _fresh(3)
        tokens.create({kept: "e", gone: "e"})
        tokens.delete([gone])
        tokens.delete([gone, never])
        tokens.delete([])
        assert tokens.present_among([kept, gone, never]) == {kept}

    def test_empty_batches(self, tokens: TokenStore) -> None:
        tokens.create({})
        assert tokens.present_among([]) == set()
        tokens.delete([])

    def test_batches_larger_than_the_backend_limit(self, tokens: TokenStore) -> None:
        ids = _fresh(2 * type(tokens).max_batch + 3)
        tokens.create(dict.fromkeys(ids, "bulk"))
        assert tokens.present_among(ids) == set(ids)
        assert tokens.present_among(iter(ids[:5])) == set(ids[:5])
        tokens.delete(ids[1:])
        assert tokens.present_among(ids) == {ids[0]}

    def test_duplicate_ids_in_a_batch(self, tokens: TokenStore) -> None:
        one, two = _fresh(2)
        tokens.create({one: "e", two: "e"})
        assert tokens.present_among([one, one, two]) == {one, two}
        tokens.delete([one, one])
        assert tokens.present_among([one, two]) == {two}

    def test_outstanding_counts_each_endpoint_and_its_oldest(
        self, token_clients: TokenStoreFactory
    ) -> None:
        clock = FakeClock(2_000_000.0)
        tokens = token_clients(clock=clock)
        before = tokens.outstanding()
        first, second, third = _fresh(3)
        tokens.create({first: "billing-ep", second: "shipping-ep"})
        clock.advance(30)
        tokens.create({third: "billing-ep"})
        counts = tokens.outstanding()
        assert counts["billing-ep"] == TokenCount(2, 2_000_000.0)
        assert counts["shipping-ep"] == TokenCount(1, 2_000_000.0)
        tokens.delete([first, second])
        counts = tokens.outstanding()
        assert counts["billing-ep"] == TokenCount(1, 2_000_030.0)
        assert "shipping-ep" not in counts
        assert {e: c for e, c in counts.items() if e != "billing-ep"} == {
            e: c for e, c in before.items() if e not in ("billing-ep", "shipping-ep")
        }

    # ------------------------------------------------------------------ scan

    def test_scan_lists_every_token_once_with_its_endpoint_and_mint_time(
        self, token_clients: TokenStoreFactory
    ) -> None:
        clock = FakeClock(3_000_000.0)
        tokens = _paging(token_clients(clock=clock), 7)  # several pages
        before = {record.id for record in tokens.scan()}
        ids = _fresh(23)
        tokens.create(dict.fromkeys(ids[:20], "scan-a"))
        clock.advance(5)
        tokens.create(dict.fromkeys(ids[20:], "scan-b"))
        listed = [record for record in tokens.scan() if record.id not in before]
        assert all(type(record) is TokenRecord for record in listed)
        assert len(listed) == len({record.id for record in listed}), "a token listed twice"
        assert sorted(listed) == sorted(
            [TokenRecord(t, "scan-a", 3_000_000.0) for t in ids[:20]]
            + [TokenRecord(t, "scan-b", 3_000_005.0) for t in ids[20:]]
        )
        assert all(type(r.id) is str and type(r.created) is float for r in listed)
        tokens.delete(ids[:15])
        assert {record.id for record in tokens.scan()} - before == set(ids[15:])
        other = _paging(token_clients(), 1000)
        assert {record.id for record in other.scan()} - before == set(ids[15:])

    def test_scan_keeps_an_endpoint_and_what_was_minted_before_a_time(
        self, token_clients: TokenStoreFactory
    ) -> None:
        clock = FakeClock(4_000_000.0)
        tokens = token_clients(clock=clock)
        old_a, old_b, new_a = _fresh(3)
        tokens.create({old_a: "filter-a", old_b: "filter-b"})
        clock.advance(100)
        tokens.create({new_a: "filter-a"})
        assert {r.id for r in tokens.scan(endpoint="filter-a")} == {old_a, new_a}
        assert {r.id for r in tokens.scan(created_before=4_000_050)} >= {old_a, old_b}
        assert new_a not in {r.id for r in tokens.scan(created_before=4_000_050)}
        assert list(tokens.scan(endpoint="filter-a", created_before=4_000_050.0)) == [
            TokenRecord(old_a, "filter-a", 4_000_000.0)
        ]
        assert list(tokens.scan(endpoint="filter-none")) == []

    def test_scan_gives_hostile_ids_back_exactly(self, tokens: TokenStore) -> None:
        ids = list(dict.fromkeys([*HOSTILE_IDS, *random_valid_ids(50, seed=41)]))
        tokens.delete(ids)
        tokens.create(dict.fromkeys(ids, "hostile-scan"))
        listed = [r.id for r in tokens.scan(endpoint="hostile-scan")]
        assert sorted(listed) == sorted(ids)
        assert tokens.present_among(listed) == set(ids)
        tokens.delete(ids)
        assert list(tokens.scan(endpoint="hostile-scan")) == []

    def test_bad_scan_arguments_are_refused_before_any_io(
        self, token_store_factory: TokenStoreFactory
    ) -> None:
        tokens = token_store_factory()
        tokens.close()
        for bad in ("", 5, "a\x00b"):
            with pytest.raises(InvalidMessageId):
                tokens.scan(endpoint=bad)  # type: ignore[arg-type]
        for when in ("yesterday", float("nan"), True):
            with pytest.raises(ConfigurationError, match="created_before"):
                tokens.scan(created_before=when)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ clients and threads

    def test_visible_to_another_client(self, token_clients: TokenStoreFactory) -> None:
        writer, reader = token_clients(), token_clients()
        (token,) = _fresh(1)
        writer.create({token: "e"})
        assert reader.present(token)
        reader.delete([token])
        assert not writer.present(token)

    def test_concurrent_creates_and_deletes_of_one_token(
        self, token_clients: TokenStoreFactory
    ) -> None:
        stores = [token_clients() for _ in range(4)]
        ids = _fresh(20)
        run_concurrently(lambda i: stores[i].create(dict.fromkeys(ids, "e")), 4)
        assert stores[0].present_among(ids) == set(ids)
        run_concurrently(lambda i: stores[i].delete(ids), 4)
        assert stores[1].present_among(ids) == set()

    def test_store_is_shared_by_threads(self, tokens: TokenStore) -> None:
        ids = _fresh(40)
        errors: list[BaseException] = []

        def work(chunk: list[str]) -> None:
            try:
                tokens.create(dict.fromkeys(chunk, "threads"))
                assert tokens.present_among(chunk) == set(chunk)
                tokens.delete(chunk[::2])
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(ids[i::4],)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not errors, errors
        assert tokens.present_among(ids) == {t for i in range(4) for t in ids[i::4][1::2]}

    # ------------------------------------------------------------------ ids

    def test_hostile_ids_round_trip_and_never_collide(self, tokens: TokenStore) -> None:
        ids = list(dict.fromkeys(HOSTILE_IDS))
        tokens.delete(ids)  # the storage is the test's own, but ids are fixed: start clean
        half = ids[::2]
        tokens.create(dict.fromkeys(half, "hostile"))
        found = tokens.present_among(ids)
        assert found == set(half)
        assert all(type(token) is str for token in found)
        tokens.delete(half)
        assert tokens.present_among(ids) == set()

    def test_varied_ids_round_trip_exactly(self, tokens: TokenStore) -> None:
        ids = random_valid_ids(200, seed=38)
        tokens.create(dict.fromkeys(ids, "varied"))
        assert tokens.present_among(ids) == set(ids)
        tokens.delete(ids)

    @pytest.mark.parametrize(("why", "bad"), INVALID_IDS, ids=[w for w, _ in INVALID_IDS])
    def test_invalid_id_rejected_and_nothing_written(
        self, tokens: TokenStore, why: str, bad: object
    ) -> None:
        (good,) = _fresh(1)
        calls: list[Callable[[], object]] = [
            lambda: tokens.create({good: "e", bad: "e"}),  # type: ignore[dict-item]
            lambda: tokens.create({good: bad}),  # type: ignore[dict-item]
            lambda: tokens.present(bad),  # type: ignore[arg-type]
            lambda: tokens.present_among([good, bad]),  # type: ignore[list-item]
            lambda: tokens.delete([good, bad]),  # type: ignore[list-item]
        ]
        for call in calls:
            with pytest.raises(InvalidMessageId) as info:
                call()
            assert str(info.value), "the message must say what is wrong"
        assert tokens.present(good) is False, "a batch with a bad id wrote something"

    def test_a_single_string_is_not_a_batch(self, tokens: TokenStore) -> None:
        for call in (
            lambda: tokens.present_among("token-1"),
            lambda: tokens.delete("token-1"),
            lambda: tokens.create(["token-1"]),  # type: ignore[arg-type]
        ):
            with pytest.raises(InvalidMessageId):
                call()

    def test_invalid_ids_are_rejected_before_any_io(
        self, token_store_factory: TokenStoreFactory
    ) -> None:
        tokens = token_store_factory()
        tokens.close()
        with pytest.raises(InvalidMessageId):
            tokens.create({"": "e"})
        with pytest.raises(InvalidMessageId):
            tokens.delete(["ok", None])  # type: ignore[list-item]

    # ------------------------------------------------------------------ options and lifecycle

    @pytest.mark.parametrize("option", ["retention", "endpoint", "ttl"])
    def test_tokens_never_expire_and_name_their_endpoint(
        self, token_store_factory: TokenStoreFactory, option: str
    ) -> None:
        with pytest.raises(ConfigurationError, match=option):
            token_store_factory(**{option: "1d"})

    def test_pickles_by_configuration(self, tokens: TokenStore) -> None:
        (token,) = _fresh(1)
        tokens.create({token: "e"})
        clone = pickle.loads(pickle.dumps(tokens))
        try:
            assert clone is not tokens and type(clone) is type(tokens)
            assert clone.present(token)
            clone.delete([token])
            assert not tokens.present(token)
        finally:
            clone.close()

    def test_close_is_idempotent_and_final(self, token_store_factory: TokenStoreFactory) -> None:
        with token_store_factory() as tokens:
            tokens.create(dict.fromkeys(_fresh(1), "e"))
        assert tokens.closed
        tokens.close()
        for call in (
            lambda: tokens.create(dict.fromkeys(_fresh(1), "e")),
            lambda: tokens.present_among(_fresh(1)),
            lambda: tokens.delete(_fresh(1)),
            tokens.outstanding,
            tokens.scan,
        ):
            with pytest.raises(StoreClosed):
                call()
