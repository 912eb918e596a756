"""Retry delays: exponential growth, a cap, and jitter.

Pure arithmetic, no database and no clock: the delay is added to the
database's ``now()`` by the transition that schedules the retry.
"""

from __future__ import annotations

import random


def exponential_backoff(
    attempt: int, *, base: float, cap: float, rng: random.Random | None = None
) -> float:
    """Seconds to wait before the attempt after ``attempt`` (1-based).

    The delay doubles per attempt from ``base`` up to ``cap``; "equal jitter"
    then picks uniformly in the upper half, so retries of items that failed
    together spread out but never come back sooner than half the nominal wait.
    """
    if attempt < 1:
        attempt = 1
    # 2**64 already dwarfs any sane cap; bounding the exponent avoids OverflowError.
    nominal = min(cap, base * (2.0 ** min(attempt - 1, 64)))
    draw = (rng or random).uniform(0.0, nominal / 2.0)
    return nominal / 2.0 + draw
