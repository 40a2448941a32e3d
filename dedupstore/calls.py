"""How one call to a server runs: its deadline (:func:`deadline`, read by drivers with
:func:`time_left` / :func:`capped`), its retries (:func:`retry`, never past the
deadline), its fan-out (:func:`fan_out`); also :func:`gc_relaxed`, :func:`pid` and
:func:`write_token`.
"""

from __future__ import annotations

import contextlib
import contextvars
import gc
import itertools
import os
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar, cast

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    Retrying,
    retry_if_exception,
    wait_random_exponential,
)

__all__ = [
    "BACKOFF",
    "GC_BATCH_THRESHOLD",
    "DeadlinePassed",
    "aretry",
    "capped",
    "deadline",
    "executor",
    "fan_out",
    "gc_relaxed",
    "pause_before",
    "pid",
    "retry",
    "time_left",
    "write_token",
]

T = TypeVar("T")
R = TypeVar("R")

#: The one backoff policy between attempts: full jitter, 50 ms doubling, at most 1 s.
BACKOFF = wait_random_exponential(multiplier=0.05, max=1.0)


def pause_before(attempt: int, policy: Callable[[RetryCallState], float] = BACKOFF) -> float:
    """Seconds to wait before try ``attempt + 1`` under a tenacity wait ``policy``
    (for loops that wait themselves, e.g. on an event a signal sets)."""
    state = RetryCallState(cast(Any, None), None, (), {})
    state.attempt_number = attempt
    return float(policy(state))


#: The clock deadlines are read on, and how a retry pauses (tests replace both with a
#: simulated clock, to check the deadline without measuring time).
_now: Callable[[], float] = time.monotonic
_sleep: Callable[[float], None] = time.sleep

#: The monotonic instant the current call must end by (``None``: no deadline).
_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "dedupstore_deadline", default=None
)

#: Threads of the fan-out executor: nested fan-outs there run inline (no deadlock).
_WORKERS = 256
_worker = threading.local()


class DeadlinePassed(TimeoutError):
    """The call's deadline passed before a request could be sent or answered."""

    def __init__(self, message: str = "timed out: the call's deadline passed") -> None:
        super().__init__(message)


class deadline(contextlib.AbstractContextManager[None]):
    """Run the block under a deadline ``seconds`` from now (an earlier one is kept).

    ``None`` adds no deadline (an enclosing one still applies). (A class, not a
    generator: every store call enters one.)
    """

    __slots__ = ("_seconds", "_token")

    def __init__(self, seconds: float | None) -> None:
        self._seconds = seconds
        self._token: contextvars.Token[float | None] | None = None

    def __enter__(self) -> None:
        seconds = self._seconds
        if seconds is not None:
            at = _now() + seconds
            outer = _DEADLINE.get()
            self._token = _DEADLINE.set(at if outer is None else min(outer, at))

    def __exit__(self, *exc: object) -> None:
        token = self._token
        if token is not None:
            self._token = None
            _DEADLINE.reset(token)


def time_left() -> float | None:
    """Seconds left before the current deadline (negative once past); ``None``: none."""
    at = _DEADLINE.get()
    return None if at is None else at - _now()


def capped(seconds: float) -> float:
    """``seconds``, or the time left if shorter: a timeout for one attempt. Raises
    :class:`DeadlinePassed` (a ``TimeoutError``) when no time is left."""
    left = time_left()
    if left is None:
        return seconds
    if left <= 0:
        raise DeadlinePassed
    return min(seconds, left)


def _stop(attempts: int | None) -> Callable[[RetryCallState], bool]:
    """Tenacity's stop of :func:`retry` and :func:`aretry`: after ``attempts`` attempts
    (``None``: no limit), or when the next pause would pass the current deadline."""

    def stop(state: RetryCallState) -> bool:
        if attempts is not None and state.attempt_number >= attempts:
            return True
        left = time_left()
        return left is not None and left <= (state.upcoming_sleep or 0.0)

    return stop


def _retried(error: BaseException, retry_on: Callable[[BaseException], bool]) -> bool:
    """Whether an attempt that raised ``error`` is made again (never a passed deadline)."""
    return not isinstance(error, DeadlinePassed) and retry_on(error)


