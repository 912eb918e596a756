"""Small helpers to put rows in known states, using the DB clock like the code does."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any, TypeVar

from django.db import connection, connections, transaction
from django.db.models.functions import Now

from django_dbworker import transitions
from django_dbworker.db import operations
from django_dbworker.models import WorkItem
from django_dbworker.worker.runtime import WorkerConfig

T = TypeVar("T")


def auto_explained(run: Callable[[], T]) -> tuple[T, list[str]]:
    """What ``run`` returned, and the plans of the statements it ran as the server chose
    them (PostgreSQL's auto_explain, a contrib module, reports each as a notice to this
    session; its settings are reset before the session is reused)."""
    return _auto_explained(run, {})


def auto_explained_json(run: Callable[[], T]) -> tuple[T, list[dict[str, Any]]]:
    """``auto_explained`` with the plans analyzed (actual rows, loops, JIT), as JSON."""
    result, notices = _auto_explained(
        run, {"auto_explain.log_analyze": "on", "auto_explain.log_format": "json"}
    )
    return result, [json.loads(n[n.index("{") :]) for n in notices if "{" in n]


def _auto_explained(run: Callable[[], T], extra: dict[str, str]) -> tuple[T, list[str]]:
    connection.ensure_connection()
    raw = connection.connection
    notices: list[str] = []

    def collect(diagnostic: Any) -> None:
        notices.append(diagnostic.message_primary or "")

    settings = {
        "auto_explain.log_min_duration": "0",
        "auto_explain.log_level": "notice",
        **extra,
    }
    with connection.cursor() as cursor:
        cursor.execute("LOAD 'auto_explain'")
        for name, value in settings.items():
            cursor.execute(f"SET {name} = {value}")
    raw.add_notice_handler(collect)
    try:
        result = run()
    finally:
        raw.remove_notice_handler(collect)
        with connection.cursor() as cursor:
            for name in settings:
                cursor.execute(f"RESET {name}")
    return result, notices


def rows_read(plan: dict[str, Any]) -> int:
    """Rows that a JSON plan's scans of the work table produced or filtered out, all loops."""
    read = 0
    if plan.get("Relation Name") == "django_dbworker_workitem":
        loops = int(plan.get("Actual Loops", 1))
        read += int(plan.get("Actual Rows", 0)) * loops
        read += int(plan.get("Rows Removed by Filter", 0))
    return read + sum(rows_read(child) for child in plan.get("Plans", []))


def make_item(handler: str = "noop", **fields: Any) -> WorkItem:
    fields.setdefault("max_attempts", 3)
    fields.setdefault("payload", {})
    return WorkItem.objects.create(handler=handler, **fields)


def claim(
    limit: int = 10,
    handlers: list[str] | None = None,
    queues: list[str] | None = None,
    worker: str = "test:1:main",
    limited: bool = False,
) -> list[WorkItem]:
    return operations().claim(
        limit=limit,
        handlers=handlers or ["noop", "echo", "urgent"],
        queues=queues,
        worker=worker,
        limits=handler_limits(handlers or []) if limited else None,
    )


def handler_limits(names: list[str]) -> dict[str, int]:
    """The current ``concurrency_limit`` of each registered handler of ``names`` that has one."""
    from django_dbworker.registry import registry

    return {
        n: registry[n].concurrency_limit
        for n in names
        if n in registry and getattr(registry[n], "concurrency_limit", None) is not None
    }


def age_heartbeat(item: WorkItem, seconds: float) -> None:
    """Make the heartbeat ``seconds`` old by the database's clock."""
    WorkItem.objects.filter(pk=item.pk).update(heartbeat_at=Now() - timedelta(seconds=seconds))


def worker_config(**kwargs: Any) -> WorkerConfig:
    """A WorkerConfig with fast clocks for in-process worker tests."""
    base: dict[str, Any] = {
        "concurrency": 4,
        "poll_interval": 0.1,
        "heartbeat_interval": 0.2,
        "stale_after": 60.0,
        "shutdown_timeout": 5.0,
    }
    base.update(kwargs)
    return WorkerConfig(**base)


def steal_claim(item_pk: int) -> None:
    """Force a false stale detection: age the heartbeat and recover, atomically."""
    with transaction.atomic():
        WorkItem.objects.filter(pk=item_pk).update(heartbeat_at=Now() - timedelta(hours=1))
        result = transitions.recover_stale(stale_after=60)
    assert result.requeued == 1


def make_due() -> None:
    """Skip the backoff wait: retries become due now (DB clock)."""
    WorkItem.objects.filter(status="pending").update(run_after=Now())


