"""Flow control without a database: rate strings, full-window holds, the paused-queue reads."""

from __future__ import annotations

import math

import pytest

from django_dbworker.validation import InvalidValue, rate_limit
from django_dbworker.worker.flow import PausedQueues, RateHolds


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1/s", (1, 1.0)), ("50/s", (50, 1.0)), ("100/m", (100, 60.0)), ("1000/h", (1000, 3600.0))],
)
def test_rate_limits_parse(text: str, expected: tuple[int, float]) -> None:
    assert rate_limit(text) == expected


@pytest.mark.parametrize(
    ("value", "wrong_type"),
    [("0/s", False), ("fast", False), ("5/d", False), ("5 /s", False), ("5/S", False),
     ("/s", False), (5, True), (5.0, True), (None, True), (b"5/s", True)],
)  # fmt: skip
def test_bad_rate_limits_say_why(value: object, wrong_type: bool) -> None:
    with pytest.raises(InvalidValue) as caught:
        rate_limit(value)
    assert caught.value.wrong_type is wrong_type
    assert repr(value) in str(caught.value)


class Handler:
    def __init__(self, rate: object) -> None:
        self.rate_limit = rate


def test_rate_holds_read_each_handler_mapping_once_and_skip_bad_values() -> None:
    holds = RateHolds()
    handlers = {"a": Handler("10/s"), "b": Handler(None), "c": Handler("oops")}
    assert holds.rates(handlers) == {"a": (10, 1.0)}  # type: ignore[arg-type]
    handlers["d"] = Handler("1/s")  # the worker replaces the mapping, never changes it
    assert holds.rates(handlers) == {"a": (10, 1.0)}  # type: ignore[arg-type]


def test_a_hold_ends_by_itself_and_says_when() -> None:
    holds = RateHolds()
    assert holds.next_release(0.0) == math.inf
    holds.hold("a", until=5.0)
    holds.hold("b", until=2.0)
    assert holds.held("a", 1.0) and holds.held("b", 1.0)
    assert holds.next_release(1.0) == 1.0
    assert not holds.held("b", 2.0)  # ended: forgotten
    assert holds.next_release(2.0) == 3.0
    assert not holds.held("a", 6.0)
    assert holds.next_release(6.0) == math.inf


def test_paused_queues_are_read_at_most_once_per_interval() -> None:
    now = [0.0]
    reads: list[float] = []
    answers = [["emails"], ["emails", "reports"]]

    def read() -> list[str]:
        reads.append(now[0])
        return answers[min(len(reads) - 1, 1)]

    paused = PausedQueues(read, every=1.0, clock=lambda: now[0])
    assert paused.poll() == {"emails"}
    now[0] = 0.5
    assert paused.poll() is None  # not yet
    now[0] = 1.0
    assert paused.poll() == {"emails", "reports"}
    assert reads == [0.0, 1.0]


def test_a_failed_read_keeps_the_last_answer() -> None:
    def read() -> list[str]:
        raise ConnectionError("down")

    paused = PausedQueues(read, every=1.0, clock=lambda: 0.0)
    assert paused.poll() is None
    assert paused.names == frozenset()
