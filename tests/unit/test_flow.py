"""Flow control without a database: rate strings, full-window holds, the paused-queue reads."""

from __future__ import annotations

import math

import pytest

from django_dbworker.validation import InvalidValue, rate_limit
from django_dbworker.worker.claim import ClaimRoute, PausedQueues
from django_dbworker.worker.config import WorkerConfig


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


def route(now: list[float]) -> ClaimRoute:
    """A claim route that never reaches a database (these tests claim nothing)."""
    return ClaimRoute(
        ops=None,  # type: ignore[arg-type]
        config=WorkerConfig(),
        metrics=None,  # type: ignore[arg-type]
        now=lambda: now[0],
        handlers=dict,
    )


def test_rates_are_read_once_per_handler_mapping_and_bad_values_skipped() -> None:
    claims = route([0.0])
    handlers = {"a": Handler("10/s"), "b": Handler(None), "c": Handler("oops")}
    assert claims.rates(handlers) == {"a": (10, 1.0)}  # type: ignore[arg-type]
    handlers["d"] = Handler("1/s")  # the worker replaces the mapping, never changes it
    assert claims.rates(handlers) == {"a": (10, 1.0)}  # type: ignore[arg-type]


def test_a_full_window_ends_by_itself_and_says_when() -> None:
    now = [0.0]
    claims = route(now)
    assert claims.next_window() == math.inf
    claims._held_until.update(a=5.0, b=2.0)
    now[0] = 1.0
    assert claims._held("a") and claims._held("b")
    assert claims.next_window() == 1.0
    now[0] = 2.0
    assert not claims._held("b")  # ended: forgotten
    assert claims.next_window() == 3.0
    now[0] = 6.0
    assert not claims._held("a")
    assert claims.next_window() == math.inf


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
