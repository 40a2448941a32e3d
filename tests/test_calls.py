"""``dedupstore.calls``: the deadline, the one retry loop and the one fan-out."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import tenacity

from dedupstore import calls
from dedupstore.calls import DeadlinePassed, capped, deadline, fan_out, retry, time_left


@pytest.fixture
def no_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(calls, "BACKOFF", tenacity.wait_none())


def test_a_deadline_is_inherited_and_only_shortened() -> None:
    assert time_left() is None and capped(5.0) == 5.0
    with deadline(10.0):
        assert 9.0 < (time_left() or 0) <= 10.0
        with deadline(60.0):  # an inner, later deadline does not extend the outer one
            assert (time_left() or 0) <= 10.0
        with deadline(0.5):
            assert capped(5.0) <= 0.5
        with deadline(None):
            assert (time_left() or 0) > 9.0
    assert time_left() is None
    with deadline(-1.0), pytest.raises(DeadlinePassed, match="timed out"):
        capped(5.0)


def test_retry_retries_what_it_is_told_at_most_attempts_times(no_backoff: None) -> None:
    tries: list[int] = []

    def flaky() -> str:
        tries.append(1)
        if len(tries) < 3:
            raise ConnectionError("down")
        return "ok"

    assert retry(flaky, attempts=3, retry_on=lambda e: isinstance(e, ConnectionError)) == "ok"
    tries.clear()
    with pytest.raises(ConnectionError):
        retry(flaky, attempts=2, retry_on=lambda e: isinstance(e, ConnectionError))
    assert len(tries) == 2
    tries.clear()
    with pytest.raises(ConnectionError):
        retry(flaky, attempts=5, retry_on=lambda e: False)
    assert len(tries) == 1


def test_a_retry_judges_each_attempt_once_and_reports_it_by_its_number(
    no_backoff: None,
) -> None:
    """The first attempt runs before tenacity takes over: it is neither sent nor judged
    again, and ``before_sleep`` sees it as attempt 1, with its own error."""
    errors = [ConnectionError("first"), ConnectionError("second")]
    judged: list[BaseException] = []
    slept: list[tuple[int, BaseException | None]] = []

    def flaky() -> str:
        if errors:
            raise errors.pop(0)
        return "ok"

    def retry_on(exc: BaseException) -> bool:
        judged.append(exc)
        return True

    def before_sleep(state: tenacity.RetryCallState) -> None:
        assert state.outcome is not None
        slept.append((state.attempt_number, state.outcome.exception()))

    assert retry(flaky, attempts=5, retry_on=retry_on, before_sleep=before_sleep) == "ok"
    assert [str(e) for e in judged] == ["first", "second"]
    assert [(n, str(e)) for n, e in slept] == [(1, "first"), (2, "second")]


def test_retry_on_a_result_returns_the_last_one(no_backoff: None) -> None:
    left = iter([3, 2, 1, 0])
    assert retry(lambda: next(left), attempts=10, again=bool) == 0
    left = iter([3, 2, 1, 0])
    assert retry(lambda: next(left), attempts=2, again=bool) == 2


def test_retry_stops_at_the_deadline_whatever_attempts_allow(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a simulated clock (no time measured): attempts of 0.12 s and pauses of 0.05 s
    under a 0.5 s deadline; no pause ends after the deadline, no attempt starts after it."""
    now = [100.0]
    pauses: list[float] = []

    def pause(seconds: float) -> None:
        pauses.append(seconds)
        now[0] += seconds

    monkeypatch.setattr(calls, "_now", lambda: now[0])
    monkeypatch.setattr(calls, "_sleep", pause)
    monkeypatch.setattr(calls, "BACKOFF", tenacity.wait_fixed(0.05))
    starts: list[float] = []

    def slow() -> None:
        starts.append(now[0])
        now[0] += 0.12  # the attempt takes 0.12 s
        raise TimeoutError("no answer")

    with deadline(0.5), pytest.raises(TimeoutError, match="no answer"):
        retry(slow, attempts=None, retry_on=lambda e: True)
    # attempts at 0, 0.17 and 0.34 s; then 0.04 s are left: a pause would end after
    # the deadline, so it stops (a loop that only checked "time left > 0" would pause
    # and start a fourth attempt at 0.51 s)
    assert starts == pytest.approx([100.0, 100.17, 100.34]), starts
    assert pauses == pytest.approx([0.05, 0.05]), pauses


def test_deadline_passed_is_never_retried() -> None:
    tries: list[int] = []

    def late() -> None:
        tries.append(1)
        capped(1.0)

    with deadline(-1.0), pytest.raises(DeadlinePassed):
        retry(late, attempts=5, retry_on=lambda e: True)
    assert tries == [1]


