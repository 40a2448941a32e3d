"""Operating token mode: the orphan report and the deliberate replay.

* :func:`orphan_tokens` lists the tokens older than a threshold that nothing the library
  can see still names: no outbox entry of the given entity stores (the sender's
  entries record the tokens they mint, the receiver's the token they consume) and no
  dead letter of the given queues (a letter keeps its redrive token). They are
  *candidates*: a message in a broker's queue, or a letter in a destination not given,
  names its token too, and only the operator can look there. It never deletes.
* :func:`mint_again` creates once more the tokens of messages that were consumed, for
  a deliberate replay of them: **a replayed message is applied again**. It plans by
  default and writes only when confirmed; a token that still exists is refused.

``dedupstore tokens orphans | delete | mint`` run them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator, Mapping
from datetime import timedelta
from typing import NamedTuple

from dedupstore.dead_letters import DeadLetterQueue, redrive_token
from dedupstore.entities import Entity, EntityStore
from dedupstore.errors import ConfigurationError, TokenPresent
from dedupstore.ids import validate_message_id
from dedupstore.tokens import TokenRecord, TokenStore, token_id, validate_nonce

__all__ = ["Replay", "listed_tokens", "mint_again", "orphan_tokens"]


def listed_tokens(entity: Entity) -> set[str]:
    """The ids of every token the outbox entries of ``entity`` name: the incoming token
    of each entry, the tokens of every nonce a pending entry registered (made or not),
    the garbage a dispatched entry keeps to delete, and a dead-lettered entry's redrive
    token. No I/O."""
    from dedupstore.outbox.tokened import minted

    ids: set[str] = set()
    for mid, entry in entity.tokens.items():
        if entry.incoming is not None:
            ids.add(entry.incoming)
        if entry.letter is not None:
            ids.add(entry.letter)
        ids.update(entry.drop)
        if entity.outbox.get(mid) is not None:
            for nonce in entry.registered:
                ids.update(minted(entity, mid, nonce))
    return ids


def _seconds(older_than: object) -> float:
    if isinstance(older_than, timedelta):
        seconds = older_than.total_seconds()
    elif isinstance(older_than, int | float) and not isinstance(older_than, bool):
        seconds = float(older_than)
    else:
        raise ConfigurationError(
            f"older_than must be a duration (seconds or a timedelta), got {older_than!r:.80}"
        )
    if not (math.isfinite(seconds) and seconds > 0):
        raise ConfigurationError(
            f"older_than must be a positive, finite duration, got {older_than!r:.80}: a token "
            "younger than the report itself may belong to an entry written while it runs"
        )
    return seconds


def orphan_tokens(
    tokens: TokenStore,
    entities: Iterable[EntityStore] = (),
    *,
    older_than: float | timedelta,
    letters: Iterable[DeadLetterQueue] = (),
    endpoint: str | None = None,
    now: float | None = None,
) -> Iterator[TokenRecord]:
    """The tokens minted more than ``older_than`` (seconds or a timedelta, positive) before
    ``now`` (default: this machine's clock) that no outbox entry of ``entities`` and no
    dead letter of ``letters`` names (only those of ``endpoint``, when given).

    Reads, in order: every non-empty outbox of each entity store (the ids it names are
    held in memory: the entries in flight), every letter of each queue, then the tokens
    a page at a time (:meth:`~dedupstore.tokens.TokenStore.scan`), yielding the orphans as
    it goes. An entry written while it runs names tokens minted after the report began, which the
    threshold leaves out. The result is a list of candidates, never a verdict: a message
    still in a broker's queue (or a letter in a destination not given) keeps its token
    too. Nothing is written.

    Raises ``ConfigurationError`` (a bad threshold or argument) and ``InvalidMessageId``
    (a bad endpoint) at the call, before any I/O; ``StoreUnavailable`` while iterating.
    """
    if not isinstance(tokens, TokenStore):
        raise ConfigurationError(f"tokens must be a TokenStore, got {type(tokens).__name__}")
    stores = list(entities)
    queues = list(letters)
    for store in stores:
        if not isinstance(store, EntityStore):
            raise ConfigurationError(f"entities must be entity stores, got {type(store).__name__}")
    for queue in queues:
        if not isinstance(queue, DeadLetterQueue):
            raise ConfigurationError(
                f"letters must be DeadLetterQueue objects, got {type(queue).__name__}"
            )
    seconds = _seconds(older_than)
    if endpoint is not None:
        endpoint = validate_message_id(endpoint, "endpoint")
    if now is not None and not (
        isinstance(now, int | float) and not isinstance(now, bool) and math.isfinite(now)
    ):
        raise ConfigurationError(f"now must be epoch seconds, got {now!r:.80}")
    started = time.time() if now is None else float(now)
    tokens.check_open()
    return _orphans(tokens, stores, queues, started - seconds, endpoint)


def _orphans(
    tokens: TokenStore,
    stores: list[EntityStore],
    queues: list[DeadLetterQueue],
    cutoff: float,
    endpoint: str | None,
) -> Iterator[TokenRecord]:
    named: set[str] = set()
    for store in stores:
        for entity in store.pending_outboxes():
            named |= listed_tokens(entity)
    for queue in queues:
        for letter in queue.list():
            token = redrive_token(letter)
            if token is not None:
                named.add(token.id)
    for record in tokens.scan(endpoint=endpoint, created_before=cutoff):
        if record.id not in named:
            yield record


class Replay(NamedTuple):
    """One token of :func:`mint_again`: the message it lets ``endpoint`` process again,
    the ``nonce`` it carries (its ``dedupstore-token`` header) and the token's id."""

    message_id: str
    nonce: str
    token_id: str
    endpoint: str


def mint_again(
    tokens: TokenStore,
    endpoint: str,
    messages: Mapping[str, str] | Iterable[tuple[str, str]],
    *,
    confirm: bool = False,
) -> list[Replay]:
    """Create again the tokens that let ``endpoint`` process ``messages`` (message id ->
    the nonce of its ``dedupstore-token`` header, or ``(id, nonce)`` pairs): for a
    deliberate replay of consumed input.

    **Danger: a replayed message is applied again.** Token mode drops a copy of a
    consumed message however late it comes; minting its token again lets exactly one
    more delivery of it (with that header) through, and its effects happen twice. Mint
    only for messages whose first processing you mean to repeat (or undid), and only
    after their receiver's clean-up (a receiver's deferred entry still awaiting the
    sweep has the same token to delete).

    Without ``confirm`` it is a dry run: it reads which tokens exist and returns the
    plan, writing nothing. With it, it creates the tokens (create-if-absent, durable
    when it returns). Either way a token that exists raises ``TokenPresent`` naming
    its messages, before anything is written (that message was never consumed: nothing
    to replay). Raises ``InvalidMessageId`` (a bad id, endpoint or nonce) and
    ``ConfigurationError`` (no message, a bad argument) before any I/O;
    ``StoreUnavailable``, ``StoreClosed``.
    """
    if not isinstance(tokens, TokenStore):
        raise ConfigurationError(f"tokens must be a TokenStore, got {type(tokens).__name__}")
    if not isinstance(confirm, bool):
        raise ConfigurationError(f"confirm must be True or False, got {confirm!r:.80}")
    endpoint = validate_message_id(endpoint, "endpoint")
    if isinstance(messages, str | bytes):
        raise ConfigurationError(
            "messages must map message ids to nonces (or be (id, nonce) pairs), got a "
            f"single {type(messages).__name__}"
        )
    pairs = messages.items() if isinstance(messages, Mapping) else messages
    plan: dict[str, Replay] = {}
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise ConfigurationError(f"expected (message id, nonce) pairs, got {pair!r:.80}")
        mid = validate_message_id(pair[0])
        nonce = validate_nonce(pair[1], mid)
        tid = token_id(mid, endpoint, nonce)
        plan.setdefault(tid, Replay(mid, nonce, tid, endpoint))
    if not plan:
        raise ConfigurationError("no message to mint a token for")
    present = tokens.present_among(list(plan))
    if present:
        found = [plan[tid] for tid in plan if tid in present]
        named = ", ".join(f"{r.message_id!r:.80} (nonce {r.nonce})" for r in found[:5])
        more = f" and {len(found) - 5} more" if len(found) > 5 else ""
        raise TokenPresent(
            f"the token of message {named}{more} for endpoint {endpoint!r:.80} exists: the "
            "message was not consumed yet, so there is nothing to replay; nothing was minted",
            message_ids=[r.message_id for r in found],
            token_ids=[r.token_id for r in found],
        )
    if confirm:
        tokens.create({tid: endpoint for tid in plan})
    return list(plan.values())
