"""Exhaustive interleaving and crash tests of the improving outbox, on any backend.

Every call an actor (a consumer running :meth:`OutboxProcessor.process` or
:meth:`~OutboxProcessor.process_batch`, or a :func:`sweep`) makes to the entity
store, the deduplication store or the dispatcher is a *step*. Each actor runs in
its own thread, but a step only runs when the scheduler gives that actor its
turn, so one run follows exactly one ordering of all the steps, on the real
backend. :func:`explore` runs EVERY ordering (depth-first over the choices,
re-running the scenario from the start for each one), optionally with a crash
injected into one actor (before its first step, or after any one), and after each
run redelivers every message, sweeps, and checks the invariants. The per-step
checks look at each state once: the first run to reach it (a later run replays
the steps before its new choice, and the explorer verifies that it does):

``once``
    no message changes the state twice (at every step, and at the end exactly once);
``in-outbox-or-store``
    a message whose change was saved is, at every step, in its entity's outbox or
    in the deduplication store (otherwise a redelivery would apply it again);
``ghost``
    an outgoing message is dispatched only after the state change that produced it
    was saved;
``same-output``
    each logical output has one id, and every dispatch of an id carries the same
    bytes; after redelivery each expected output was dispatched at least once;
``right-state``
    each output shows the state its message produced;
``settled``
    after redelivery and a sweep: every message applied, its id in the
    deduplication store, the outbox empty, no run of a message left recorded
    (``Entity.attempts``; the redelivery goes to a consumer of the run that did not
    crash, as it consumes and with the entities it kept, if there is one);
``honest-result``
    at most one call reports ``"processed"`` for a message.

In token mode (``Scenario.tokens``: every message carries a token, or every other
one: a hybrid endpoint), ``in-outbox-or-store`` reads "in its entity's outbox, or its
token gone" for a message with a token, and ``settled`` also requires every token of
the run gone (the incoming ones consumed, garbage deleted) and nothing of the
tokened messages in the deduplication store. Outgoing messages go to two
subscribed receivers that consume their tokens as the message is dispatched, so:

``token-before-dispatch``
    each subscribed message carries the nonce of its tokens, and its first dispatch
    finds each receiver's token present (else that receiver would drop it);
``recreated``
    no token a receiver consumed exists again (a redelivery to it would be applied
    twice).

A violation raises :class:`InterleavingViolation` naming the invariant and the
schedule, so a broken processor variant is reported, not just failed.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import queue
import threading
import uuid
from collections.abc import Callable, Coroutine, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from dedupstore import aio
from dedupstore import tokens as tokens_module
from dedupstore.entities import Entity, EntityStore, OutgoingMessage
from dedupstore.outbox import (
    InMemoryDispatcher,
    Message,
    OutboxProcessor,
    ProcessResult,
    Send,
    SweepResult,
    message_key,
    outgoing_id,
    sweep,
)
from dedupstore.outbox.tokened import _Outraced
from dedupstore.steps import Steps, io
from dedupstore.steps import call as call_as_steps
from dedupstore.store import DeduplicationStore
from dedupstore.tokens import TOKEN_HEADER, TokenStore, new_nonce

__all__ = [
    "Actor",
    "Crash",
    "CrashPoint",
    "Face",
    "InterleavingViolation",
    "OnLoop",
    "Run",
    "Scenario",
    "explore",
    "independent",
    "ledger_handler",
    "sweep_with",
]

_WAIT = 120.0  # seconds a step may take before the run is declared stuck


class Crash(Exception):
    """Injected: the actor's process dies here (the broker will redeliver)."""


class InterleavingViolation(AssertionError):
    """An invariant did not hold; ``invariant`` names it, ``schedule`` shows the steps."""

    def __init__(self, invariant: str, detail: str, schedule: Sequence[str]) -> None:
        self.invariant = invariant
        self.schedule = list(schedule)
        super().__init__(f"[{invariant}] {detail}\n  schedule: {' -> '.join(schedule)}")


