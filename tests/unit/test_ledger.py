"""The ledger of attempts in flight: states, ownership by (row id, claim token), settling once."""

from __future__ import annotations

import threading
import uuid
from datetime import UTC, datetime, timedelta

from django_dbworker.handlers import attempt_was_recorded
from django_dbworker.models import WorkItem
from django_dbworker.worker.attempts import Attempt, Ledger, State
from django_dbworker.worker.clock import ManualClock
from tests.testapp.workers import Noop

RUN_AFTER = datetime(2026, 1, 1, tzinfo=UTC)


def _attempt(
    pk: int, claimed_at: float = 0.0, *, priority: int = 0, run_after: datetime = RUN_AFTER
) -> Attempt:
    item = WorkItem(
        pk=pk, handler="noop", claim_token=uuid.uuid4(), priority=priority, run_after=run_after
    )
    return Attempt(item, Noop(), claimed_at=claimed_at)


def test_an_attempt_goes_buffered_running_recording_then_retired() -> None:
    retired: list[Attempt] = []
    ledger = Ledger(on_retired=retired.append)
    attempt = _attempt(1)
    ledger.add([attempt])
    assert attempt.state is State.BUFFERED and ledger.to_heartbeat() == [attempt.key]
    assert ledger.take_next(5.0, draining=False) == (attempt, State.RUNNING)
    assert attempt.started_at == 5.0
    assert ledger.take_next(6.0, draining=False) == (None, None), "started twice"
    ledger.begin_recording(attempt)
    assert attempt.recording and ledger.any_recording()
    ledger.retire(attempt)
    assert not ledger and retired == [attempt]


def test_a_buffered_attempt_does_not_start_while_draining_or_after_release() -> None:
    ledger = Ledger()
    first, second = _attempt(1), _attempt(2)
    ledger.add([first, second])
    assert ledger.take_next(1.0, draining=True) == (None, None)
    assert ledger.withdraw_unstarted() == [first, second]
    assert ledger.take_next(1.0, draining=False) == (None, None)
    ledger.restore([second])
    assert ledger.take_next(1.0, draining=False) == (second, State.RUNNING)
    assert ledger.take_next(1.0, draining=False) == (None, None)


def test_a_row_claimed_again_makes_the_older_attempt_lost_and_keys_stay_apart() -> None:
    ledger = Ledger()
    older = _attempt(7)
    ledger.add([older])
    newer = _attempt(7, claimed_at=1.0)
    ledger.add([newer])
    assert older.lost and not newer.lost
    assert ledger.to_heartbeat() == [newer.key]
    # Retiring the older attempt leaves the newer one (same row id) in flight.
    ledger.retire(older)
    assert ledger.attempts() == [newer]


def test_a_heartbeat_miss_while_recording_is_not_reported_as_a_lost_claim() -> None:
    ledger = Ledger()
    running, recording = _attempt(1), _attempt(2)
    ledger.add([running, recording])
    for _ in (running, recording):
        ledger.take_next(1.0, draining=False)
    ledger.begin_recording(recording)
    assert ledger.mark_lost({running.key, recording.key}) == [running]
    assert running.lost and recording.lost
    assert ledger.to_heartbeat() == []
    # A lost attempt is no longer moved to recording by its handler's end.
    ledger.begin_recording(running)
    assert running.lost


def test_excess_is_withdrawn_last_claimed_first_and_only_after_patience() -> None:
    clock = ManualClock(start=100.0)
    ledger = Ledger()
    attempts = [_attempt(n, claimed_at=clock.now()) for n in range(1, 6)]
    ledger.add(attempts)
    assert ledger.withdraw_excess(2, older_than=clock.now() - 1.0) == []
    clock.advance(1.5)
    assert ledger.withdraw_excess(2, older_than=clock.now() - 1.0) == attempts[2:]
    assert [a.state for a in attempts] == [State.BUFFERED] * 2 + [State.RELEASED] * 3


