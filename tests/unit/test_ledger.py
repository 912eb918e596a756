"""The ledger of attempts in flight: states, ownership by (row id, claim token), settling once."""

from __future__ import annotations

import threading
import uuid

from django_dbworker.handlers import attempt_was_recorded
from django_dbworker.models import WorkItem
from django_dbworker.worker.attempts import Attempt, Ledger, State
from django_dbworker.worker.clock import ManualClock
from tests.testapp.workers import Noop


def _attempt(pk: int, claimed_at: float = 0.0) -> Attempt:
    item = WorkItem(pk=pk, handler="noop", claim_token=uuid.uuid4())
    return Attempt(item, Noop(), claimed_at=claimed_at)


def test_an_attempt_goes_buffered_running_recording_then_retired() -> None:
    retired: list[None] = []
    ledger = Ledger(on_retired=lambda: retired.append(None))
    attempt = _attempt(1)
    ledger.add([attempt])
    assert attempt.state is State.BUFFERED and ledger.to_heartbeat() == [attempt.key]
    assert ledger.start(attempt, 5.0, draining=False) is State.RUNNING
    assert attempt.started_at == 5.0
    assert ledger.start(attempt, 6.0, draining=False) is None, "started twice"
    ledger.begin_recording(attempt)
    assert attempt.recording and ledger.any_recording()
    ledger.retire(attempt)
    assert not ledger and retired == [None]


def test_a_buffered_attempt_does_not_start_while_draining_or_after_release() -> None:
    ledger = Ledger()
    first, second = _attempt(1), _attempt(2)
    ledger.add([first, second])
    assert ledger.start(first, 1.0, draining=True) is None
    assert ledger.withdraw_unstarted() == [first, second]
    assert ledger.start(second, 1.0, draining=False) is None
    ledger.restore([second])
    assert ledger.start(second, 1.0, draining=False) is State.RUNNING


def test_a_row_claimed_again_makes_the_older_attempt_lost_and_keys_stay_apart() -> None:
    ledger = Ledger()
    older = _attempt(7)
    ledger.add([older])
    newer = Attempt(
        WorkItem(pk=7, handler="noop", claim_token=uuid.uuid4()), Noop(), claimed_at=1.0
    )
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
    for attempt in (running, recording):
        ledger.start(attempt, 1.0, draining=False)
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
        threading.Thread(target=lambda: wins.append(ledger.settle_once(attempt))) for _ in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(5)
    assert sorted(wins) == [False] * 7 + [True]
    assert attempt_was_recorded(attempt.item)


def test_leftovers_at_a_stop_keep_the_outcomes_being_written() -> None:
    ledger = Ledger()
    buffered, recording = _attempt(1), _attempt(2)
    ledger.add([buffered, recording])
    ledger.start(recording, 1.0, draining=False)
    ledger.begin_recording(recording)
    assert ledger.withdraw_leftovers(everything=False) == [buffered]
    assert ledger.withdraw_leftovers(everything=True) == [buffered, recording]


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
