"""The demo's injected faults: a dispatcher that fails on purpose, one killed worker.

Apart from the job (:mod:`dedupstore.spark.order_pipeline`) so that the tasks import
it: the job may run as ``__main__``, whose functions Spark ships by value, with fresh
module state in every task.
"""

from __future__ import annotations

import functools
import logging
import os
import zlib
from collections import Counter
from dataclasses import dataclass
from typing import Any

import dedupstore
from dedupstore.entities import OutgoingMessage

from .orders import POISON_SKU

__all__ = ["FlakyDispatcher", "InjectedFailure", "injected_faults"]


class InjectedFailure(RuntimeError):
    """A failure the demo injects on purpose."""


@dataclass(frozen=True)
class FlakyDispatcher:
    """Dispatches through ``url``, failing on purpose on the first attempt of some batches.

    Per batch (keyed by its first message id): with probability ``fail`` the
    dispatch fails before sending; with ``crash`` it sends and then fails (a crash
    after dispatch, before the clean-up). With ``kill_marker``, the first batch sent
    in the run then ends its Python worker with ``os._exit``: exactly one kill per
    run (the marker file records it). With ``faults``, each injected failure appends
    its kind (``refused`` or ``crashed``) as a line to that file (local masters: the
    workers share the driver's disk). The report counts both; the worker drops the
    WARNING lines the library logs about them and about dead-lettered poison.
    Picklable; opens its dispatcher in the task.
    """

    url: str
    fail: float = 0.05
    crash: float = 0.05
    kill_marker: str | None = None
    seed: int = 0
    faults: str | None = None

    def __call__(self, messages: list[OutgoingMessage]) -> None:
        """Dispatch ``messages``, or fail as decided for their batch."""
        _quiet_injected_faults()
        key = messages[0].id if messages else ""
        roll = (zlib.crc32(f"{self.seed}:{key}".encode()) % 10_000) / 10_000
        first = key not in _attempted
        _attempted.add(key)
        if first and roll < self.fail:
            self._record("refused")
            raise InjectedFailure("injected: the broker refused the dispatch")
        _dispatcher(self.url).dispatch(messages)
        if self.kill_marker and _claim(self.kill_marker):
            os._exit(3)  # a real crash: Spark sees the worker die and retries the task
        if first and roll < self.fail + self.crash:
            self._record("crashed")
            raise InjectedFailure("injected: crash after dispatch, before the clean-up")

    def _record(self, kind: str) -> None:
        """Append ``kind`` to the :attr:`faults` file (one short write: atomic)."""
        if self.faults:
            with open(self.faults, "a", encoding="utf-8") as faults:
                faults.write(f"{kind}\n")


def injected_faults(path: str) -> dict[str, int]:
    """The faults a :class:`FlakyDispatcher` recorded in ``path``, counted by kind."""
    counts = Counter({"refused": 0, "crashed": 0})
    if os.path.exists(path):
        with open(path, encoding="utf-8") as lines:
            counts.update(line.strip() for line in lines)
    return dict(counts)


class _InjectedFaults(logging.Filter):
    """Drops the records about the demo's injected faults: a failure of the type
    :class:`InjectedFailure`, or the dead letter of a poison message (its sku)."""

    poison = f"unknown sku {POISON_SKU!r}"

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return InjectedFailure.__name__ not in text and self.poison not in text


#: The batches (their first message id) this worker process dispatched or tried to.
_attempted: set[str] = set()


@functools.cache
def _quiet_injected_faults() -> None:
    """In this (worker) process, once: the injected faults' records dropped from the
    loggers that report them, the processor's and the Spark job's."""
    for name in ("dedupstore.outbox", "dedupstore.spark.pipeline"):
        logging.getLogger(name).addFilter(_InjectedFaults())


@functools.cache
def _dispatcher(url: str) -> Any:
    return dedupstore.open_dispatcher(url)


def _claim(path: str) -> bool:
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True
