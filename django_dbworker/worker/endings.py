"""``Ending``: what happened to one attempt, as its executor reports it.

Execution and the success writer decide and write an attempt's outcome and
*return* an ``Ending``; ``settle.py`` alone turns it into metrics, the
``attempt_recorded`` hook, counters and log lines. A value, no behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass

from django_dbworker.outcomes import Outcome


@dataclass(frozen=True)
class Ending:
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
