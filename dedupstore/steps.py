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
import contextlib
import contextvars
import functools
import inspect
import itertools
import os
import threading
from collections.abc import Awaitable, Callable, Generator, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar, cast

__all__ = [
    "Call",
    "Steps",
    "arun",
    "awaited",
    "call",
    "fan",
    "io",
    "offload",
    "offload_to",
    "on_async_face",
    "run",
    "user",
]

T = TypeVar("T")
R = TypeVar("R")
P = ParamSpec("P")


#: The kinds of :class:`Call`.
IO, USER, FAN = 0, 1, 2


class Call:
    """One call a step asks its face to make: ``fn(*args, **kwargs)``.

    ``kind`` ``IO`` (a store's, a dispatcher's or a broker's call): the sync face
    calls it in place; the async face awaits it when ``fn`` is a coroutine function and
    runs it in a thread when it blocks. ``USER``: the awaitable ``args[0]`` that the
    user's ``fn`` (a handler, a callback, already called in place by the step) returned:
    the async face awaits it, the sync face refuses it. ``FAN`` (:func:`fan`): the
    steps ``args[0]`` run side by side, at most ``args[1]`` at once: the sync face
    through ``fn`` (a thread fan-out), the async face as tasks.
    """

    __slots__ = ("args", "fn", "kind", "kwargs")

    def __init__(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], kind: int
    ) -> None:
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self.kind = kind

    def __repr__(self) -> str:
        name = getattr(self.fn, "__qualname__", repr(self.fn))
        return f"Call({name}, {('io', 'user', 'fan')[self.kind]})"


#: A step: a generator of the calls it needs, returning ``T``.
Steps = Generator[Call, Any, T]

#: True while :func:`arun` drives steps (in its task and the tasks it starts); false in
#: the calls it runs in threads (:func:`offload`) and under :func:`run`.
_ASYNC_FACE: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "dedupstore_async_face", default=False
)


def on_async_face() -> bool:
    """Whether the steps running now are driven by :func:`arun` (a store's primitive
    written as steps then makes its driver calls on its connection's async twin)."""
    return _ASYNC_FACE.get()