def test_an_ending_is_settled_once_whatever_the_threads() -> None:
    ledger = Ledger()
    attempt = _attempt(3)
    ledger.add([attempt])
    assert not attempt_was_recorded(attempt.item)
    wins: list[bool] = []
    threads = [
        threading.Thread(target=lambda: wins.append(ledger.mark_recorded(attempt)))
        for _ in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(5)
    assert sorted(wins) == [False] * 7 + [True]
    assert attempt_was_recorded(attempt.item)


def test_leftovers_at_a_stop_keep_the_outcomes_being_written() -> None:
    ledger = Ledger()
    buffered, recording = _attempt(1), _attempt(2, priority=5)
    ledger.add([recording, buffered])
    ledger.take_next(1.0, draining=False)
    ledger.begin_recording(recording)
    assert ledger.withdraw_leftovers(everything=False) == [buffered]
    assert ledger.withdraw_leftovers(everything=True) == [recording, buffered]


def test_the_manual_clock_waits_without_sleeping_for_the_duration() -> None:
    clock = ManualClock()
    event = threading.Event()
    done = threading.Event()

    def wait() -> None:
        clock.wait(event, 3600.0)
        done.set()

    thread = threading.Thread(target=wait)
    thread.start()
    assert not done.wait(0.05)
    clock.advance(3600.0)
    assert done.wait(5)
    thread.join(5)
    assert clock.wait(threading.Event(), 0.0) is False


def test_buffered_attempts_start_highest_priority_first_then_as_claimed() -> None:
    """Within a priority, in the order the claims dealt them (a fair rotation's turns),
    not by due time: a later-due row dealt first starts first."""
    ledger = Ledger()
    bulk = [_attempt(n) for n in range(1, 4)]
    later = _attempt(9, priority=10, run_after=RUN_AFTER + timedelta(seconds=1))
    urgent = _attempt(10, priority=10)
    ledger.add(bulk)
    ledger.add([later, urgent])
    order = [ledger.take_next(1.0, draining=False)[0] for _ in range(5)]
    assert order == [later, urgent, *bulk]
    assert ledger.take_next(1.0, draining=False) == (None, None)


def test_a_filtered_take_starts_the_best_accepted_attempt_and_leaves_the_others() -> None:
    """The event loop's starter takes only async attempts (``only``); what it passes over
    stays buffered, in order, for the pool threads."""
    ledger = Ledger()
    best, middle, last = _attempt(1, priority=3), _attempt(2, priority=2), _attempt(3)
    ledger.add([best, middle, last])
    wanted = {middle.key, last.key}
    take = ledger.take_next
    assert take(1.0, draining=False, only=lambda a: a.key in wanted) == (middle, State.RUNNING)
    assert take(1.0, draining=False, only=lambda a: False) == (None, None)
    assert ledger.buffered() == 2 and ledger.lowest_buffered_priority() == 0
    assert take(1.0, draining=False) == (best, State.RUNNING)
    assert take(1.0, draining=False) == (last, State.RUNNING)


def test_a_lost_buffered_attempt_is_handed_out_to_be_dropped() -> None:
    ledger = Ledger()
    attempt = _attempt(1)
    ledger.add([attempt])
    ledger.mark_lost({attempt.key})
    assert ledger.take_next(1.0, draining=False) == (attempt, State.LOST)


def test_shedding_gives_back_the_lowest_priority_rows() -> None:
    ledger = Ledger()
    urgent = _attempt(5, priority=10)
    bulk = [_attempt(n) for n in range(1, 5)]
    ledger.add([*bulk, urgent])
    assert ledger.lowest_buffered_priority() == 0
    excess = ledger.withdraw_excess(2, older_than=1.0)
    assert excess == bulk[1:]
    assert ledger.take_next(1.0, draining=False)[0] is urgent


def test_the_lowest_buffered_priority_follows_every_way_out_of_the_buffer() -> None:
    ledger = Ledger()
    low, mid, high = _attempt(1, priority=-5), _attempt(2), _attempt(3, priority=7)
    ledger.add([low, mid, high])
    assert ledger.lowest_buffered_priority() == -5
    ledger.mark_lost({low.key})
    assert ledger.lowest_buffered_priority() == 0
    assert ledger.withdraw_unstarted() == [mid, high]
    assert ledger.lowest_buffered_priority() is None
    ledger.restore([high])
    assert ledger.lowest_buffered_priority() == 7
    assert ledger.take_next(1.0, draining=False) == (high, State.RUNNING)
    assert ledger.lowest_buffered_priority() is None
    assert ledger.take_next(1.0, draining=False) == (low, State.LOST)  # to be dropped
