"""The public API for writing a backend: everything a backend of dedupstore may use.

A backend imports from the core only this module (``tests/test_backend_api.py`` checks
the built-in ones): no name starting with ``_``, and no private member of the core's
classes but the :data:`HOOKS` it implements. ``docs/backend-api.md`` writes a backend
from it. The names, by group:

Bases
    :class:`Client`, :class:`Connection`, :class:`Connected`, :class:`Closing`,
    :class:`DeduplicationStore` with :class:`WriteRequest`, :class:`TokenStore` with
    :class:`TokenRecord`, :class:`TokenCount`, :class:`TokenWrites` and
    :func:`count_tokens`,
    :class:`EntityStore` with
    :class:`EntityRecord`, :class:`OutgoingMessage` and :func:`groups_by_size`,
    :class:`URLDispatcher` with :class:`EncodedMessage`, :class:`StoredMessage`,
    :class:`DispatchStats` and :class:`ReadMessage`, :class:`Broker` with
    :class:`Delivery`, :class:`AsyncBroker`; :data:`HOOKS`.
    A client's members for backends: ``store_url``,
    ``options``, ``connection``, ``made_connection``, ``creates``, ``check_open()``,
    ``translating_errors()``, ``make_error()``, ``describe_error()``,
    ``no_such_store()``, ``scrub()``; a store's ``endpoint``, ``retention``; an entity
    store's ``joins`` and ``token_joins``.
Options
    :class:`Option`, :class:`OptionSet`, :class:`Options`, :func:`boolean`,
    :func:`integer`, :func:`seconds`, :func:`text`, :func:`choice`, :func:`optional`,
    :func:`anything`, :func:`parse_duration`, :func:`format_duration`,
    :func:`timeout_option`, :func:`connect_timeout_option`, :func:`retries_option`,
    :func:`create_option`, :func:`client_option`, :data:`CLOCK`, :data:`MAX_CLOCK_SKEW`,
    :data:`MUST_EXIST`, :func:`creates`, :func:`check_client`, :class:`StoreURL`.
Connections, deadlines and retries
    :class:`ProcessLocal`, :func:`quiet_driver_logs`, :func:`part_of`, :func:`deadline`,
    :func:`time_left`, :func:`capped`, :class:`DeadlinePassed`, :func:`retry`,
    :func:`aretry`,
    :data:`BACKOFF`, :func:`pause_before`, :func:`fan_out`, :func:`executor`,
    :func:`cut_short`.
Steps (one driver logic for the sync and the async face, :mod:`dedupstore.steps`)
    :data:`Steps`, :func:`io`, :func:`fan`, :func:`run`, :func:`arun`.
Errors and masking
    :data:`ErrorKind`, :class:`DedupStoreError`, :class:`StoreUnavailable`,
    :class:`ConfigurationError`, :class:`ConsistencyError`, :class:`StoreClosed`,
    :class:`InvalidMessageId`, :class:`InvalidValue`, :class:`EntityTooLarge`,
    :class:`MessageTooLarge`, :class:`ConcurrencyConflict`, :func:`format_error`,
    :func:`scrub`, :func:`mask_url`, :func:`mask_text`, :func:`mask_options`,
    :func:`is_secret`, :data:`SECRET_NAMES`, :data:`MASK`.
Identity
    :func:`write_token`, :func:`message_key`, :func:`outgoing_id`,
    :func:`validate_message_id`, :data:`MAX_ID_BYTES`, :func:`encode_entity`,
    :func:`decode_entity`, :func:`canonical_json`, :func:`dumps`, :func:`loads`.
Contract kit (needs pytest; imported on first use)
    :class:`DeduplicationStoreContract`, :class:`MultiProcessContract`,
    :class:`TokenStoreContract`,
    :class:`EntityStoreContract`, :class:`JointTokenContract`, :class:`FakeClock`,
    :class:`Timeline`,
    :data:`StoreFactory`, :data:`INVALID_IDS`, :data:`HOSTILE_IDS`,
    :func:`random_valid_ids`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Final

from dedupstore.calls import (
    BACKOFF,
    DeadlinePassed,
    aretry,
    capped,
    deadline,
    executor,
    fan_out,
    pause_before,
    retry,
    time_left,
    write_token,
)
from dedupstore.canonical import dumps, loads
from dedupstore.client import (
    MUST_EXIST,
    Client,
    Closing,
    Connected,
    Connection,
    ErrorKind,
    ProcessLocal,
    check_client,
    creates,
    part_of,
    quiet_driver_logs,
)
from dedupstore.consumers import AsyncBroker, Broker, Delivery
from dedupstore.dead_letters import ReadMessage
from dedupstore.dispatch import DispatchStats, EncodedMessage, StoredMessage, URLDispatcher
from dedupstore.entities import (
    EntityRecord,
    EntityStore,
    OutgoingMessage,
    canonical_json,
    decode_entity,
    encode_entity,
    groups_by_size,
)
from dedupstore.errors import (
    ConcurrencyConflict,
    ConfigurationError,
    ConsistencyError,
    DedupStoreError,
    EntityTooLarge,
    InvalidMessageId,
    InvalidValue,
    MessageTooLarge,
    StoreClosed,
    StoreUnavailable,
    format_error,
)
from dedupstore.ids import MAX_ID_BYTES, message_key, outgoing_id, validate_message_id
from dedupstore.masking import (
    MASK,
    SECRET_NAMES,
    is_secret,
    mask_options,
    mask_text,
    mask_url,
    scrub,
)
from dedupstore.options import (
    Option,
    Options,
    OptionSet,
    anything,
    boolean,
    choice,
    client_option,
    connect_timeout_option,
    create_option,
    format_duration,
    integer,
    optional,
    parse_duration,
    retries_option,
    seconds,
    text,
    timeout_option,
)
from dedupstore.replies import cut_short
from dedupstore.steps import Steps, arun, fan, io, run
from dedupstore.store import CLOCK, MAX_CLOCK_SKEW, DeduplicationStore, WriteRequest
from dedupstore.tokens import TokenCount, TokenRecord, TokenStore, TokenWrites, count_tokens
from dedupstore.urls import StoreURL

if TYPE_CHECKING:
    from dedupstore.testing import (
        HOSTILE_IDS,
        INVALID_IDS,
        DeduplicationStoreContract,
        FakeClock,
        MultiProcessContract,
        StoreFactory,
        Timeline,
        TokenStoreContract,
        random_valid_ids,
    )
    from dedupstore.testing.entities import EntityStoreContract, JointTokenContract

#: The underscore methods of the bases that a backend implements or extends (calling
#: ``super()`` where the base has a body); the base calls them, users never do.
HOOKS: Final[frozenset[str]] = frozenset(
    {
        # Client
        "_validate",
        "_configure",
        "_open",
        "_close",
        "_classify_error",
        "_health_warnings",
        "_deadline_seconds",
        # DeduplicationStore
        "_add_new",
        "_add_one",
        "_find",
        "_contains_one",
        "_count",
        "_endpoints",
        "_purge",
        # TokenStore
        "_create",
        "_present",
        "_delete",
        "_outstanding",
        # EntityStore
        "_load",
        "_save",
        "_scan",
        "_load_with",
        "_save_with",
        "_save_unless",
        "_joint_record",
        "_load_with_token",
        "_save_tokens",
        # URLDispatcher
        "_dispatch",
    }
)

#: The contract kit's names, imported from :mod:`dedupstore.testing` on first use.
_CONTRACT_KIT: Final[dict[str, str]] = {
    "DeduplicationStoreContract": "dedupstore.testing",
    "MultiProcessContract": "dedupstore.testing",
    "FakeClock": "dedupstore.testing",
    "Timeline": "dedupstore.testing",
    "StoreFactory": "dedupstore.testing",
    "INVALID_IDS": "dedupstore.testing",
    "HOSTILE_IDS": "dedupstore.testing",
    "random_valid_ids": "dedupstore.testing",
    "EntityStoreContract": "dedupstore.testing.entities",
    "JointTokenContract": "dedupstore.testing.entities",
    "TokenStoreContract": "dedupstore.testing",
}


def __getattr__(name: str) -> Any:
    """The contract kit, imported when first asked for (it needs pytest)."""
    module = _CONTRACT_KIT.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "BACKOFF",
    "CLOCK",
    "HOOKS",
    "HOSTILE_IDS",
    "INVALID_IDS",
    "MASK",
    "MAX_CLOCK_SKEW",
    "MAX_ID_BYTES",
    "MUST_EXIST",
    "SECRET_NAMES",
    "AsyncBroker",
    "Broker",
    "Client",
    "Closing",
    "ConcurrencyConflict",
    "ConfigurationError",
    "Connected",
    "Connection",
    "ConsistencyError",
    "DeadlinePassed",
    "DedupStoreError",
    "DeduplicationStore",
    "DeduplicationStoreContract",
    "Delivery",
    "DispatchStats",
    "EncodedMessage",
    "EntityRecord",
    "EntityStore",
    "EntityStoreContract",
    "EntityTooLarge",
    "ErrorKind",
    "FakeClock",
    "InvalidMessageId",
    "InvalidValue",
    "JointTokenContract",
    "MessageTooLarge",
    "MultiProcessContract",
    "Option",
    "OptionSet",
    "Options",
    "OutgoingMessage",
    "ProcessLocal",
    "ReadMessage",
    "Steps",
    "StoreClosed",
    "StoreFactory",
    "StoreURL",
    "StoreUnavailable",
    "StoredMessage",
    "Timeline",
    "TokenCount",
    "TokenRecord",
    "TokenStore",
    "TokenStoreContract",
    "TokenWrites",
    "URLDispatcher",
    "WriteRequest",
    "anything",
    "aretry",
    "arun",
    "boolean",
    "canonical_json",
    "capped",
    "check_client",
    "choice",
    "client_option",
    "connect_timeout_option",
    "count_tokens",
    "create_option",
    "creates",
    "cut_short",
    "deadline",
    "decode_entity",
    "dumps",
    "encode_entity",
    "executor",
    "fan",
    "fan_out",
    "format_duration",
    "format_error",
    "groups_by_size",
    "integer",
    "io",
    "is_secret",
    "loads",
    "mask_options",
    "mask_text",
    "mask_url",
    "message_key",
    "optional",
    "outgoing_id",
    "parse_duration",
    "part_of",
    "pause_before",
    "quiet_driver_logs",
    "random_valid_ids",
    "retries_option",
    "retry",
    "run",
    "scrub",
    "seconds",
    "text",
    "time_left",
    "timeout_option",
    "validate_message_id",
    "write_token",
]
