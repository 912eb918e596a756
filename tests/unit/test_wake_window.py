"""``WakeWindow``: which wake-ups an enqueuing process sends within WAKEUP_WINDOW.

Pure bookkeeping on a fake clock; what reaches the database is tested on
PostgreSQL in tests/integration/test_wakeup_window.py.
"""

from __future__ import annotations

from django.test import override_settings

from django_dbworker.db.wake_window import AFTER_COMMIT, IN_TRANSACTION, OFF, WakeWindow, mode


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_one_wake_up_per_queue_per_window_unless_more_urgent() -> None:
    clock = FakeClock()
    window = WakeWindow(clock)
    assert window.due("default", "q", 0, 0.1)
    clock.now += 0.05
    assert not window.due("default", "q", 0, 0.1)  # inside the window
    assert window.due("default", "other", 0, 0.1)  # another queue
    assert window.due("replica", "q", 0, 0.1)  # another alias
    assert window.due("default", "q", 5, 0.1)  # more urgent: at once
    assert not window.due("default", "q", 5, 0.1)
    assert not window.due("default", "q", 1, 0.1)
    clock.now += 0.15
    assert window.due("default", "q", 0, 0.1)  # a new window


def test_a_forgotten_wake_up_does_not_use_up_the_window() -> None:
    window = WakeWindow(FakeClock())
    assert window.due("default", "q", 0, 1.0)
    window.forget("default", "q")
    assert window.due("default", "q", 0, 1.0)
    window.clear()
    assert window.due("default", "q", 0, 1.0)


def test_a_window_of_zero_sends_every_wake_up() -> None:
    window = WakeWindow(FakeClock())
    assert window.due("default", "q", 0, 0.0)
    assert window.due("default", "q", 0, 0.0)


def test_the_mode_follows_the_settings() -> None:
    assert mode() == IN_TRANSACTION
    with override_settings(DBWORKER={"WAKEUP_WINDOW": 0.1}):
        assert mode() == AFTER_COMMIT
    with override_settings(DBWORKER={"WAKEUP_WINDOW": 0.1, "WAKEUPS": False}):
        assert mode() == OFF
