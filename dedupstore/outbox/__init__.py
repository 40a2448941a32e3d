"""The improving-outbox algorithm: :class:`OutboxProcessor` and :func:`sweep`.

Every name below is imported from here. The modules, one responsibility each:
``processor`` (the class, the steps for one message), ``batch`` (its batches),
``handlers`` (the handler's check and runs), ``letters`` (dead letters, redrive),
``messages`` (what the processor takes and gives, the size rules), ``entries`` (outbox
entries and their dispatch), ``cache`` (the entities a processor keeps), ``sweep``
(:func:`sweep`, :func:`applied_among`, :func:`recorded_among`, :func:`recorded_consumer`).
"""

from __future__ import annotations

from dedupstore.ids import message_key, outgoing_id
from dedupstore.outbox.handlers import check_handler
from dedupstore.outbox.letters import LETTER_ERROR_CHARS, bounded_letter, omitted
from dedupstore.outbox.messages import (
    BeforeCleanup,
    Dispatcher,
    Handler,
    InMemoryDispatcher,
    Message,
    Outcome,
    ProcessResult,
    Send,
    check_size,
    message_size,
)
from dedupstore.outbox.processor import OutboxProcessor
from dedupstore.outbox.sweep import (
    SweepResult,
    applied_among,
    recorded_among,
    recorded_consumer,
    sweep,
)

__all__ = [
    "LETTER_ERROR_CHARS",
    "BeforeCleanup",
    "Dispatcher",
    "Handler",
    "InMemoryDispatcher",
    "Message",
    "OutboxProcessor",
    "Outcome",
    "ProcessResult",
    "Send",
    "SweepResult",
    "applied_among",
    "bounded_letter",
    "check_handler",
    "check_size",
    "message_key",
    "message_size",
    "omitted",
    "outgoing_id",
    "recorded_among",
    "recorded_consumer",
    "sweep",
]