def ledger_handler(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
    """The handler the harness runs: appends the message id to ``state["applied"]``.

    It sends one message showing the state it produced, and a second one when the
    entity had no change before (so outputs depend on the state).
    """
    applied = [*state.get("applied", []), message.id]
    sends = [Send("ledger", {"mid": message.id, "applied": applied})]
    if len(applied) == 1:
        sends.append(Send("welcome", {"mid": message.id, "first": True}))
    return {**state, "applied": applied}, sends


@dataclass(frozen=True)
class Actor:
    """One actor: ``kind`` is ``"process"`` (one message), ``"retry"`` (one message a
    consumer died holding, as the consume loop runs it: its run recorded with
    :meth:`~dedupstore.outbox.OutboxProcessor.begin_attempt`, then processed),
    ``"batch"`` or ``"sweep"``.

    ``messages`` index into the scenario's messages. ``after``: messages the actor's
    processor processed, alone, before the run starts, so it holds the entity it
    saved then (:class:`~dedupstore.outbox.OutboxProcessor`'s
    ``entity_cache``) when its message comes.
    """

    kind: Literal["process", "retry", "batch", "sweep"]
    messages: tuple[int, ...] = ()
    after: tuple[int, ...] = ()

    @property
    def label(self) -> str:
        """How the actor appears in a schedule."""
        if self.kind == "sweep":
            return "sweep"
        after = f" after {','.join(f'm{i}' for i in self.after)}" if self.after else ""
        return f"{self.kind}({','.join(f'm{i}' for i in self.messages)}{after})"


@dataclass(frozen=True)
class Scenario:
    """Actors run concurrently on ``message_count`` messages of one entity.

    ``earlier``: messages another consumer processed alone before the run, after
    the actors' ``after`` ones (so an entity an actor kept is stale when it starts).
    """

    actors: tuple[Actor, ...]
    message_count: int
    cleanup: Literal["inline", "deferred"] = "inline"
    earlier: tuple[int, ...] = ()
    #: ``"off"``: retention mode; ``"all"``: every message carries a token;
    #: ``"hybrid"``: the even-numbered ones do (the others come from outside).
    tokens: Literal["off", "all", "hybrid"] = "off"


@dataclass(frozen=True)
class CrashPoint:
    """Crash actor ``actor`` at its ``step``-th call, ``"before"`` or ``"after"`` it runs."""

    actor: int
    step: int
    when: Literal["before", "after"]


@dataclass
class Run:
    """What one schedule did (``blocked``: abandoned as equivalent to one already run)."""

    trace: list[str] = field(default_factory=list)
    results: dict[int, list[ProcessResult] | BaseException | None] = field(default_factory=dict)
    blocked: bool = False
    #: The crash point was reached (its actor made that many calls).
    crash_reached: bool = False


# What each call reads and writes: E the entities, D the deduplication store, X the
# dispatcher, V "a state the per-step checks look at" (so writes to E and D never
# commute with each other, and every state the checks see is still visited).
_ACCESS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "load": (frozenset("E"), frozenset()),
    "load_many": (frozenset("E"), frozenset()),
    "scan": (frozenset("E"), frozenset()),
    "save": (frozenset("E"), frozenset("EV")),
    "save_many": (frozenset("E"), frozenset("EV")),
    "has": (frozenset("D"), frozenset()),
    "processed_among": (frozenset("D"), frozenset()),
    "add": (frozenset("D"), frozenset("DV")),
    "add_many": (frozenset("D"), frozenset("DV")),
    # the ghost check reads the entity; the receivers consume their tokens
    "dispatch": (frozenset("ET"), frozenset("XT")),
    # the token store (T)
    "read_tokens": (frozenset("T"), frozenset()),
    "create_tokens": (frozenset("T"), frozenset("TV")),
    "delete_tokens": (frozenset("T"), frozenset("TV")),
    # the two stores of one server, in one request (EntityStore._joined)
    "load_and_check": (frozenset("ED"), frozenset()),
    "check_and_save": (frozenset("ED"), frozenset("EV")),
    "add_and_save": (frozenset("ED"), frozenset("EDV")),
    # the entity and token stores of one server (EntityStore._tokens_joined): a load
    # that reads a token after it; a save that may read a token, then create and
    # delete tokens
    "load_and_read": (frozenset("ET"), frozenset()),
    "save_tokened": (frozenset("ET"), frozenset("ETV")),
}


def independent(one: str, other: str) -> bool:
    """Whether two calls of different actors give the same result in either order."""
    r1, w1 = _ACCESS[one]
    r2, w2 = _ACCESS[other]
    return not (w1 & (r2 | w2)) and not (w2 & r1)


@dataclass
class _Node:
    """One step of the current path: who could go, who sleeps, who went already."""

    ready: dict[int, str]
    sleep: dict[int, str]
    chosen: int
    done: set[int] = field(default_factory=set)

    def child_sleep(self) -> dict[int, str]:
        """Sleepers after ``chosen``'s step: those whose next call commutes with it."""
        step = self.ready[self.chosen]
        asleep = {**self.sleep, **{actor: self.ready[actor] for actor in self.done}}
        return {a: op for a, op in asleep.items() if a != self.chosen and independent(op, step)}


class _Explorer:
    """Depth-first search over the schedules, with sleep sets.

    Each run re-executes the scenario from the start, replaying the path's choices
    and then taking the first actor that is not asleep. Two schedules that differ
    only in the order of commuting calls are equivalent: one of them is run.
    """

    def __init__(self) -> None:
        self.path: list[_Node] = []
        self.finished = False
        #: The first position whose step this run has not made before: the steps ahead of it
        #: replay the previous run's (``choose`` checks that they do), so the states they
        #: reach were checked then.
        self.fresh_from = 0

    def choose(self, position: int, ready: dict[int, str]) -> int | None:
        """The actor that goes at ``position``; ``None`` when every ready actor sleeps."""
        if position < len(self.path):
            node = self.path[position]
            if node.ready != ready:
                raise RuntimeError(
                    f"replay diverged at step {position}: {ready} != {node.ready} "
                    "(is the backend or the handler nondeterministic?)"
                )
            return node.chosen
        sleep = self.path[-1].child_sleep() if self.path else {}
        awake = [actor for actor in sorted(ready) if actor not in sleep]
        if not awake:
            return None
        self.path.append(_Node(dict(ready), sleep, awake[0]))
        return awake[0]

    def backtrack(self) -> None:
        """Move to the next schedule; set :attr:`finished` when there is none."""
        while self.path:
            node = self.path[-1]
            node.done.add(node.chosen)
            rest = [a for a in sorted(node.ready) if a not in node.sleep and a not in node.done]
            if rest:
                node.chosen = rest[0]
                self.fresh_from = len(self.path) - 1
                return
            self.path.pop()
        self.finished = True


