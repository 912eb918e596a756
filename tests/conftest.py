"""Fixtures shared by every test folder: waiting, vendors, worker subprocesses."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import connection

ROOT = Path(__file__).resolve().parent.parent


def wait_until(
    predicate: Callable[[], Any], *, timeout: float = 20.0, interval: float = 0.05, what: str = ""
) -> Any:
    """Poll ``predicate`` until truthy; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what or predicate!r}")
        time.sleep(interval)


def is_postgres() -> bool:
    return connection.vendor == "postgresql"


@pytest.fixture(autouse=True)
def _vendor_markers(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("postgres_only") and not is_postgres():
        pytest.skip(f"needs PostgreSQL; this leg runs on {connection.vendor}")
    if request.node.get_closest_marker("sqlite_only") and connection.vendor != "sqlite":
        pytest.skip(f"about SQLite's database write lock; this leg runs on {connection.vendor}")


class WorkerProcess:
    """A real ``manage.py run_workers`` subprocess with its log captured to a file."""

    def __init__(self, args: list[str], env: dict[str, str], log_path: Path) -> None:
        self.args = args
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in wait()/kill()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "django", "run_workers", *args],
            cwd=ROOT,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def wait(self, timeout: float = 30.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"run_workers did not exit within {timeout}s; log:\n{self.log()}")
        finally:
            self._log.close()

    def wait_for_log(self, text: str, timeout: float = 20.0) -> None:
        wait_until(
            lambda: text in self.log() or self.proc.poll() is not None,
            timeout=timeout,
            what=f"{text!r} in the worker log",
        )
        if text not in self.log():
            pytest.fail(
                f"worker exited ({self.proc.returncode}) before logging {text!r}:\n{self.log()}"
            )

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self._log.close()


@pytest.fixture
def worker_env(transactional_db: None) -> dict[str, str]:
    """Environment for subprocesses: same settings, pointed at the test database."""
    env = dict(os.environ)
    env["DJANGO_SETTINGS_MODULE"] = "tests.settings"
    env["DBWORKER_TEST_DB_NAME"] = str(connection.settings_dict["NAME"])
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.fixture
def start_worker(
    worker_env: dict[str, str], tmp_path: Path
) -> Iterator[Callable[..., WorkerProcess]]:
    started: list[WorkerProcess] = []

    def start(*args: str, env: dict[str, str] | None = None) -> WorkerProcess:
        merged = {**worker_env, **(env or {})}
        proc = WorkerProcess(list(args), merged, tmp_path / f"worker-{len(started)}.log")
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.kill()
