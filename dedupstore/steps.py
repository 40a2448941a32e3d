"""The algorithm's steps without I/O, and the two faces that drive them.

The outbox's steps (:mod:`dedupstore.outbox`) are generators: where a step needs a
store, a dispatcher or the user's code, it yields a :class:`Call` and is sent back the
answer (or has the call's error thrown in, where its ``try`` blocks see it as if it
had been raised in place). The sync face runs a step with :func:`run`, calling each
:class:`Call` in the calling thread; the async face (:mod:`dedupstore.aio`) with
:func:`arun`, awaiting a native async call, running a blocking one in a thread, and
awaiting what the user's code returns when it is awaitable. So the algorithm is
written once, and both faces take the same decisions in the same order.

A step is written with ``yield from``::

    def _load(self, cid: str) -> Steps[Entity]:
        entity = yield from io(self.entities.load, cid)
        return self._claim(entity)

This module imports nothing of dedupstore: it knows calls, not stores.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import os
import threading
from collections.abc import Awaitable, Callable, Generator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar, cast

__all__ = ["Call", "Steps", "arun", "awaited", "io", "offload", "run", "user"]

T = TypeVar("T")
R = TypeVar("R")
P = ParamSpec("P")


class Call:
    """One call a step asks its face to make: ``fn(*args, **kwargs)``.

    I/O (a store's, a dispatcher's or a broker's call): the sync face calls it in place;
    the async face awaits it when ``fn`` is a coroutine function and runs it in a thread
    when it blocks. ``user``: the awaitable ``args[0]`` that the user's ``fn`` (a
    handler, a callback, already called in place by the step) returned: the async face
    awaits it, the sync face refuses it.
    """

    __slots__ = ("args", "fn", "kwargs", "user")

    def __init__(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], user: bool
    ) -> None:
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self.user = user

    def __repr__(self) -> str:
        name = getattr(self.fn, "__qualname__", repr(self.fn))
        return f"Call({name}, {'user' if self.user else 'io'})"


#: A step: a generator of the calls it needs, returning ``T``.
Steps = Generator[Call, Any, T]


def io(fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> Steps[R]:
    """A step that makes one I/O call, ``fn(*args, **kwargs)``, and returns its answer."""
    return cast(R, (yield Call(fn, args, kwargs, False)))


def user(fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> Steps[R]:
    """A step that runs the user's ``fn(*args, **kwargs)`` in place (both faces) and
    returns what it returns, awaited first by the async face when it is awaitable."""
    value = fn(*args, **kwargs)
    if type(value) is not tuple and inspect.isawaitable(value):  # (a handler's: a tuple)
        value = yield from awaited(value, fn)
    return value


def awaited(value: Any, fn: Callable[..., Any]) -> Steps[Any]:
    """A step that awaits ``value``, which the user's ``fn`` returned: the async face
    awaits it; the sync face refuses it (``TypeError`` naming ``fn``, thrown into the
    step). A step that calls the user's code in place asks this only when what it got
    is awaitable, so the sync face pays nothing per call."""
    return (yield Call(fn, (value,), {}, True))


def run(steps: Steps[T]) -> T:
    """Drive ``steps`` in the calling thread: the sync face. Each call is made in
    place; its error is thrown into the step that asked for it."""
    send, throw = steps.send, steps.throw
    value: Any = None
    error: BaseException | None = None
    while True:
        try:
            call = send(value) if error is None else throw(error)
        except StopIteration as stop:
            return cast(T, stop.value)
        error = value = None
        if call.user:  # an awaitable the user's code returned: the sync API cannot await it
            _close(call.args[0])
            error = _awaited_in_sync(call)
            continue
        try:
            value = call.fn(*call.args, **call.kwargs)
        except BaseException as exc:  # noqa: BLE001 (thrown into the step, where it belongs)
            error = exc


def _close(value: object) -> None:
    close = getattr(value, "close", None)
    if callable(close):
        close()  # no "coroutine was never awaited" warning: the error says it


def _awaited_in_sync(call: Call) -> TypeError:
    name = getattr(call.fn, "__qualname__", type(call.fn).__name__)
    return TypeError(
        f"{name!r:.80} returned an awaitable to the sync API; use dedupstore.aio "
        "(AsyncOutboxProcessor) for async handlers and callbacks"
    )


async def arun(steps: Steps[T]) -> T:
    """Drive ``steps`` on the running event loop: the async face. An I/O call whose
    ``fn`` is a coroutine function is awaited; a blocking one runs in a thread
    (:func:`offload`); the user's code is called in place and what it returns awaited
    when it is awaitable. A cancellation is thrown into the step like any error."""
    send, throw = steps.send, steps.throw
    value: Any = None
    error: BaseException | None = None
    while True:
        try:
            call = send(value) if error is None else throw(error)
        except StopIteration as stop:
            return cast(T, stop.value)
        error = None
        try:
            fn = call.fn
            if call.user:  # an awaitable the user's code returned
                value = await call.args[0]
            elif inspect.iscoroutinefunction(fn):
                value = await fn(*call.args, **call.kwargs)
            else:
                value = await offload(fn, *call.args, **call.kwargs)
        except BaseException as exc:  # noqa: BLE001 (thrown into the step, where it belongs)
            error, value = exc, None


# ------------------------------------------------------------------------- threads

#: Threads that run the blocking calls of the async face (``DEDUPSTORE_AIO_THREADS``).
OFFLOAD_THREADS = int(os.environ.get("DEDUPSTORE_AIO_THREADS", "64"))

_pool: ThreadPoolExecutor | None = None
_pool_pid = 0
_pool_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool = ThreadPoolExecutor(OFFLOAD_THREADS, thread_name_prefix="dedupstore-aio")
            _pool_pid = os.getpid()
        return _pool


async def offload(fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    """``fn(*args, **kwargs)``, a blocking call, run in one of ``OFFLOAD_THREADS``
    threads in a copy of the caller's context (its deadline).

    Cancelled while the call runs, it waits for the call to end (bounded by the
    call's own deadline: a store call has one) before it raises ``CancelledError``:
    a thread cannot be stopped, and a write left running behind a cancelled task
    could land after the retry that should have found it. So a cancelled task
    leaves what a process stopped between two calls leaves, which the algorithm
    repairs on redelivery."""
    loop = asyncio.get_running_loop()
    context = contextvars.copy_context()
    future = loop.run_in_executor(_executor(), lambda: context.run(fn, *args, **kwargs))
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        await _finished(future)
        raise


async def _finished(future: Awaitable[Any]) -> None:
    """Wait for ``future`` to end, whatever it gives and however often the waiting task
    is cancelled meanwhile."""
    task = asyncio.ensure_future(future)
    while not task.done():
        try:
            await asyncio.wait([task])
        except asyncio.CancelledError:
            continue
    if not task.cancelled():
        task.exception()  # retrieved: the cancellation is what the caller hears