ProcessorFactory = Callable[..., Any]
#: Which face of the library the actors drive: ``OutboxProcessor`` and ``sweep`` in
#: the actor's thread, or ``AsyncOutboxProcessor`` and ``aio.sweep`` on an event loop of
#: its own (its store calls in the async face's threads).
Face = Literal["sync", "async"]


T = TypeVar("T")


class OnLoop:
    """An :class:`~dedupstore.aio.AsyncOutboxProcessor`, called as the sync one is: each
    call runs on the calling (actor's) thread's event loop, one per thread, made on
    first use and kept (a loop per call would cost more than the call)."""

    _loops = threading.local()

    def __init__(self, processor: aio.AsyncOutboxProcessor) -> None:
        self.processor = processor

    @property
    def _kept(self) -> Any:
        return self.processor._kept

    @_kept.setter
    def _kept(self, kept: Any) -> None:
        self.processor._kept = kept

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        loop: asyncio.AbstractEventLoop | None = getattr(self._loops, "loop", None)
        if loop is None or loop.is_closed():
            loop = self._loops.loop = asyncio.new_event_loop()
        return loop.run_until_complete(coroutine)

    @classmethod
    def close_loop(cls) -> None:
        """Close the calling thread's loop, if it made one."""
        loop = getattr(cls._loops, "loop", None)
        if loop is not None:
            cls._loops.loop = None
            # as asyncio.run() ends: what is left on the loop (an async twin's pool
            # workers) cancelled and waited for, then the loop closed
            left = asyncio.all_tasks(loop)
            for task in left:
                task.cancel()
            if left:
                loop.run_until_complete(_settled(left))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    def process(self, message: Message, handler: Any) -> ProcessResult:
        return self._run(self.processor.process(message, handler))

    def process_batch(
        self, messages: Sequence[Message], handler: Any, *, before_cleanup: Any = None
    ) -> list[ProcessResult]:
        return self._run(
            self.processor.process_batch(messages, handler, before_cleanup=before_cleanup)
        )

    def begin_attempt(self, message: Message) -> int:
        return self._run(self.processor.begin_attempt(message))


async def _settled(tasks: Iterable[asyncio.Task[Any]]) -> None:
    await asyncio.gather(*tasks, return_exceptions=True)


def _faced(processor: ProcessorFactory | None, face: Face) -> ProcessorFactory:
    """The factory of the actors' processors for ``face`` (``None``: the face's own)."""
    if face == "sync":
        return processor or OutboxProcessor
    made = processor or aio.AsyncOutboxProcessor

    def on_loop(*args: Any, **kwargs: Any) -> OnLoop:
        return OnLoop(made(*args, **kwargs))

    return on_loop


def sweep_with(face: Face, entities: Any, dedup: Any, tokens: Any = None) -> SweepResult:
    """One :func:`~dedupstore.outbox.sweep`, by ``face``."""
    if face == "sync":
        return sweep(entities, dedup, tokens=tokens)
    return asyncio.run(aio.sweep(entities, dedup, tokens=tokens))


Observer = Callable[[list[str]], None]