def assert_no_key_overlaps() -> int:
    """Assert no two runs of one key overlapped, from the ``keyed`` handler's own records.

    Each key's start and end records, in time order, must read start, end,
    start, end, ...; returns the most runs of different keys that were
    running at one moment (more than 1: keys ran side by side).
    """
    from tests.testapp.models import Execution

    records = list(Execution.objects.filter(kind__in=["start", "end"]).order_by("created_at", "id"))
    by_key: dict[str, list[str]] = {}
    for record in records:
        by_key.setdefault(record.key, []).append(record.kind)
    for key, kinds in by_key.items():
        expected = ["start", "end"] * (len(kinds) // 2)
        assert kinds == expected, f"runs of key {key!r} overlapped: {kinds}"
    running = widest = 0
    for record in records:
        running += 1 if record.kind == "start" else -1
        widest = max(widest, running)
    return widest


def wait_buffered_behind_gate(worker: Any) -> None:
    """Wait until ``worker``'s one thread runs the first gated item with rows buffered behind it.

    And until its claim loop is quiet and has counted every row the
    database shows taken (no claim's count still to come). The gated rows'
    keys are ``gated-N``, as the priority tests enqueue them.
    """
    from tests.conftest import wait_until
    from tests.testapp.models import Execution

    wait_until(
        lambda: Execution.objects.filter(key="gated-0", kind="start").exists(),
        what="the first gated item to hold the thread",
    )
    # A few rows are enough to tell an order; how many the worker buffers
    # follows the pace it measured on the fast items, so the machine's speed
    # (about 170 alone, 70 beside another test run on 2 cores; fewer under a
    # heavier load).
    wait_until(
        lambda: WorkItem.objects.filter(status="claimed").count() >= 10,
        what="rows buffered behind it",
    )
    wait_until(lambda: worker.idle.is_set() or not worker.wake.is_set(), what="a quiet loop")
    loop = worker.claim_loop
    assert loop is not None
    wait_until(
        lambda: loop.claimed == WorkItem.objects.exclude(status="pending").count(),
        what="the claim loop to have counted every claimed row",
    )


def limited_claim(handlers: list[str], limit: int, worker: str = "t:1", **kw: Any) -> Any:
    """A keyed claim: ``handlers`` with their current ``concurrency_limit``."""
    return claim(limit=limit, handlers=handlers, worker=worker, limited=True, **kw)


class HeldClaim:
    """A claim made in a transaction of its own thread, kept open (a claim in flight)."""

    def __init__(self, run: Callable[[], Any]) -> None:
        self.run = run
        self.started = threading.Event()
        self.release = threading.Event()
        self.out: list[Any] = []
        self.errors: list[str] = []
        self.thread = threading.Thread(target=self._body, daemon=True)

    def _body(self) -> None:
        try:
            with transaction.atomic():
                self.out.append(self.run())
                self.started.set()
                assert self.release.wait(30)
                transaction.set_rollback(True)  # the rows go back to pending
        except Exception as exc:  # pragma: no cover - reported by the test
            self.errors.append(repr(exc))
            self.started.set()
        finally:
            connections.close_all()

    def __enter__(self) -> HeldClaim:
        self.thread.start()
        assert self.started.wait(30), "the held claim did not start"
        assert not self.errors, self.errors
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release.set()
        self.thread.join(30)
        assert not self.thread.is_alive()


class RowLockHeld:
    """A transaction of its own thread that updates one row (a heartbeat) and stays open."""

    def __init__(self, pk: int) -> None:
        self.pk = pk
        self.locked = threading.Event()
        self.release = threading.Event()
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._body, daemon=True)

    def _body(self) -> None:
        try:
            with transaction.atomic():
                WorkItem.objects.filter(pk=self.pk).update(heartbeat_at=Now())
                self.locked.set()
                assert self.release.wait(30)
        except BaseException as exc:  # reported by the test
            self.errors.append(exc)
            self.locked.set()
        finally:
            connections.close_all()

    def __enter__(self) -> RowLockHeld:
        self.thread.start()
        assert self.locked.wait(30) and not self.errors, self.errors
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release.set()
        self.thread.join(30)
        assert not self.thread.is_alive() and not self.errors, self.errors


def most_in_a_window(times: list[datetime], seconds: float) -> int:
    """The most of ``times`` within any window of ``seconds``."""
    times = sorted(times)
    most = start = 0
    for end, t in enumerate(times):
        while (t - times[start]).total_seconds() >= seconds:
            start += 1
        most = max(most, end - start + 1)
    return most
