"""How an attempt ends: one vocabulary for metrics labels, logs, spans and test counts.

A declaration, like the model's statuses: the worker decides outcomes,
metrics and ``testing.run_until_empty`` report them, and all of them spell
them the same way (the first four, ``cancelled`` and ``snoozed`` are SPEC's
``worker_tasks_total`` status label values).
"""

from __future__ import annotations

from enum import StrEnum


class Outcome(StrEnum):
    #: The handler returned and its result was recorded.
    SUCCEEDED = "succeeded"
    #: The attempt failed and no attempt is left (or the error is not retryable).
    FAILED = "failed"
    #: The attempt failed and the item is pending again, after a backoff.
    RETRIED = "retried"
    #: The handler overran its timeout: recorded as a failed attempt.
    TIMEOUT = "timeout"
    #: The handler raised after a cancel request (or raised ``Cancelled``), or
    #: overran its timeout after one: the item ended ``cancelled``.
    CANCELLED = "cancelled"
    #: The handler raised ``Snooze``: the item is pending again, its attempt
    #: not counted.
    SNOOZED = "snoozed"
    #: Discarded: the row is no longer claimed by this attempt (recovered as
    #: stale meanwhile); counted in ``worker_fenced_total``.
    FENCED = "fenced"
    #: The success was handed to the success writer, which reports it later.
    DEFERRED = "deferred"
    #: No outcome could be written: the row is still claimed by this attempt,
    #: until its owner releases it or stale recovery finds it.
    UNRECORDED = "unrecorded"

    @property
    def final(self) -> bool:
        """Whether this is the attempt's last word (not handed over, not lost)."""
        return self not in (Outcome.DEFERRED, Outcome.UNRECORDED)
