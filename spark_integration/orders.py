"""The demo's domain: orders, their handler, an at-least-once workload and its expected output.

Commands per order: one to four ``add_item`` then one ``submit``. The handler emits
``ItemAdded`` for every item, ``FirstItemAdded`` when an order gets its first item
(the event that a naive "just make it idempotent" consumer loses or doubles when a
dispatch fails and another add-item overtakes the retry), and ``OrderSubmitted``.
A workload may hold poison: an ``add_item`` whose sku is not in the catalogue
(:data:`POISON_SKU`), which the handler refuses by raising, so the processor sets it
aside as a dead letter.

:func:`expected_outgoing` computes the outgoing ids the pipeline must produce,
straight from the input and independently of every store.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from dedupstore.outbox import Message, Send, outgoing_id

__all__ = [
    "POISON_SKU",
    "PRICES",
    "Workload",
    "expected_outgoing",
    "handle_order",
    "is_poison",
    "make_workload",
]

PRICES = {f"sku-{n:03d}": 100 + 7 * n for n in range(50)}

#: The malformed sku of a poison ``add_item``: not in the catalogue.
POISON_SKU = "SKU #??"


def is_poison(command: Mapping[str, Any]) -> bool:
    """Whether the handler refuses ``command``: an ``add_item`` with a sku not in the catalogue."""
    return command["type"] == "add_item" and command["sku"] not in PRICES


def handle_order(state: dict[str, Any], message: Message) -> tuple[dict[str, Any], list[Send]]:
    """The order handler: pure, deterministic; records the message id it applied.

    An ``add_item`` naming a sku outside the catalogue raises ``ValueError`` (poison:
    with ``dead_letters`` the processor sets it aside, the order unchanged).
    """
    body = message.body
    if body["type"] == "add_item" and body["sku"] not in PRICES:
        raise ValueError(f"add_item names an unknown sku {body['sku']!r}")
    order = message.correlation_id
    headers = {"source": message.id, "order": order}
    state.setdefault("items", [])
    state.setdefault("applied", [])
    state["applied"].append(message.id)
    sends: list[Send] = []
    if body["type"] == "add_item":
        if state.get("submitted"):
            sends.append(Send("orders.rejected", {"order": order, "reason": "submitted"}, headers))
            return state, sends
        item = {"sku": body["sku"], "qty": body["qty"], "price": PRICES[body["sku"]]}
        state["items"].append(item)
        sends.append(Send("orders.item-added", {"order": order, **item}, headers))
        if len(state["items"]) == 1:
            sends.append(Send("marketing.first-item-added", {"order": order}, headers))
    elif body["type"] == "submit":
        if state.get("submitted") or not state["items"]:
            sends.append(Send("orders.rejected", {"order": order, "reason": "empty"}, headers))
            return state, sends
        state["submitted"] = True
        total = sum(i["qty"] * i["price"] for i in state["items"])
        sends.append(Send("orders.submitted", {"order": order, "total": total}, headers))
    else:
        raise ValueError(f"unknown command {body['type']!r}")
    return state, sends


@dataclass(frozen=True)
class Workload:
    """Rows as delivered (duplicates, reordering) and the commands behind them."""

    delivered: list[dict[str, Any]]
    commands: list[dict[str, Any]]


def make_workload(
    orders: int,
    *,
    duplicates: float = 0.2,
    reorder: float = 0.05,
    window: int = 50,
    seed: int = 7,
    poison: int = 0,
) -> Workload:
    """Commands for ``orders`` orders, delivered at least once.

    About ``duplicates`` of the messages are delivered again within ``window``
    positions, and about ``reorder`` are swapped with a neighbour within the window.
    ``poison`` orders (at most ``orders``) get one more ``add_item``, with the sku
    :data:`POISON_SKU`, somewhere before their ``submit``; with ``poison=0`` the
    workload is the same as without the argument.
    Each row: ``id``, ``order_id``, ``seq`` (the command's position in its order),
    ``type``, ``sku``, ``qty``.
    """
    rng = random.Random(seed)
    poison_rng = random.Random(seed + 1)  # its own draws: the rest of the workload is unchanged
    poisoned = set(poison_rng.sample(range(orders), min(max(poison, 0), orders)))
    commands: list[dict[str, Any]] = []
    per_order: list[list[dict[str, Any]]] = []
    for n in range(orders):
        order = f"order-{n:07d}"
        steps = [
            {"type": "add_item", "sku": rng.choice(list(PRICES)), "qty": rng.randint(1, 5)}
            for _ in range(rng.randint(1, 4))
        ]
        if n in poisoned:
            poisoned_step = {"type": "add_item", "sku": POISON_SKU, "qty": 1}
            steps.insert(poison_rng.randint(0, len(steps)), poisoned_step)
        steps.append({"type": "submit", "sku": None, "qty": None})
        rows = [
            {"id": f"{order}/cmd-{seq}", "order_id": order, "seq": seq} | step
            for seq, step in enumerate(steps)
        ]
        per_order.append(rows)
        commands.extend(rows)
    # interleave the orders as a stream would, keeping each order's commands in order
    stream: list[dict[str, Any]] = []
    queues = [list(rows) for rows in per_order]
    live = list(range(len(queues)))
    while live:
        pick = rng.randrange(min(len(live), 64))
        stream.append(queues[live[pick]].pop(0))
        if not queues[live[pick]]:
            live.pop(pick)
    keyed: list[tuple[float, dict[str, Any]]] = []
    for index, row in enumerate(stream):
        late = rng.uniform(1, window) if rng.random() < reorder else 0.0
        keyed.append((index + late, row))
        if rng.random() < duplicates:
            keyed.append((index + rng.uniform(1, window), dict(row)))
    keyed.sort(key=lambda pair: pair[0])
    delivered = [row for _, row in keyed]
    return Workload(delivered, commands)


def expected_outgoing(
    commands: Iterable[Mapping[str, Any]],
    consumer: str = "default",
    dead_letters: str | None = None,
) -> dict[str, str]:
    """``{outgoing id: destination}`` that processing every command once, in order, yields.

    A plain model of the order rules, written apart from :func:`handle_order` and
    from the stores: if the pipeline applied a message twice, lost one, or
    produced different outputs on a re-dispatch, the sets differ. A poison command
    (:func:`is_poison`) changes nothing and yields one dead letter to
    ``dead_letters``, id ``outgoing_id(consumer, order, message id, -1)``; a
    workload with poison and no ``dead_letters`` is a ``ValueError``.
    """
    by_order: dict[str, list[Mapping[str, Any]]] = {}
    for command in commands:
        by_order.setdefault(command["order_id"], []).append(command)
    expected: dict[str, str] = {}
    for order_id, rows in by_order.items():
        items = 0
        submitted = False
        for row in sorted(rows, key=lambda r: r["seq"]):
            mid = row["id"]
            if is_poison(row):
                if dead_letters is None:
                    raise ValueError(f"{mid!r} is poison: give the dead-letter destination")
                expected[outgoing_id(consumer, order_id, mid, -1)] = dead_letters
                continue
            if row["type"] == "add_item" and not submitted:
                items += 1
                names = ["orders.item-added"]
                if items == 1:
                    names.append("marketing.first-item-added")
            elif row["type"] == "submit" and not submitted and items:
                submitted = True
                names = ["orders.submitted"]
            else:
                names = ["orders.rejected"]
            for position, name in enumerate(names):
                expected[outgoing_id(consumer, order_id, mid, position)] = name
    return expected