def test_fan_out_keeps_order_context_and_concurrency() -> None:
    running, peak, lock = 0, 0, threading.Lock()

    def work(n: int) -> tuple[int, float | None]:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        time.sleep(0.01)
        with lock:
            running -= 1
        return n * n, time_left()

    with deadline(30.0):
        results = fan_out(work, range(20), concurrency=4)
    assert [r for r, _ in results] == [n * n for n in range(20)]
    assert all(left is not None and left <= 30.0 for _, left in results)  # the caller's deadline
    assert 1 < peak <= 4


def test_fan_out_stops_starting_waits_for_all_and_raises_the_first_in_input_order() -> None:
    started: list[int] = []
    finished: list[int] = []
    lock = threading.Lock()

    def work(n: int) -> int:
        with lock:
            started.append(n)
        if n == 1:
            time.sleep(0.2)
            with lock:
                finished.append(n)
            raise KeyError(n)
        if n == 2:
            raise ValueError(n)
        time.sleep(0.05)
        with lock:
            finished.append(n)
        return n

    with pytest.raises(KeyError):  # 1 failed after 2, but comes first in the input
        fan_out(work, range(100), concurrency=3)
    assert 1 in finished  # waited for
    assert len(started) < 100  # no new call after a failure


def test_fan_out_runs_nested_and_single_calls_inline() -> None:
    caller = threading.get_ident()
    assert fan_out(lambda n: threading.get_ident(), [1], concurrency=8) == [caller]

    def outer(n: int) -> list[int]:
        here = threading.get_ident()
        inner = fan_out(lambda m: threading.get_ident(), range(3), concurrency=8)
        assert inner == [here] * 3  # no deadlock on a saturated executor
        return inner

    assert len(fan_out(outer, range(4), concurrency=4)) == 4


