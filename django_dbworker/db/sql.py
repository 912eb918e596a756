"""What every vendor's statements share: the ``Statement`` type, list slots, the claim's columns.

A vendor's statements module (``postgresql_sql.py``, ``mysql_sql.py``, the
statements half of ``sqlite.py``) writes its SQL as named ``Statement``
constants and fills their ``{slot}`` parts with ``numbered``. The columns a
claim and an enqueue return are fixed here, where both the statements and
the decoder in ``base.py`` read them. This module is text only: it must not
import Django, the models or anything of the package, and runs no SQL.
"""

from __future__ import annotations

import re
import string
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

#: Columns a claim returns, in this order: everything the executor needs
#: (and ``run_after``, for the claim order), nothing bulky it doesn't. Every
#: vendor's claim statement RETURNs exactly these (the snapshot test checks).
CLAIM_COLUMNS = (
    "id",
    "handler",
    "queue",
    "payload",
    "priority",
    "run_after",
    "attempts",
    "max_attempts",
    "claimed_by",
    "claim_token",
    "trace_context",
    # What its ending sets off: its batch, and whether items wait for it.
    "batch_id",
    "has_dependents",
    # Its key's slot, which its ending frees (the claim loop claims again at once).
    "concurrency_key",
    # Its fair key: a claim of several turns deals its rows out by key (``flow/fair.py``).
    "fair_key",
)

#: Columns an enqueue statement returns for each inserted row, in this order.
INSERTED_COLUMNS = ("id", "run_after", "created_at", "updated_at")


def numbered(name: str, count: int) -> str:
    """``%(name_0)s, %(name_1)s, ...``: ``count`` named parameters for an IN list.

    For vendors without array parameters (SQLite, MySQL): a list of N
    values is N placeholders, filled into a statement's ``{slot}``.
    """
    return ", ".join(f"%({name}_{i})s" for i in range(count))


def numbered_params(name: str, values: Sequence[Any]) -> dict[str, Any]:
    """The values for ``numbered(name, len(values))``."""
    return {f"{name}_{i}": value for i, value in enumerate(values)}


@dataclass(frozen=True)
class Statement:
    """One named SQL statement of a vendor module: what it is for, and its text.

    ``sql`` takes named parameters (``%(name)s``; Django's cursors accept
    them on every vendor). Where the text itself must vary (SQLite has no
    array parameters, so a list of N values needs N placeholders), the
    varying part is a ``{slot}`` that the vendor module fills through
    ``render``; everything else is fixed text.
    """

    name: str
    purpose: str
    sql: str

    @property
    def slots(self) -> tuple[str, ...]:
        """The names of the ``{slot}`` parts; empty for a fixed statement."""
        return tuple(f for _, f, _, _ in string.Formatter().parse(self.sql) if f)

    def render(self, **slots: str) -> str:
        """The statement's text with its slots filled in."""
        return self.sql.format(**slots) if self.slots else self.sql


# The claims' paused-queue test, which every vendor's claim statements (plain and keyed)
# hold once in their candidates' WHERE, before any other mention of the queue states.
_PAUSED_TEST = re.compile(
    r"(?P<alias>\b\w+\.)?queue NOT IN \(SELECT name FROM django_dbworker_queuestate WHERE paused\)"
)


class Turn(NamedTuple):
    """One turn of the fair rotation (``flow/fair.py``): the ready rows of one priority
    and one fair key (``""``: the rows without a key)."""

    key: str
    priority: int

    def params(self) -> dict[str, Any]:
        """The parameters ``fair_filtered`` adds."""
        return {"fair_key": self.key, "fair_priority": self.priority}


class Turns(NamedTuple):
    """The turns of one claim of the fair rotation: at one priority, how many rows each
    fair key takes (``""``: the rows without a key), in the order they were dealt."""

    priority: int
    shares: tuple[tuple[str, int], ...]

    def each(self) -> list[tuple[Turn, int]]:
        """Each key's turn, with its row count."""
        return [(Turn(key, self.priority), rows) for key, rows in self.shares]


def fair_filtered(sql: str, turn: Turn | None) -> str:
    """A claim statement narrowed to one turn of the fair rotation (None: as it is).

    The tests join the candidates' paused-queue test, so every rule of the claim
    (handlers, queues, pauses, keys' limits) still applies to the turn's rows.
    """
    if turn is None:
        return sql
    match = _PAUSED_TEST.search(sql)
    if match is None:
        raise ValueError("not a claim statement: no paused-queue test to narrow")
    alias = match.group("alias") or ""
    key = f"{alias}fair_key IS NULL" if turn.key == "" else f"{alias}fair_key = %(fair_key)s"
    test = f"\n  AND {key} AND {alias}priority = %(fair_priority)s"
    return sql[: match.end()] + test + sql[match.end() :]