class _Turns:
    """Gives one actor at a time the right to make its next call. Hand-offs are direct: an
    actor tells the scheduler (a queue) that it asks for a turn or has finished, and waits on
    its own semaphore; the scheduler opens exactly the chosen one's (no thread wakes to go back
    to sleep)."""

    def __init__(self, actors: int, explorer: _Explorer, crash: CrashPoint | None) -> None:
        self.waiting: dict[int, str] = {}  # actor -> the call it waits to make
        self.steps = [0] * actors
        self.explorer = explorer
        self.position = 0
        self.crash = crash
        self.run = Run()
        self.aborted = False
        #: The step in its turn was not made by an earlier run (checks of a replayed step
        #: passed when that run made it).
        self.fresh = True
        self.told: queue.SimpleQueue[int] = queue.SimpleQueue()  # asked for a turn, or finished
        self.go = [threading.Semaphore(0) for _ in range(actors)]

    def call(self, actor: int, name: str, action: Callable[[], Any]) -> Any:
        """Wait for ``actor``'s turn, run ``action``; crash there if told to."""
        here = self.begin(actor, name)
        result = action()
        self.finish(actor, name, here)
        return result

    def begin(self, actor: int, name: str) -> bool:
        """Wait for ``actor``'s turn to make the call ``name``; crash before it if told
        to; whether the run crashes after it (:meth:`finish`)."""
        self.waiting[actor] = name
        self.told.put(actor)
        if not self.go[actor].acquire(timeout=_WAIT):
            raise TimeoutError(f"actor {actor} never got its turn for {name}")
        if self.aborted:
            raise Crash("the schedule was abandoned")
        step = self.steps[actor]
        self.steps[actor] += 1
        crash = self.crash
        here = crash is not None and crash.actor == actor and crash.step == step
        self.run.crash_reached = self.run.crash_reached or here
        if here and crash is not None and crash.when == "before":
            self.run.trace.append(f"{name}!crash-before")
            raise Crash(f"actor {actor} crashed before {name}")
        return here

    def finish(self, actor: int, name: str, here: bool) -> None:
        """The call ``name`` of ``actor``'s turn returned: crash after it if told to."""
        if here:
            self.run.trace.append(f"{name}!crash-after")
            raise Crash(f"actor {actor} crashed after {name}")

    def end_turn(self, actor: int) -> None:
        """``actor`` finished."""
        self.told.put(actor)

    def schedule(self, labels: Sequence[str], observe: Observer) -> Run:
        """Run the actors to the end, one step at a time; return the run."""
        try:
            return self._schedule(labels, observe)
        except BaseException:
            self._abandon()
            raise

    def _abandon(self) -> None:
        self.aborted = True
        for go in self.go:  # every actor waiting, or about to, ends with a Crash
            go.release()

    def _heard(self, what: str) -> None:
        try:
            self.told.get(timeout=_WAIT)
        except queue.Empty:
            raise TimeoutError(what) from None

    def _schedule(self, labels: Sequence[str], observe: Observer) -> Run:
        for _ in self.go:  # every actor asks for its first turn, or ends
            self._heard("an actor neither finished nor asked for a turn")
        while self.waiting:
            chosen = self.explorer.choose(self.position, dict(self.waiting))
            self.position += 1
            if chosen is None:
                self.run.blocked = True
                self._abandon()
                return self.run
            name = self.waiting.pop(chosen)
            self.run.trace.append(f"{labels[chosen]}.{name}")
            self.fresh = self.position > self.explorer.fresh_from
            self.go[chosen].release()
            self._heard(f"{labels[chosen]}.{name} did not return")  # its next call, or its end
            # only a write to a store can break a state check; a replayed one was checked
            if self.fresh and _ACCESS[name][1] - {"X"}:
                observe(self.run.trace)
        self.fresh = True
        return self.run


class _OneEntity:
    """An entity store whose scan sees only one entity (the others belong to other runs)."""

    def __init__(self, real: EntityStore, entity_id: str) -> None:
        self._real, self._entity_id = real, entity_id

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def pending_outboxes(self, segment: int = 0, segments: int = 1) -> Iterator[Entity]:
        return (
            e for e in self._real.pending_outboxes(segment, segments) if e.id == self._entity_id
        )


#: What the processor and the sweep call on each part: method -> its step (``None``:
#: no step, it asks nothing of the store). Any other method is refused, so no call
#: can run outside the scheduler.
_ENTITY_STEPS: dict[str, str | None] = {
    "load": "load",
    "load_many": "load_many",
    "save": "save",
    "save_many": "save_many",
    "pending_outboxes": "scan",
    "_joined": None,
    "_load_checked": "load_and_check",
    "_save_checked": "check_and_save",
    "_save_recording": "add_and_save",
    "_tokens_joined": None,
    "joint_token_limit": None,
    "_load_tokened": "load_and_read",
    "_save_tokened": "save_tokened",
}
_DEDUP_STEPS: dict[str, str | None] = {
    "has_been_processed": "has",
    "processed_among": "processed_among",
    "add": "add",
    "add_many": "add_many",
}
_DISPATCH_STEPS: dict[str, str | None] = {"dispatch": "dispatch"}
_TOKEN_STEPS: dict[str, str | None] = {
    "present_among": "read_tokens",
    "create": "create_tokens",
    "delete": "delete_tokens",
}


class _Turned:
    """A store or the dispatcher as one actor sees it: every call waits for the
    actor's turn (and gets the real stores where the actor passes its wrappers)."""

    def __init__(self, real: Any, turns: _Turns, actor: int, steps: dict[str, str | None]) -> None:
        self._real, self._turns, self._actor, self._steps = real, turns, actor, steps

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._real, name)
        if name not in self._steps:
            if callable(value):
                raise AttributeError(f"{name}() is not a step the harness schedules")
            return value  # an attribute: endpoint, max_entity_bytes
        step = self._steps[name]

        def call(*args: Any) -> Any:
            real = self._unwrapped(name, args)
            if step is None:
                return value(*real)
            # a scan's pages are read in its turn, not as the caller iterates
            return self._turns.call(self._actor, step, lambda: _whole(value(*real)))

        return call

    def _unwrapped(self, name: str, args: Sequence[Any]) -> list[Any]:
        """``args`` with the real stores for the actor's wrappers (tokens a joint save
        creates recorded)."""
        real = [arg._real if isinstance(arg, _Turned) else arg for arg in args]
        for i, arg in enumerate(real):
            if isinstance(arg, _Creating):  # the joint save: the real store, recorded
                if name == "_save_tokened":
                    arg.record(t for change in real[2].values() for t in change.create)
                real[i] = arg._real
        return real

    def call_steps(self, name: str, *args: Any) -> Steps[Any]:
        """``name(*args)`` as steps, for :func:`dedupstore.steps.call` on the async face:
        the actor's turn waited for in a thread (the wait blocks), then the real store's
        own steps run on the actor's loop (natively where the backend has an async
        driver), so the harness schedules the calls the async face really makes."""
        getattr(self, name)  # refused unless a scheduled step (AttributeError)
        step = self._steps[name]
        real = self._unwrapped(name, args)
        target = self._real
        if isinstance(target, _Creating):
            if name == "create":
                target.record(real[0])
            target = target._real
        elif isinstance(target, _OneEntity) and name != "pending_outboxes":
            target = target._real
        if step is None:
            return (yield from call_as_steps(target, name, *real))
        here = yield from io(self._turns.begin, self._actor, step)
        result = yield from call_as_steps(target, name, *real)
        self._turns.finish(self._actor, step, here)
        return result