def _in_child(work: Callable[[], str], fork: Callable[[], int] = os.fork) -> str:
    """What ``work()`` returns in a child made by ``fork`` (``os.fork`` by default)."""
    read, write = os.pipe()
    pid = fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read)
        os.write(write, work().encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        text = pipe.read()
    os.waitpid(pid, 0)
    return text


def test_the_executor_is_per_process() -> None:
    pool = calls.executor()
    assert calls.executor() is pool

    def in_child() -> str:
        ok = calls.executor() is not pool and fan_out(abs, [-1, -2], concurrency=2) == [1, 2]
        return "1" if ok else "0"

    assert _in_child(in_child) == "1"


def test_gc_relaxed_raises_the_young_threshold_and_puts_it_back() -> None:
    import gc

    from dedupstore.calls import GC_BATCH_THRESHOLD, gc_relaxed

    before = gc.get_threshold()
    relaxed = (GC_BATCH_THRESHOLD, *before[1:])
    with gc_relaxed():
        assert gc.get_threshold() == relaxed and gc.isenabled()
        with gc_relaxed():  # nested (or in another thread): put back once the last ends
            assert gc.get_threshold() == relaxed
        assert gc.get_threshold() == relaxed
    assert gc.get_threshold() == before
    with pytest.raises(KeyError), gc_relaxed():
        raise KeyError("the block failed: the thresholds are put back all the same")
    assert gc.get_threshold() == before
    with gc_relaxed(None):
        assert gc.get_threshold() == before
    with gc_relaxed(200_000):  # a threshold of the caller's; a nested block's higher one wins
        assert gc.get_threshold()[0] == 200_000
        with gc_relaxed(300_000):
            assert gc.get_threshold()[0] == 300_000
    assert gc.get_threshold() == before
    try:
        for own in (500_000, 0):  # a program's own higher threshold is kept, and 0 (off)
            gc.set_threshold(own, *before[1:])
            with gc_relaxed():
                assert gc.get_threshold()[0] == own
            assert gc.get_threshold()[0] == own
    finally:
        gc.set_threshold(*before)


def test_gc_relaxed_in_two_threads_puts_back_when_both_ended() -> None:
    import gc

    from dedupstore.calls import GC_BATCH_THRESHOLD, gc_relaxed

    before = gc.get_threshold()
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen: list[int] = []

    def first() -> None:
        with gc_relaxed():
            first_in.set()
            second_in.wait(5)
        first_out.set()

    thread = threading.Thread(target=first)
    thread.start()
    first_in.wait(5)
    with gc_relaxed():
        second_in.set()
        first_out.wait(5)
        seen.append(gc.get_threshold()[0])  # the first block ended; this one still runs
    thread.join(5)
    assert seen == [GC_BATCH_THRESHOLD] and gc.get_threshold() == before


def test_a_child_forked_during_a_relaxed_block_has_the_thresholds_as_before() -> None:
    import gc

    from dedupstore.calls import gc_relaxed

    before = gc.get_threshold()
    with gc_relaxed():
        pid = os.fork()
        if pid == 0:  # the child: the thresholds as before the block, and blocks work
            ok = gc.get_threshold() == before
            with gc_relaxed():
                ok = ok and gc.get_threshold() != before
            os._exit(0 if ok and gc.get_threshold() == before else 1)
        _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0 and gc.get_threshold() == before


def test_write_tokens_are_unique_across_threads_and_forked_children() -> None:
    from dedupstore.calls import write_token

    made: list[str] = []

    def draw() -> None:
        made.extend(write_token() for _ in range(5_000))

    threads = [threading.Thread(target=draw) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(made)) == len(made) == 20_000
    assert all(len(t) == 32 and int(t, 16) >= 0 for t in made)

    def in_child() -> str:  # its own tokens and its own id
        child = [write_token() for _ in range(1_000)]
        return "\n".join(child) if calls.pid() == os.getpid() else ""

    child = _in_child(in_child).split("\n")
    parent = [write_token() for _ in range(1_000)]
    assert len(child) == 1_000, "the child's pid() was not its own"
    assert not set(child) & set(made + parent)
    assert calls.pid() == os.getpid()


_RAW_FORK = """
import ctypes, os
from dedupstore.calls import write_token
write_token()
read, write = os.pipe()
pid = ctypes.PyDLL(None).fork()
if pid == 0:
    os.close(read)
    os.write(write, "\\n".join(write_token() for _ in range(100)).encode())
    os._exit(0)
os.close(write)
with os.fdopen(read) as pipe:
    copy = pipe.read().split("\\n")
os.waitpid(pid, 0)
mine = [write_token() for _ in range(100)]
print(len(copy), len(set(copy) & set(mine)))
"""


def test_a_copy_of_the_process_that_skipped_the_fork_hooks_draws_other_tokens() -> None:
    """A process copied with its memory (a VM snapshot restored twice, a fork by C
    code) runs no fork hook: a token made from state kept in the process (a random
    part and a counter) would repeat in both copies. ``fork(2)`` called directly
    (holding the GIL, bypassing ``os.fork``'s hooks) makes such a copy, in a fresh
    interpreter: in this one another thread may be waiting for the GIL, and the copy
    would wait forever to hand it over."""
    done = subprocess.run(
        [sys.executable, "-c", _RAW_FORK], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.split() == ["100", "0"], done.stdout + done.stderr


def test_a_deadline_applies_in_its_block_only_and_again_when_reentered() -> None:
    block = deadline(30.0)
    with block:
        left = time_left()
        assert left is not None and 29.0 < left <= 30.0
    assert time_left() is None
    with block:  # the same object again: a new deadline from now
        assert time_left() is not None
    assert time_left() is None


def test_aretry_awaits_retries_what_it_is_told_and_never_past_the_deadline(
    no_backoff: None,
) -> None:
    """The coroutine twin of ``retry``: each attempt awaited (tenacity would call a plain
    callable without awaiting what it returns), at most ``attempts``, an error
    ``retry_on`` refuses raised at once, ``DeadlinePassed`` never retried."""
    import asyncio

    from dedupstore.calls import aretry

    tries: list[int] = []

    async def flaky() -> str:
        tries.append(1)
        if len(tries) < 3:
            raise ConnectionError("reset")
        return "ok"

    async def main() -> None:
        assert await aretry(flaky, attempts=3, retry_on=lambda e: True) == "ok"
        assert len(tries) == 3
        tries.clear()
        with pytest.raises(ConnectionError):
            await aretry(flaky, attempts=2, retry_on=lambda e: True)
        assert len(tries) == 2
        tries.clear()
        with pytest.raises(ConnectionError):
            await aretry(flaky, attempts=5, retry_on=lambda e: False)
        assert len(tries) == 1

        async def late() -> None:
            tries.append(1)
            raise DeadlinePassed

        tries.clear()
        with pytest.raises(DeadlinePassed):
            await aretry(late, attempts=5, retry_on=lambda e: True)
        assert len(tries) == 1

    asyncio.run(main())


def test_aretry_runs_a_first_attempt_that_succeeds_outside_tenacity(
    no_backoff: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As ``retry``: a call that succeeds at once pays none of tenacity's bookkeeping (a
    cost per store call on the event loop: ``make bench-aio``); one that fails is
    replayed to tenacity as its first attempt, so its attempts, pauses and
    ``before_sleep`` count as before."""
    import asyncio

    from dedupstore import calls

    real = calls.AsyncRetrying
    made: list[int] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        made.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(calls, "AsyncRetrying", counted)
    tries: list[int] = []
    slept: list[int] = []

    async def flaky() -> str:
        tries.append(1)
        if len(tries) < 2:
            raise ConnectionError("reset")
        return "ok"

    async def main() -> None:
        async def fine() -> str:
            return "fine"

        assert await calls.aretry(fine, attempts=3, retry_on=lambda e: True) == "fine"
        assert made == []
        before = lambda state: slept.append(state.attempt_number)  # noqa: E731
        assert await calls.aretry(flaky, attempts=2, retry_on=lambda e: True, before_sleep=before)
        assert (len(tries), slept, made) == (2, [1], [1])

    asyncio.run(main())
