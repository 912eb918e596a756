"""``Ending``: what happened to one attempt, as its executor reports it.

Execution and the success writer decide and write an attempt's outcome and
*return* an ``Ending``; ``settle.py`` alone turns it into metrics, the
``attempt_recorded`` hook, counters and log lines. A value, no behaviour.
"""

from __future__ import annotations

from typing import NamedTuple

from django_dbworker.outcomes import Outcome


class Ending(NamedTuple):
    """One attempt's ending (a tuple: one is made per job, on the hot path)."""

    outcome: Outcome
    #: What the row is now (``succeeded``, ``pending`` for a retry, ``failed``),
    #: or None when this attempt no longer owns it (fenced out, unrecorded)
    #: or handed it over (``DEFERRED``).
    status: str | None = None
    #: The exception that failed the attempt.
    error: BaseException | None = None
    #: Seconds the attempt took (what the task duration metric observes).
    seconds: float = 0.0

    def took(self, seconds: float) -> Ending:
        return Ending(self.outcome, self.status, self.error, seconds)


#: A success handed to the success writer, which reports its ending later.
DEFERRED = Ending(Outcome.DEFERRED)
#: No outcome could be written: the row is still claimed by this attempt.
UNRECORDED = Ending(Outcome.UNRECORDED)
#: Discarded: the row is no longer claimed by this attempt.
FENCED = Ending(Outcome.FENCED)


class Observer:
    """What running an attempt tells the attempt's owner as it happens (no-ops here).

    ``recording``: the handler is done and its outcome is about to be
    written (a heartbeat that misses the row from now on raced the write).
    ``landed``: a write of this attempt's outcome committed, with the row's
    status: its ``attempt_recorded`` hook is due now, from the writing
    thread, before anything else can speak for the attempt. ``abandoned``:
    the handler overran its timeout and its run goes on in a thread of its
    own. ``late``: how that abandoned run ended.
    """

    __slots__ = ()

    def recording(self) -> None:
        pass

    def landed(self, ending: Ending) -> None:
        pass

    def abandoned(self) -> None:
        pass

    def late(self, ending: Ending) -> None:
        pass


SILENT = Observer()