def _whole(result: Any) -> Any:
    return iter(list(result)) if isinstance(result, Iterator) else result


class _Ledger(InMemoryDispatcher):
    """Records what was sent, and the saved state at that moment (for ``ghost``); in
    token mode, the subscribed receivers consume their tokens as it is sent."""

    def __init__(
        self,
        entities: EntityStore,
        entity_id: str,
        turns: _Turns,
        tokens: TokenStore | None = None,
        receivers: tuple[str, ...] = (),
    ) -> None:
        super().__init__()
        self._entities, self._entity_id, self._turns = entities, entity_id, turns
        self._tokens, self.receivers = tokens, receivers
        #: (receiver, token id) of the tokens the receivers consumed
        self.consumed: set[tuple[str, str]] = set()
        #: every token id an actor created (through its token store's steps)
        self.created: set[str] = set()

    def _consume(self, messages: Sequence[OutgoingMessage]) -> None:
        """The receivers take the subscribed messages: a token present is consumed (a
        state change, so replayed steps make it too); a first copy without one is lost."""
        tokens = self._tokens
        if tokens is None:
            return
        for message in messages:
            if message.destination != "ledger":
                continue
            nonce = message.headers.get(TOKEN_HEADER)
            if nonce is None:
                raise InterleavingViolation(
                    "token-before-dispatch",
                    f"{message.id} was dispatched without its tokens' nonce",
                    self._turns.run.trace,
                )
            for receiver in self.receivers:  # each on its own, as receivers do
                token = tokens_module.token_id(message.id, receiver, nonce)
                if (receiver, token) in self.consumed:
                    continue  # a copy: the receiver drops it
                if not tokens.present_among([token]):
                    if self._turns.fresh:
                        raise InterleavingViolation(
                            "token-before-dispatch",
                            f"{message.id} was dispatched, but receiver {receiver} found no "
                            "token for it (it would drop the message)",
                            self._turns.run.trace,
                        )
                    continue
                tokens.delete([token])
                self.consumed.add((receiver, token))

    def dispatch(self, messages: Sequence[OutgoingMessage]) -> None:
        if not self._turns.fresh:  # a replayed step: this check passed when it was made
            self._consume(messages)
            super().dispatch(messages)
            return
        self._consume(messages)
        saved = self._entities.load(self._entity_id).state.get("applied", [])
        for message in messages:
            if message.body["mid"] not in saved:
                raise InterleavingViolation(
                    "ghost",
                    f"{message.destination} output of {message.body['mid']!r} dispatched while "
                    f"the saved state has only {saved}",
                    self._turns.run.trace,
                )
        super().dispatch(messages)


class _Crew:
    """One long-lived thread per actor, for every run of an exploration (a thread started
    per run and actor cost a start, and each client's per-thread connection anew)."""

    def __init__(self, size: int) -> None:
        self._jobs: list[queue.SimpleQueue[Callable[[], None] | None]] = []
        self._ended: queue.SimpleQueue[int] = queue.SimpleQueue()
        for index in range(size):
            jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
            self._jobs.append(jobs)
            name = f"actor-{chr(65 + index)}"
            threading.Thread(target=self._work, args=(jobs,), daemon=True, name=name).start()

    def _work(self, jobs: queue.SimpleQueue[Callable[[], None] | None]) -> None:
        try:
            while (job := jobs.get()) is not None:
                try:
                    job()
                finally:
                    self._ended.put(0)
        finally:
            OnLoop.close_loop()

    def start(self, jobs: Sequence[Callable[[], None]]) -> None:
        """Give actor ``i`` the job ``jobs[i]``."""
        for queued, job in zip(self._jobs, jobs, strict=True):
            queued.put(job)

    def join(self) -> None:
        """Wait until every actor's job has returned."""
        for _ in self._jobs:
            try:
                self._ended.get(timeout=_WAIT)
            except queue.Empty:
                raise TimeoutError("an actor did not end after its schedule") from None

    def close(self) -> None:
        """End the threads."""
        for queued in self._jobs:
            queued.put(None)


