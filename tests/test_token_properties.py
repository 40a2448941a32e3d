"""Token stores against a plain model: any sequence of creates, deletes and reads, on two
clients of one storage, answers as a dict ``id -> (endpoint, minted)`` does (Hypothesis
stateful tests), with an anti-test showing the model catches a store that re-mints."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from dedupstore import open_token_store
from dedupstore.backends.memory import MemoryTokenStore
from dedupstore.testing import FakeClock
from dedupstore.tokens import TokenCount, TokenRecord, TokenStore

#: A few ids, hostile ones among them, so that operations collide often.
IDS = st.sampled_from(["t-1", "t-2", "t-3", "a:b", "%2F", "🦄", "x" * 300, " t-1"])
ENDPOINTS = st.sampled_from(["billing", "shipping", "é"])


def machine(open_client: Callable[..., TokenStore]) -> type[RuleBasedStateMachine]:
    """A state machine driving two clients of one fresh storage against the model."""

    class TokenModel(RuleBasedStateMachine):
        @initialize()
        def open(self) -> None:
            self.clock = FakeClock(1_000.0)
            storage = uuid.uuid4().hex
            self.clients = [open_client(storage, clock=self.clock) for _ in range(2)]
            self.model: dict[str, tuple[str, float]] = {}

        @rule(client=st.integers(0, 1), tokens=st.dictionaries(IDS, ENDPOINTS, max_size=4))
        def create(self, client: int, tokens: dict[str, str]) -> None:
            self.clients[client].create(tokens)
            for token_id, endpoint in tokens.items():
                self.model.setdefault(token_id, (endpoint, self.clock.now))

        @rule(client=st.integers(0, 1), ids=st.lists(IDS, max_size=4))
        def delete(self, client: int, ids: list[str]) -> None:
            self.clients[client].delete(ids)
            for token_id in ids:
                self.model.pop(token_id, None)

        @rule(client=st.integers(0, 1), ids=st.lists(IDS, max_size=5))
        def read(self, client: int, ids: list[str]) -> None:
            assert self.clients[client].present_among(ids) == set(ids) & self.model.keys()

        @rule(seconds=st.floats(0.5, 100))
        def time_passes(self, seconds: float) -> None:
            self.clock.advance(seconds)

        @invariant()
        def outstanding_matches(self) -> None:
            if not hasattr(self, "model"):
                return
            expected: dict[str, TokenCount] = {}
            for endpoint, minted in self.model.values():
                known = expected.get(endpoint)
                expected[endpoint] = TokenCount(
                    (known.outstanding if known else 0) + 1,
                    min(known.oldest, minted) if known else minted,
                )
            assert self.clients[0].outstanding() == expected

        def teardown(self) -> None:
            for client in getattr(self, "clients", []):
                client.close()

    return TokenModel


SETTINGS = settings(
    max_examples=40,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@pytest.mark.memory
def test_the_memory_token_store_answers_as_the_model() -> None:
    run = machine(lambda name, **options: open_token_store(f"memory://{name}", **options))
    run.TestCase.settings = SETTINGS
    run.TestCase().runTest()


@pytest.mark.sqlite
def test_the_sqlite_token_store_answers_as_the_model(tmp_path: Path) -> None:
    def open_client(name: str, **options: Any) -> TokenStore:
        return open_token_store(f"sqlite:///{tmp_path}/{name}.db", **options)

    run = machine(open_client)
    run.TestCase.settings = SETTINGS
    run.TestCase().runTest()


class _ReMints(MemoryTokenStore):
    """BROKEN: creating a token that exists writes it again (its endpoint and mint time)."""

    def _create(self, records: list[TokenRecord]) -> None:
        self._delete([r.id for r in records])
        super()._create(records)


@pytest.mark.memory
def test_the_model_catches_a_store_that_mints_an_existing_token_again() -> None:
    run = machine(lambda name, **options: _ReMints(f"memory://{name}", **options))
    run.TestCase.settings = settings(
        SETTINGS, max_examples=200, phases=[Phase.generate], report_multiple_bugs=False
    )
    with pytest.raises(AssertionError):
        run.TestCase().runTest()
