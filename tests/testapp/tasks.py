"""Django ``@task`` functions run by ``DBWorkerBackend`` (tests/settings.py TASKS).

Declared with Django's own decorator where Django's API is enough, and with
``django_dbworker.tasks.task`` where a test needs the worker's options.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

from django_dbworker.tasks import task as dbtask
from tests.testapp.models import Effect, Execution

try:
    from django.tasks import task
except ImportError:  # Django 5.2: the backport
    from django_tasks import task  # type: ignore[no-redef]


def _record(key: str, kind: str = "run") -> int:
    Execution.objects.create(key=key, kind=kind, pid=os.getpid())
    return Execution.objects.filter(key=key, kind=kind).count()


@task
def add(a: int, b: int) -> int:
    return a + b


@task(priority=10, queue_name="tasks")
def record(key: str) -> str:
    _record(key)
    return key


@task
def echo(*args: Any, **kwargs: Any) -> dict[str, Any]:
    return {"args": list(args), "kwargs": kwargs}


@task(takes_context=True)
def whoami(context: Any, key: str) -> dict[str, Any]:
    _record(key)
    result = context.task_result
    return {
        "attempt": context.attempt,
        "id": result.id,
        "status": str(result.status),
        "worker_ids": list(result.worker_ids),
        "errors": [e.exception_class_path for e in result.errors],
    }


@dbtask(takes_context=True, max_attempts=4)
def flaky(context: Any, key: str, fail_times: int) -> dict[str, Any]:
    """Fails its first ``fail_times`` attempts, then says what its context saw."""
    _record(key)
    if context.attempt <= fail_times:
        raise ConnectionError(f"flaky failure {context.attempt}")
    return {"attempt": context.attempt, "errors": len(context.task_result.errors)}


@dbtask(max_attempts=2)
def always_fails(key: str) -> None:
    _record(key)
    raise ValueError(f"always fails: {key}")


@dbtask(max_attempts=3, sensitive=True)
def secret(token: str) -> None:
    raise ValueError(f"bad token {token}")


@task
async def async_add(a: int, b: int) -> int:
    await asyncio.sleep(0)
    return a + b


@task
async def loop_thread() -> str:
    """The thread an ``async def`` task runs on: the worker's event loop under run_workers."""
    import threading

    await asyncio.sleep(0)
    return threading.current_thread().name


@dbtask(unique_key=lambda name: f"rebuild:{name}")
def rebuild(name: str) -> str:
    return name


@task
def not_json() -> Any:
    return object()


@task
def infinite() -> float:
    """Django's normalize_json keeps inf; JSON (and so the result column) cannot hold it."""
    return float("inf")


@dbtask(timeout=0.3, max_attempts=1)
def overrun(seconds: float) -> None:
    time.sleep(seconds)


@dbtask(atomic=True, max_attempts=1)
def atomic_effect(key: str, fail: bool) -> None:
    Effect.objects.create(key=key)
    if fail:
        raise RuntimeError("rolled back")


@task(backend="patient")
def patient(key: str) -> None:
    _record(key)
    raise ConnectionError("not yet")


@dbtask(max_attempts=3)
def kill_worker(key: str, times: int) -> str:
    """SIGKILLs its own worker process ``times`` times, then succeeds."""
    runs = _record(key)
    if runs <= times:
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(10)
    return "survived"


@task
def fail_when_told(key: str) -> str:
    """Runs until the test creates Execution(key, "go") (30 s at most), then raises."""
    _record(key)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not Execution.objects.filter(key=key, kind="go").exists():
        time.sleep(0.05)
    raise ValueError("the task failed after its cancel request")


@task
def cancels_itself(key: str) -> str:
    """Cancels its own item (SPEC: a handler may raise ``Cancelled`` unasked)."""
    from django_dbworker import Cancelled

    _record(key)
    raise Cancelled("nothing to do")