@dataclass
class _World:
    """The real stores (one client per actor, plus the checker's) of one exploration,
    and the actors' threads."""

    entity_clients: list[EntityStore]
    dedup_clients: list[DeduplicationStore]
    crew: _Crew
    token_clients: list[TokenStore] = field(default_factory=list)


class _Creating:
    """A token store that adds to ``created`` every token id it creates (then creates it)."""

    def __init__(self, real: TokenStore, created: set[str]) -> None:
        self._real, self._created = real, created

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def create(self, tokens: Any) -> None:
        self.record(tokens)
        self._real.create(tokens)

    def record(self, token_ids: Iterable[str]) -> None:
        """Add ``token_ids`` to ``created`` (a joint save creates them)."""
        self._created.update(token_ids)


def _minted(scenario: Scenario, index: int) -> bool:
    """Whether message ``index`` carries a token in ``scenario``."""
    return scenario.tokens == "all" or (scenario.tokens == "hybrid" and index % 2 == 0)


def _run_once(
    scenario: Scenario,
    world: _World,
    processor: ProcessorFactory,
    explorer: _Explorer,
    crash: CrashPoint | None,
    face: Face = "sync",
) -> Run:
    """Run one schedule of ``scenario`` on fresh ids, then redeliver, sweep and check."""
    tag = uuid.uuid4().hex[:12]
    entity_id = f"ent-{tag}"
    checker_entities, checker_dedup = world.entity_clients[-1], world.dedup_clients[-1]
    checker_tokens = world.token_clients[-1] if world.token_clients else None
    endpoint = checker_dedup.endpoint
    messages = [Message(f"m{n}-{tag}", entity_id, n) for n in range(scenario.message_count)]
    incoming: dict[str, str] = {}  # message id -> its token id
    if checker_tokens is not None:
        for n, message in enumerate(messages):
            if _minted(scenario, n):
                nonce = new_nonce()
                messages[n] = Message(message.id, entity_id, n, {TOKEN_HEADER: nonce})
                incoming[message.id] = tokens_module.token_id(message.id, endpoint, nonce)
        if incoming:
            checker_tokens.create(dict.fromkeys(incoming.values(), endpoint))
    turns = _Turns(len(scenario.actors), explorer, crash)
    receivers = (f"r1-{tag}", f"r2-{tag}") if checker_tokens is not None else ()
    ledger = _Ledger(checker_entities, entity_id, turns, checker_tokens, receivers)
    labels = [f"{chr(65 + i)}:{a.label}" for i, a in enumerate(scenario.actors)]

    def options(index: int | None) -> dict[str, Any]:
        """The processor's token options (``index``: an actor's, through its steps)."""
        if checker_tokens is None:
            return {}
        client: Any = checker_tokens if index is None else world.token_clients[index]
        store: Any = _Creating(client, ledger.created)
        if index is not None:
            store = _Turned(store, turns, index, _TOKEN_STEPS)
        return {"tokens": store, "subscriptions": {"ledger": list(receivers)}}

    # what the actors' processors did before the run, alone: the entity each kept
    kept = {}
    survivors: dict[int, tuple[str, Any]] = {}  # each consumer's kind and kept entities
    for index, actor in enumerate(scenario.actors):
        if actor.after:
            before = processor(
                world.entity_clients[index],
                world.dedup_clients[index],
                ledger,
                cleanup=scenario.cleanup,
                **options(None),
            )
            for i in actor.after:
                before.process(messages[i], ledger_handler)
            kept[index] = before._kept
    if scenario.earlier:
        other = processor(
            checker_entities, checker_dedup, ledger, cleanup=scenario.cleanup, **options(None)
        )
        for i in scenario.earlier:
            other.process(messages[i], ledger_handler)

    def actor_main(index: int, actor: Actor) -> None:
        own = _OneEntity(world.entity_clients[index], entity_id)
        entities: Any = _Turned(own, turns, index, _ENTITY_STEPS)
        dedup: Any = _Turned(world.dedup_clients[index], turns, index, _DEDUP_STEPS)
        dispatcher: Any = _Turned(ledger, turns, index, _DISPATCH_STEPS)
        result: list[ProcessResult] | BaseException | None = None
        try:
            if actor.kind == "sweep":
                sweep_with(face, entities, dedup, options(index).get("tokens"))
            else:
                runner = processor(
                    entities, dedup, dispatcher, cleanup=scenario.cleanup, **options(index)
                )
                runner._kept = kept.get(index, runner._kept)
                survivors[index] = (actor.kind, runner._kept)
                chosen = [messages[i] for i in actor.messages]
                if actor.kind == "retry":
                    runner.begin_attempt(chosen[0])
                if actor.kind in ("process", "retry"):
                    result = [runner.process(chosen[0], ledger_handler)]
                else:
                    result = runner.process_batch(chosen, ledger_handler)
        except BaseException as exc:  # noqa: BLE001 - reported with the run
            result = exc
        finally:
            turns.run.results[index] = result
            turns.end_turn(index)

    def observe(trace: list[str]) -> None:
        entity = checker_entities.load(entity_id)
        applied = entity.state.get("applied", [])
        if len(applied) != len(set(applied)):
            raise InterleavingViolation("once", f"a message was applied twice: {applied}", trace)
        # only an applied id that left the outbox must be in the store (one question, or
        # none); or, for a message with a token, its token must be gone
        gone = {
            message_key(entity_id, mid): mid
            for mid in applied
            if mid not in entity.outbox and mid not in incoming
        }
        stored = {gone[k] for k in checker_dedup.processed_among(list(gone))} if gone else set()
        lost = [mid for mid in gone.values() if mid not in stored]
        if checker_tokens is not None:
            left = [incoming[m] for m in applied if m not in entity.outbox and m in incoming]
            if left:
                alive = checker_tokens.present_among(left)
                lost += [m for m in applied if incoming.get(m) in alive]
            back = [t for _, t in ledger.consumed]
            if back and checker_tokens.present_among(back):
                raise InterleavingViolation(
                    "recreated", "a token its receiver consumed exists again", trace
                )
        if lost:
            raise InterleavingViolation(
                "in-outbox-or-store",
                f"{lost} applied but neither in the outbox nor in the deduplication store "
                "(nor, with a token, its token gone)",
                trace,
            )

    world.crew.start([functools.partial(actor_main, i, a) for i, a in enumerate(scenario.actors)])
    run = turns.schedule(labels, observe)
    world.crew.join()
    if run.blocked:
        _retire(checker_entities, entity_id)
        if checker_tokens is not None:  # so that nothing of it is left in the store
            checker_tokens.delete({*incoming.values(), *ledger.created})
        return run
    for index, result in run.results.items():
        if isinstance(result, InterleavingViolation):
            raise result
        if isinstance(result, _Outraced):
            continue  # token mode: it gave way to another copy (redelivered below)
        if isinstance(result, BaseException) and not isinstance(result, Crash):
            raise InterleavingViolation(
                "no-error", f"{labels[index]} raised {result!r}", run.trace
            ) from result
    # the redelivery goes to a consumer that did not crash, with what it kept
    alive = [c for i, c in survivors.items() if not isinstance(run.results.get(i), Crash)]
    kind, cache = alive[0] if alive else ("process", None)
    _settle_and_check(
        scenario, world, processor, messages, ledger, run, kind, cache, incoming, options(None)
    )
    return run