def retry(
    fn: Callable[[], T],
    *,
    attempts: int | None,
    retry_on: Callable[[BaseException], bool] = lambda exc: False,
    again: Callable[[T], bool] | None = None,
    before_sleep: Callable[[RetryCallState], None] | None = None,
) -> T:
    """``fn()``, called again after an error ``retry_on`` accepts (or a result ``again`` refuses).

    At most ``attempts`` calls (``None``: until the deadline), :data:`BACKOFF` between
    them, never past the current deadline. Returns the first accepted result, or the
    last one once out of attempts; raises the last error otherwise (never retrying
    :class:`DeadlinePassed`).
    """

    def wanted(error: BaseException | None, result: Any = None) -> bool:
        """Whether an attempt that raised ``error`` (or returned ``result``) is made again."""
        if error is not None:
            return _retried(error, retry_on)
        return again is not None and again(result)

    # The first attempt runs outside tenacity (a call that succeeds need not pay its
    # bookkeeping); tenacity then replays its outcome as its own first attempt.
    failed: BaseException | None = None
    try:
        first = fn()
    except Exception as exc:
        if not wanted(exc):
            raise
        failed = exc
    else:
        if not wanted(None, first):
            return first
    replayed = False

    def attempt() -> T:
        nonlocal replayed
        if replayed:
            return fn()
        replayed = True
        if failed is not None:
            raise failed
        return first

    def decide(state: RetryCallState) -> bool:
        outcome = state.outcome
        if outcome is None:  # pragma: no cover - tenacity always sets it
            return False
        if state.attempt_number == 1:  # the replayed first attempt: judged above
            return True
        if outcome.failed:
            return wanted(outcome.exception())
        return wanted(None, outcome.result())

    def give_up(state: RetryCallState) -> T:
        assert state.outcome is not None
        result: T = state.outcome.result()  # the last error is raised here
        return result

    retrying = Retrying(
        stop=_stop(attempts),
        wait=BACKOFF,
        retry=decide,
        before_sleep=before_sleep,
        retry_error_callback=give_up,
        sleep=lambda seconds: _sleep(seconds),
    )
    return retrying(attempt)


async def aretry(
    fn: Callable[[], Awaitable[T]],
    *,
    attempts: int | None,
    retry_on: Callable[[BaseException], bool] = lambda exc: False,
    before_sleep: Callable[[RetryCallState], None] | None = None,
) -> T:
    """:func:`retry` for a coroutine function: ``await fn()``, awaited again after an
    error ``retry_on`` accepts, at most ``attempts`` times (``None``: until the
    deadline), :data:`BACKOFF` between them (``asyncio.sleep``), never past the current
    deadline; raises the last error (never retrying :class:`DeadlinePassed`).
    ``before_sleep`` is called (with tenacity's state) before each pause."""

    def wanted(error: BaseException) -> bool:
        return _retried(error, retry_on)

    # As in retry(): the first attempt runs outside tenacity (a call that succeeds need
    # not pay its bookkeeping, a cost per call on the event loop); tenacity then replays
    # its error as its own first attempt.
    try:
        return await fn()
    except Exception as exc:
        if not wanted(exc):
            raise
        failed: BaseException = exc
    replayed = False

    retrying = AsyncRetrying(
        stop=_stop(attempts),
        wait=BACKOFF,
        retry=retry_if_exception(wanted),
        before_sleep=before_sleep,
        reraise=True,
    )

    async def attempt() -> T:  # (tenacity calls a plain callable without awaiting it)
        nonlocal replayed
        if replayed:
            return await fn()
        replayed = True
        raise failed

    result: T = await retrying(attempt)
    return result


# --------------------------------------------------------------------------- fan-out


class _ContextPool(ThreadPoolExecutor):
    """A thread pool whose calls run in a copy of the submitter's context (its deadline)."""

    def submit(self, fn: Callable[..., R], /, *args: Any, **kwargs: Any) -> Future[R]:
        return super().submit(contextvars.copy_context().run, fn, *args, **kwargs)


_pool: _ContextPool | None = None
_pool_pid = 0
_pool_lock = threading.Lock()