def io(fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> Steps[R]:
    """A step that makes one I/O call, ``fn(*args, **kwargs)``, and returns its answer."""
    return cast(R, (yield Call(fn, args, kwargs, IO)))


def call(target: Any, name: str, *args: Any) -> Steps[Any]:
    """``target.<name>(*args)``, a store's call, as steps. On the async face, when
    ``target``'s class writes that call as steps (``_<name>_steps``, leading underscores
    of ``name`` dropped, beside the method: the stores of :mod:`dedupstore` do), those
    steps, so that its primitives run natively; when it is an object that stands for a
    store and relays calls as steps (its class defines ``call_steps(name, *args)``: the
    interleaving harness's scheduler), its ``call_steps``; else (the sync face; any
    other stand-in object, a test double; a method overridden without its steps, on a
    subclass or on the object) one I/O call of the method, in place or in a thread."""
    if _ASYNC_FACE.get() and name not in getattr(target, "__dict__", ()):
        kind = type(target)
        own = _steps_of(kind, name)  # type: ignore[arg-type]
        if own is not None:
            return own(target, *args)
        relay = getattr(kind, "call_steps", None)
        if relay is not None:
            return cast(Steps[Any], relay(target, name, *args))
    return io(getattr(target, name), *args)


@functools.cache
def _steps_of(cls: type, name: str) -> Callable[..., Steps[Any]] | None:
    """The steps function of ``cls``'s method ``name``: ``_<name>_steps`` of the class
    that defines the method (``None`` if that class writes none)."""
    for klass in cls.__mro__:
        if name in vars(klass):
            found = vars(klass).get(f"_{name.lstrip('_')}_steps")
            return cast(Callable[..., Steps[Any]] | None, found)
    return None


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
    return (yield Call(fn, (value,), {}, USER))


#: ``fan_out(fn, items, concurrency=n)``: the sync face's way of running calls side by
#: side (:func:`dedupstore.calls.fan_out`: threads, the first failure raised).
FanOut = Callable[..., list[Any]]


def fan(fan_out: FanOut, items: Iterable[Steps[R]], concurrency: int) -> Steps[list[R]]:
    """A step that runs each of ``items`` (steps, drawn as room frees up) with at most
    ``concurrency`` in flight and returns their results in order: the sync face through
    ``fan_out`` (:func:`dedupstore.calls.fan_out`, threads), the async face as tasks on
    the loop. On both, once one failed (or drawing an item raised) no new one starts,
    every started one is waited for, and the first failure in input order is raised.
    With ``concurrency`` 1 or a single item they run one by one in this step (no thread,
    no task)."""
    iterator = iter(items)
    head = list(itertools.islice(iterator, 1 if concurrency <= 1 else 2))
    if len(head) > 1:
        both = itertools.chain(head, iterator)
        return cast(list[R], (yield Call(fan_out, (both, concurrency), {}, FAN)))
    results: list[R] = []
    for steps in itertools.chain(head, iterator):
        results.append((yield from steps))
    return results


def run(steps: Steps[T]) -> T:
    """Drive ``steps`` in the calling thread: the sync face. Each call is made in
    place; its error is thrown into the step that asked for it. (Called from code the
    async face runs, such as an async handler calling the sync API, it stays sync.)"""
    if _ASYNC_FACE.get():
        reset = _ASYNC_FACE.set(False)
        try:
            return _run(steps)
        finally:
            _ASYNC_FACE.reset(reset)
    return _run(steps)


def _run(steps: Steps[T]) -> T:
    send, throw = steps.send, steps.throw
    value: Any = None
    error: BaseException | None = None
    while True:
        try:
            call = send(value) if error is None else throw(error)
        except StopIteration as stop:
            return cast(T, stop.value)
        error = value = None
        if call.kind:
            if call.kind == USER:  # an awaitable the user's code returned: the sync API
                _close(call.args[0])  # cannot await it
                error = _awaited_in_sync(call)
                continue
            try:
                value = call.fn(run, call.args[0], concurrency=call.args[1])
            except BaseException as exc:  # noqa: BLE001 (thrown into the step)
                error = exc
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
    if _ASYNC_FACE.get():
        return await _arun(steps)
    reset = _ASYNC_FACE.set(True)
    try:
        return await _arun(steps)
    finally:
        # (ValueError: closed outside its task, a coroutine collected at shutdown)
        with contextlib.suppress(ValueError):
            _ASYNC_FACE.reset(reset)


async def _arun(steps: Steps[T]) -> T:
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
            if call.kind == USER:  # an awaitable the user's code returned
                value = await call.args[0]
            elif call.kind == FAN:
                value = await _gathered(call.args[0], call.args[1])
            elif inspect.iscoroutinefunction(fn):
                value = await fn(*call.args, **call.kwargs)
            else:
                value = await offload(fn, *call.args, **call.kwargs)
        except BaseException as exc:  # noqa: BLE001 (thrown into the step, where it belongs)
            error, value = exc, None


async def _gathered(items: Iterable[Steps[Any]], concurrency: int) -> list[Any]:
    """:func:`fan` on the async face: each of ``items`` run by :func:`arun` in a task of
    its own (a copy of the caller's context: its deadline), at most ``concurrency`` at
    once, with :func:`dedupstore.calls.fan_out`'s rules. Cancelled, it cancels its tasks
    and waits for them before it raises."""
    iterator = iter(items)
    running: dict[asyncio.Task[Any], int] = {}
    results: dict[int, Any] = {}
    errors: dict[int, BaseException] = {}

    def settle(finished: Iterable[asyncio.Task[Any]]) -> None:
        for task in finished:
            index = running.pop(task)
            if task.cancelled():
                errors[index] = asyncio.CancelledError()
            elif (error := task.exception()) is not None:
                errors[index] = error
            else:
                results[index] = task.result()

    try:
        index = 0
        while not errors:
            while len(running) >= concurrency:
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                settle(done)
            if errors:
                break
            try:
                steps = next(iterator)
            except StopIteration:
                break
            except BaseException as exc:  # noqa: BLE001 (drawing an item: raised in order)
                errors[index] = exc
                break
            running[asyncio.ensure_future(arun(steps))] = index
            index += 1
        if running:  # every item started: wait for them here, where a cancellation
            await asyncio.wait(running)  # reaches them (the finally only waits)
    except asyncio.CancelledError:
        for task in running:
            task.cancel()
        raise
    finally:  # every started one waited for, however often this task is cancelled
        if running:
            await _finished(asyncio.gather(*running, return_exceptions=True))
            settle(list(running))
    if errors:
        raise errors[min(errors)]
    return [results[i] for i in sorted(results)]


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
    threads in a copy of the caller's context (its deadline): ``offload_to`` the
    async face's shared pool."""
    return await offload_to(_executor(), fn, *args, **kwargs)


async def offload_to(
    executor: ThreadPoolExecutor, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs
) -> R:
    """``fn(*args, **kwargs)``, a blocking call, run in one of ``executor``'s threads
    (the shared pool, or a connection's own: ``Connection.offload_threads``) in a copy
    of the caller's context (its deadline).

    Cancelled while the call runs, it waits for the call to end (bounded by the
    call's own deadline: a store call has one) before it raises ``CancelledError``:
    a thread cannot be stopped, and a write left running behind a cancelled task
    could land after the retry that should have found it. So a cancelled task
    leaves what a process stopped between two calls leaves, which the algorithm
    repairs on redelivery."""
    loop = asyncio.get_running_loop()
    context = contextvars.copy_context()
    future = loop.run_in_executor(executor, lambda: context.run(_blocking, fn, args, kwargs))
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        await _finished(future)
        raise


def _blocking(fn: Callable[..., R], args: tuple[Any, ...], kwargs: dict[str, Any]) -> R:
    """``fn(*args, **kwargs)`` in an offload thread's context: on the sync face."""
    _ASYNC_FACE.set(False)
    return fn(*args, **kwargs)


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