def _retire(entities: EntityStore, entity_id: str) -> None:
    """Empty the outbox of an abandoned run's entity, so that scans (which see every
    pending entity of the store) do not grow with the number of runs."""
    entity = entities.load(entity_id)
    if entity.outbox:
        entity.outbox.clear()
        entity.marks.clear()
        entities.save(entity)


def _crashed_after_creating(trace: Sequence[str]) -> bool:
    """Whether an actor crashed after it created tokens (a crash is marked right after
    the crashing actor's step)."""
    for index, step in enumerate(trace):
        if "!crash" in step and index > 0:
            actor = trace[index - 1].split(".")[0]
            return f"{actor}.create_tokens" in trace[:index]
    return False


def _settle_and_check(
    scenario: Scenario,
    world: _World,
    processor: ProcessorFactory,
    messages: list[Message],
    ledger: _Ledger,
    run: Run,
    kind: str = "process",
    kept: Any = None,
    incoming: dict[str, str] | None = None,
    token_options: dict[str, Any] | None = None,
) -> None:
    """Redeliver every message (as a ``kind`` consumer: one by one, or in one
    batch; holding the entities ``kept``, if given: a kept entity must not hide an
    entry), sweep, and check the end state and every dispatch."""
    trace = run.trace
    claimed: dict[str, int] = {}
    for result in run.results.values():
        for item in result if isinstance(result, list) else ():
            if item.outcome == "processed":
                claimed[item.message_id] = claimed.get(item.message_id, 0) + 1
    twice = {mid: n for mid, n in claimed.items() if n > 1}
    if twice:
        raise InterleavingViolation("honest-result", f"reported processed twice: {twice}", trace)
    entities, dedup = world.entity_clients[-1], world.dedup_clients[-1]
    incoming = incoming or {}
    token_options = token_options or {}
    tokens: TokenStore | None = token_options.get("tokens")
    final = processor(entities, dedup, ledger, cleanup=scenario.cleanup, **token_options)
    if kept is not None:
        final._kept = kept
    if kind == "batch":
        final.process_batch(messages, ledger_handler)
    else:
        for message in messages:
            final.process(message, ledger_handler)
    sweep(_OneEntity(entities, messages[0].correlation_id), dedup, tokens=tokens)  # type: ignore[arg-type]
    entity = entities.load(messages[0].correlation_id)
    applied = entity.state.get("applied", [])
    ids = [m.id for m in messages]
    if sorted(applied) != sorted(ids):
        raise InterleavingViolation(
            "once", f"after redelivery the state applied {applied}, expected {ids} once each", trace
        )
    cid = messages[0].correlation_id
    keys = [message_key(cid, mid) for mid in ids if mid not in incoming]
    all_keys = [message_key(cid, mid) for mid in ids]
    if entity.outbox or entity.attempts or dedup.processed_among(all_keys) != set(keys):
        raise InterleavingViolation(
            "settled",
            f"after redelivery and a sweep the outbox is {sorted(entity.outbox)}, the runs "
            f"recorded {entity.attempts} and the store holds "
            f"{sorted(dedup.processed_among(all_keys))}, expected {keys}",
            trace,
        )
    if tokens is not None:
        left = tokens.present_among({*incoming.values(), *ledger.created})
        carried = {
            tokens_module.token_id(m.id, r, m.headers[TOKEN_HEADER])
            for m in ledger.sent
            if TOKEN_HEADER in m.headers
            for r in ledger.receivers
        }
        # The one window two stores cannot close: an actor overtaken by a copy that
        # made, dispatched and cleaned the entry up (deleting the tokens of the actor's
        # registered nonce, not created yet), then creating them and dying before it
        # deletes them. No message carries those: an orphan report finds them.
        if left and _crashed_after_creating(trace):
            left = left & ({*incoming.values()} | carried)
        if left:
            raise InterleavingViolation(
                "settled",
                f"after redelivery and a sweep {len(left)} token(s) of the run are left "
                f"(incoming: {sorted(m for m, t in incoming.items() if t in left)})",
                trace,
            )
    sent: dict[str, OutgoingMessage] = {}
    for out in ledger.sent:
        first = sent.setdefault(out.id, out)
        if first != out:
            raise InterleavingViolation(
                "same-output", f"{out.id} dispatched as {first} and as {out}", trace
            )
    expected: set[str] = set()
    for mid in ids:
        position = applied.index(mid)
        expected.add(outgoing_id(dedup.endpoint, cid, mid, 0))
        if position == 0:
            expected.add(outgoing_id(dedup.endpoint, cid, mid, 1))
        ledger_out = sent.get(outgoing_id(dedup.endpoint, cid, mid, 0))
        if ledger_out is not None and ledger_out.body["applied"] != applied[: position + 1]:
            raise InterleavingViolation(
                "right-state",
                f"the output of {mid} shows {ledger_out.body['applied']}, but that message "
                f"produced {applied[: position + 1]}",
                trace,
            )
    if set(sent) != expected:
        raise InterleavingViolation(
            "same-output",
            f"dispatched ids {sorted(set(sent) - expected)} unexpected, "
            f"{sorted(expected - set(sent))} never dispatched",
            trace,
        )


