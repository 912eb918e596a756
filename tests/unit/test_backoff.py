from __future__ import annotations

import itertools
import random

import pytest

from django_dbworker.backoff import exponential_backoff


@pytest.mark.parametrize(("attempt", "nominal"), [(1, 2.0), (2, 4.0), (3, 8.0), (10, 1024.0)])
def test_delay_lies_in_the_upper_half_of_the_nominal_wait(attempt: int, nominal: float) -> None:
    rng = random.Random(7)
    for _ in range(200):
        delay = exponential_backoff(attempt, base=2.0, cap=3600.0, rng=rng)
        assert nominal / 2 <= delay <= nominal


def test_cap_bounds_every_delay_even_for_huge_attempts() -> None:
    rng = random.Random(1)
    delays = [exponential_backoff(10_000, base=2.0, cap=60.0, rng=rng) for _ in range(100)]
    assert max(delays) <= 60.0
    assert min(delays) >= 30.0


def test_jitter_spreads_delays() -> None:
    rng = random.Random(3)
    delays = {round(exponential_backoff(4, base=1.0, cap=100.0, rng=rng), 6) for _ in range(50)}
    assert len(delays) > 40


def test_attempt_below_one_counts_as_first() -> None:
    assert exponential_backoff(0, base=2.0, cap=10.0, rng=random.Random(0)) <= 2.0


def test_adaptive_polling_is_short_after_work_and_backs_off_to_the_interval() -> None:
    from django_dbworker.worker.wakeup import BUSY_WINDOW, FIRST_POLL, AdaptivePoll

    now = [100.0]
    poll = AdaptivePoll(1.0, enabled=True, clock=lambda: now[0])
    assert poll.next() == 1.0  # idle from the start
    poll.found_work()
    # While work keeps coming (within the window), short polls whatever the wake-ups.
    assert [poll.next() for _ in range(5)] == [FIRST_POLL] * 5
    now[0] += BUSY_WINDOW
    waits = [poll.next() for _ in range(10)]
    assert waits[0] == FIRST_POLL
    assert waits == sorted(waits) and waits[-1] == 1.0
    assert all(b <= 2 * a for a, b in itertools.pairwise(waits))
    # With notifications (PostgreSQL) the loop always waits the full interval.
    notified = AdaptivePoll(1.0, enabled=False)
    notified.found_work()
    assert notified.next() == 1.0
