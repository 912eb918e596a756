"""Fixtures of the integration tests: workers running in background threads."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest

from django_dbworker.db import operations
from django_dbworker.registry import registry
from django_dbworker.worker import Worker
from tests.conftest import wait_until
from tests.factories import worker_config


@pytest.fixture
def background_worker() -> Iterator[Callable[..., Worker]]:
    """Start in-process workers; stop them (and wait for their threads) afterwards."""
    running: list[tuple[Worker, threading.Thread]] = []

    def start(names: list[str], **kwargs: object) -> Worker:
        worker = Worker([registry[n] for n in names], worker_config(**kwargs))
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        running.append((worker, thread))
        return worker

    yield start
    for worker, thread in running:
        worker.stop(immediate=True)
        thread.join(10)
        assert not thread.is_alive(), "worker did not stop"
    # Abandoned handler threads (released or timed out) may still be running
    # user code; let them end before the next test's tables are in use. Not the
    # wake-up listener (PostgreSQL): it runs no user code and holds no lock, and
    # notices the stop within its one-second wait for notifications.
    wait_until(
        lambda: (
            not [
                t
                for t in threading.enumerate()
                if t.name.startswith("dbworker") and t.name != "dbworker-listener"
            ]
        ),
        timeout=30,
        what="abandoned handler threads to finish",
    )


@pytest.fixture
def gate() -> Iterator[None]:
    """``Gate`` items with ``wait`` block until the test opens the gate (or it ends)."""
    from tests.testapp.workers import GATE

    GATE.clear()
    yield
    GATE.set()


@pytest.fixture
def fresh_key_walk() -> Iterator[None]:
    """The PostgreSQL keyed claim tries the heads again: no memory of many keys (the
    operations object is one per alias, shared by every test of the process)."""
    ops = operations()
    ops.__dict__.pop("_walk_keys_until", None)
    yield
    ops.__dict__.pop("_walk_keys_until", None)