def explore(
    scenario: Scenario,
    entity_store: Callable[[], EntityStore],
    dedup_store: Callable[[], DeduplicationStore],
    *,
    processor: ProcessorFactory | None = None,
    crash_actor: int | None = None,
    limit: int | None = None,
    token_store: Callable[[], TokenStore] | None = None,
    face: Face = "sync",
) -> int:
    """Run every schedule of ``scenario``; return how many. Raises :class:`InterleavingViolation`.

    ``entity_store``/``dedup_store`` open a client of the backend under test (one
    per actor, one for the checks; each schedule uses fresh ids). With
    ``crash_actor``, every schedule is run once more for every gap between that
    actor's steps, crashing there: before its first step, then after each step.
    ``limit`` stops after that many schedules (for slow emulators; ``None``: all).
    ``token_store`` opens a client of the token store, for a scenario in token mode
    (``ValueError`` without one). ``face``: the actors drive ``OutboxProcessor``
    (``"sync"``) or :class:`~dedupstore.aio.AsyncOutboxProcessor` (``"async"``, each
    call on an event loop of its own); ``processor`` (a class of that face, default
    the face's own) makes them.
    """
    made = _faced(processor, face)
    if scenario.tokens != "off" and token_store is None:
        raise ValueError(f"a scenario with tokens={scenario.tokens!r} needs a token_store")
    size = len(scenario.actors) + 1
    world = _World(
        [entity_store() for _ in range(size)],
        [dedup_store() for _ in range(size)],
        _Crew(len(scenario.actors)),
        [token_store() for _ in range(size)] if scenario.tokens != "off" and token_store else [],
    )
    runs = 0
    try:
        crashes: Iterator[CrashPoint | None] = iter([None])
        if crash_actor is not None:
            # An actor does nothing the others can see between two of its calls, so a
            # crash before a call is a crash after the one before it: each gap between
            # calls is crashed in once (before the first call, then after each).
            crashes = itertools.chain(
                [CrashPoint(crash_actor, 0, "before")],
                (CrashPoint(crash_actor, step, "after") for step in range(10_000)),
            )
        for crash in crashes:
            fired = False
            explorer = _Explorer()
            while not explorer.finished:
                run = _run_once(scenario, world, made, explorer, crash, face)
                explorer.backtrack()
                fired = fired or run.crash_reached
                if run.blocked:
                    continue
                runs += 1
                if limit is not None and runs >= limit:
                    return runs
            if crash is not None and not fired:
                return runs  # the actor never makes this many steps: every crash was tried
        return runs
    finally:
        world.crew.close()
        for client in (*world.entity_clients, *world.dedup_clients, *world.token_clients):
            client.close()
