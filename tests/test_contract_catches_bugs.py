"""The shipped contract suite fails broken backends (so passing it means something)."""

from __future__ import annotations

import textwrap

import pytest

pytestmark = pytest.mark.memory

_TEMPLATE = """
import uuid
import pytest
from dedupstore.backends.memory import MemoryDeduplicationStore
from dedupstore.testing import DeduplicationStoreContract

class Mutant(MemoryDeduplicationStore):
{body}

class TestMutant(DeduplicationStoreContract):
    @pytest.fixture
    def store_factory(self):
        url = f"memory://{{uuid.uuid4().hex}}"
        return lambda **options: Mutant(url, **options)
"""

MUTANTS = {
    "always recorded": (
        "    def _add_new(self, request):\n"
        "        super()._add_new(request)\n"
        "        return set(request.ids)\n",
        "test_add_records_once",
    ),
    "reads ignore expiry": (
        "    def _find(self, ids, now):\n        return super()._find(ids, 0.0)\n",
        "test_retention_expires_records",
    ),
    "expired never re-recorded": (
        "    def _add_new(self, request):\n"
        "        return super()._add_new(request._replace(now=0.0))\n",
        "test_expired_record_is_recorded_again",
    ),
    "endpoints shared": (
        "    def __init__(self, url, **options):\n"
        "        options.pop('endpoint', None)\n"
        "        super().__init__(url, **options)\n",
        "test_endpoint_isolation",
    ),
    "ids truncated to 200 chars": (
        "    def _add_new(self, request):\n"
        "        base = super()._add_new\n"
        "        return {i for i in request.ids if base(request._replace(ids=[i[:200]]))}\n"
        "    def _find(self, ids, now):\n"
        "        base = super()._find\n"
        "        return {i for i in ids if base([i[:200]], now)}\n",
        "test_hostile_ids_never_collide",
    ),
    "purge deletes everything": (
        "    def _purge(self, now):\n        return super()._purge(float('inf'))\n",
        "test_purge_expired",
    ),
    "batch drops the last id": (
        "    def _add_new(self, request):\n"
        "        ids = request.ids[:-1] if len(request.ids) > 1 else request.ids\n"
        "        return super()._add_new(request._replace(ids=ids))\n",
        "test_add_many_returns_recorded_ids",
    ),
    "every token counts as mine": (
        "    def _add_new(self, request):\n"
        "        tokens = {t for _, t in self._records.values()}\n"
        "        return super()._add_new(request._replace(mine=request.mine | tokens))\n",
        "test_add_records_once",
    ),
}


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_contract_fails_the_mutant(pytester: pytest.Pytester, name: str) -> None:
    body, expected_failure = MUTANTS[name]
    pytester.makepyfile(test_mutant=textwrap.dedent(_TEMPLATE).format(body=body))
    result = pytester.runpytest_subprocess(
        "-q", "-p", "no:cacheprovider", "-x", "-k", expected_failure
    )
    outcomes = result.parseoutcomes()
    output = result.stdout.str()
    assert outcomes.get("failed", 0) >= 1, output[-2000:]
    # the contract must catch the bug by an assertion, not by a crash of the mutant
    assert "AssertionError" in output and "TypeError" not in output, output[-2000:]


def test_contract_passes_the_real_memory_backend(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_mutant=textwrap.dedent(_TEMPLATE).format(body="    pass\n"))
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider")
    assert result.parseoutcomes().get("passed", 0) > 100
    assert result.ret == 0
