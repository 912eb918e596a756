"""What the health file says about a worker: the watchdog's verdict and the claim loop's pulse."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path

from django_dbworker.worker.clock import ManualClock
from django_dbworker.worker.health_file import CYCLE_SLACK, HealthFile, worker_problem
from tests.conftest import wait_until


@dataclass
class Dog:
    """The watchdog's two answers, set by the test."""

    fine: bool = True
    unhealthy: str | None = None

    def check(self) -> bool:
        return self.fine


@dataclass
class Loop:
    cycled_at: float


@dataclass
class Config:
    poll_interval: float = 1.0


def test_a_claim_loop_that_stopped_cycling_makes_the_worker_unhealthy(tmp_path: Path) -> None:
    clock = ManualClock()
    loop = Loop(cycled_at=clock.now())
    problem = worker_problem(Dog(), loop, Config(), clock)
    path = tmp_path / "h.json"
    health = HealthFile(str(path), interval=1, problem=problem, stopping=threading.Event())
    assert health.write_once() and json.loads(path.read_text())["pid"] > 0

    clock.advance(1.0 + CYCLE_SLACK + 1)
    assert problem() == f"the claim loop has not begun a cycle for {1 + CYCLE_SLACK + 1:.0f} s"
    path.unlink()
    assert not health.write_once() and not path.exists()

    loop.cycled_at = clock.now()  # it moves again
    assert health.write_once() and path.exists()


def test_the_watchdogs_reason_is_the_problem() -> None:
    dog = Dog(fine=False, unhealthy="the heartbeat thread died")
    assert worker_problem(dog, None, Config(), ManualClock())() == "the heartbeat thread died"


def test_the_file_is_removed_when_the_worker_stops(tmp_path: Path) -> None:
    path = tmp_path / "h.json"
    stopping = threading.Event()
    health = HealthFile(str(path), interval=0.01, problem=lambda: None, stopping=stopping)
    health.start()
    try:
        wait_until(path.exists, timeout=10, what="the first write")
    finally:
        stopping.set()
        health.join(5)
    assert not health.is_alive() and not path.exists()