def executor() -> ThreadPoolExecutor:
    """The process's one executor (a child after ``fork()`` gets its own), for drivers
    that take one; its calls run in a copy of the submitter's context (its deadline)."""
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is None or _pool_pid != _pid:
            _pool = _ContextPool(_WORKERS, thread_name_prefix="dedupstore")
            _pool_pid = _pid
        return _pool


def _in_worker(fn: Callable[[T], R], item: T) -> R:
    _worker.active = True
    try:
        return fn(item)
    finally:
        _worker.active = False


def fan_out(fn: Callable[[T], R], items: Iterable[T], *, concurrency: int) -> list[R]:
    """``[fn(x) for x in items]`` with up to ``concurrency`` calls in flight.

    Items are drawn as calls finish (at most ``concurrency`` held), each call in a copy
    of the caller's context (its deadline). Once a call failed (or drawing an item
    raised) no new call starts, every started call is waited for, and the first
    failure in input order is raised. With ``concurrency`` 1, a single item, or inside
    another fan-out, the calls run one by one in the calling thread.
    """
    if concurrency <= 1 or getattr(_worker, "active", False):
        return [fn(item) for item in items]
    iterator = iter(items)
    head = list(itertools.islice(iterator, 2))
    if len(head) < 2:  # one call: no thread hop
        return [fn(item) for item in head]
    items = itertools.chain(head, iterator)
    pool = executor()
    running: dict[Future[R], int] = {}
    results: dict[int, R] = {}
    errors: dict[int, BaseException] = {}

    def settle(finished: Iterable[Future[R]]) -> None:
        for future in finished:
            index = running.pop(future)
            error = future.exception()
            if error is None:
                results[index] = future.result()
            else:
                errors[index] = error

    try:
        for index, item in enumerate(items):
            while len(running) >= concurrency:
                settle(wait(running, return_when=FIRST_COMPLETED).done)
            if errors:
                break
            running[pool.submit(_in_worker, fn, item)] = index
    finally:
        settle(wait(running).done)
    if errors:
        raise errors[min(errors)]
    return [results[index] for index in sorted(results)]


# ---------------------------------------------------------------------- the garbage collector

#: The young generation's threshold a :func:`gc_relaxed` block sets by default (CPython's: 700).
GC_BATCH_THRESHOLD = 100_000

_gc_lock = threading.Lock()
_gc_blocks = 0  # gc_relaxed blocks running now, in every thread
_gc_saved: tuple[int, ...] = ()  # the thresholds when the first of them began


@contextlib.contextmanager
def gc_relaxed(threshold: int | None = GC_BATCH_THRESHOLD) -> Iterator[None]:
    """Run the block with the cyclic garbage collector's young generation collected after
    ``threshold`` new objects instead of 700 (a higher threshold, or 0, is kept), then
    put back the thresholds of before the first overlapping block (``None``: no change).

    For a batch, whose objects live as long as it: at 700 the collector would promote
    them and then run full collections walking every object of the process. The
    thresholds are the process's; collections still run. Thread-safe; a child forked
    during a block starts with the thresholds as they were.
    """
    global _gc_blocks, _gc_saved
    if threshold is None:
        yield
        return
    with _gc_lock:
        if _gc_blocks == 0:
            _gc_saved = gc.get_threshold()
        young = gc.get_threshold()[0]
        if young:  # (0: the program turned automatic collection off)
            gc.set_threshold(max(threshold, young), *_gc_saved[1:])
        _gc_blocks += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_blocks -= 1
            if _gc_blocks == 0:
                gc.set_threshold(*_gc_saved)


# ---------------------------------------------------------------------- this process

_pid = os.getpid()


def pid() -> int:
    """``os.getpid()``, read once per process (a system call on every read otherwise)."""
    return _pid


def write_token() -> str:
    """A token no other write shares: 128 random bits drawn for this call (32 hex digits).

    Never derived from state kept in the process: a process copied with its memory (a
    restored VM snapshot, a fork bypassing Python's hooks) must not repeat another
    copy's tokens, or it would take the other's record for its own write.
    """
    return os.urandom(16).hex()


def _after_fork() -> None:
    global _gc_blocks, _gc_lock, _pid
    _pid = os.getpid()
    _gc_lock = threading.Lock()
    if _gc_blocks:
        gc.set_threshold(*_gc_saved)
    _gc_blocks = 0


os.register_at_fork(after_in_child=_after_fork)
