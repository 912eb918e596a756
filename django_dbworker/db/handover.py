"""The slot hand-over: a success write that claims the freed key's next row.

With ``concurrency_limit`` 1 each key is a chain: claim, run, success write,
and only then may a claim see the slot free. The claim that does comes
after the success commit and after a claim loop's next turn, so a key moved
one item per about two claim cycles (W7: 31-36% of plain W1 at 100 keys,
``docs/internals/benchmarks.md``). Handing the slot over in the success
write itself takes that wait out: the statement that records the successes
claims, for each key they free, up to as many of the key's next ready rows
for the same worker, in the same transaction.

Why no key lock is needed, unlike the keyed claim: per key, the statement
claims at most as many rows as it ends, so the key's count of claimed rows
never grows, and its change is one commit; a concurrent keyed claim sees
either the ended rows or their successors as holding the slots. It still
checks the handler's current limit (a lowered limit is not refilled), and
claims no more than ``budget`` rows (the worker's free room, so one process
does not keep every key while another idles).

This module holds the hand-over's terms (what the worker allows) and the
default for a vendor without it (MySQL/MariaDB, SQLite): the plain success
write, nothing claimed; ``postgresql_handover_sql.py`` holds PostgreSQL's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol
from uuid import UUID

if TYPE_CHECKING:
    from django_dbworker.models import WorkItem


@dataclass(frozen=True)
class HandOver:
    """What a worker lets a success write claim for it."""

    #: The worker's claimable handlers with a concurrency limit: name -> current limit.
    limits: Mapping[str, int]
    #: The worker's queues (None: every queue).
    queues: Sequence[str] | None
    #: ``claimed_by`` of the rows claimed.
    worker: str
    #: At most this many rows in all.
    budget: int


#: ``succeed_rows``'s answer, and the rows claimed by the hand-over.
Outcome = tuple[list[tuple[int, UUID, bool]], list["WorkItem"]]


class _SucceedsRows(Protocol):
    def succeed_rows(
        self, outcomes: Sequence[tuple[int, UUID, str | None]]
    ) -> list[tuple[int, UUID, bool]]: ...


class NoHandOver:
    """``VendorOperations``' default: the plain success write, nothing handed over."""

    def succeed_handing_over(
        self: _SucceedsRows, outcomes: Sequence[tuple[int, UUID, str | None]], hand_over: HandOver
    ) -> Outcome:
        """``succeed_rows``, and the rows claimed in the slots it freed (none here: the
        freed slots wait for a claim). PostgreSQL overrides it."""
        return self.succeed_rows(outcomes), []
