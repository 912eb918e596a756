"""The values the vendor interface takes, returns and raises, as plain data.

Claimed rows (``Claimed``), planner estimates (``TableEstimate``),
run-time percentiles (``RunTimes``), what is wrong with a server
(``ServerProblem``, ``UnsupportedDatabase``)
and the shape of a wake-up ``Subscription``: what ``VendorOperations``
(``base.py``) hands to the admin, the stats, the checks and the worker.
Data only: this module must not run SQL, import Django or import anything
else of the package, so that every layer may name these types.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

T = TypeVar("T")


def percentile(ordered: Sequence[float], fraction: float) -> float:
    """PostgreSQL's ``percentile_cont``: linear interpolation between the nearest ranks.

    ``ordered`` is sorted and not empty. The same definition on every
    vendor, so a dashboard shows the same numbers for the same rows.
    """
    position = fraction * (len(ordered) - 1)
    lower = math.floor(position)
    upper = min(lower + 1, len(ordered) - 1)
    return ordered[lower] + (ordered[upper] - ordered[lower]) * (position - lower)


class UnsupportedDatabase(Exception):
    """The configured database cannot run django-dbworker."""


@dataclass(frozen=True)
class ServerProblem:
    """Something about a database server that matters to django-dbworker (``server_problems``).

    ``check`` names the problem (``"version"``: the worker cannot run there;
    ``"replication"``: it runs, at a risk), which ``checks.py`` turns into a
    system check of a stable id; ``message`` and ``hint`` are its text.
    """

    check: str
    message: str
    hint: str


@dataclass
class ColumnStats:
    """Planner statistics of one column: value frequencies and the rest."""

    frequencies: dict[str, float]
    n_distinct: float

    def frequency(self, value: str) -> float:
        if value in self.frequencies:
            return self.frequencies[value]
        others = self.n_distinct - len(self.frequencies)
        rest = max(0.0, 1.0 - sum(self.frequencies.values()))
        return rest / others if others >= 1 else 0.0


@dataclass
class TableEstimate:
    """The planner's idea of the work table: row count and column statistics."""

    rows: float
    columns: dict[str, ColumnStats]


@dataclass(frozen=True)
class RunTimes:
    """How long one handler's succeeded rows ran (``finished_at - claimed_at``), in seconds."""

    handler: str
    #: Rows the percentiles come from.
    count: int
    p50: float
    p95: float
    #: True when they come from a sample of the latest rows, not from all of them.
    sampled: bool = False


class Claimed(list[T]):
    """The rows a claim took, in claim order, and what a limit held back.

    ``throttled``: candidates the claim found ready but left pending because
    their (handler, concurrency_key) had no free slot (per-key concurrency
    limits); not attempts, untouched. The claim loop reads it so that a
    batch cut short by keys does not look like an empty queue.

    A rate-limited claim (``claim(rate=...)``) also says ``held_back``: rows
    asked for that its window did not allow, and ``full_for``: seconds (by
    the database clock) until the window's earliest start leaves it, when
    the window is full (None while starts are left).
    """

    def __init__(
        self,
        items: Iterable[T] = (),
        throttled: int = 0,
        *,
        held_back: int = 0,
        full_for: float | None = None,
    ) -> None:
        super().__init__(items)
        self.throttled = throttled
        self.held_back = held_back
        self.full_for = full_for


class Subscription(Protocol):
    """Wake-up notifications received on a connection of their own (``listen``)."""

    def receive(self, timeout: float) -> Iterator[str]:
        """The queue names notified, each as soon as it arrives, for up to ``timeout`` s.

        Raises the driver's error when the connection is lost; the caller
        reconnects by calling ``listen`` again.
        """
        ...

    def probe(self, token: str, via: str) -> None:
        """Notify ``token`` as a probe on alias ``via``'s database, on a connection of its own.

        Sent the way an enqueuer sends a wake-up; ``probed`` says whether it arrived.
        """
        ...

    def probed(self, token: str) -> bool:
        """Whether the probe ``token`` arrived (read by ``receive``, never yielded by it)."""
        ...

    def wait_turn(self, group: str) -> bool:
        """Wait for the wake-up turn of ``group`` (not listening meanwhile); granted, listen
        for every wake-up. False: the wait was cancelled (``interrupt``, a timeout)."""
        ...

    def pass_turn(self, group: str) -> None:
        """Hand ``group``'s wake-up turn on to the next waiter."""
        ...

    def interrupt(self) -> None:
        """End a ``wait_turn`` under way with an error (thread-safe: a stop)."""
        ...

    def close(self) -> None:
        """Stop listening and close the connection."""
        ...
