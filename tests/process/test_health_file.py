"""``run_workers --health-file`` and ``dbworker_health``: a probe a supervisor can run.

A real worker, real signals: SIGSTOP freezes it (as a hung process would
be), SIGCONT thaws it, SIGTERM stops it; the probe is the real command.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def probe(env: dict[str, str], path: Path, max_age: str = "2") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "django",
            "dbworker_health",
            "--file",
            str(path),
            "--max-age",
            max_age,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_probe_follows_the_worker_through_a_freeze_and_a_stop(
    start_worker, worker_env: dict[str, str], tmp_path: Path
) -> None:
    path = tmp_path / "worker-health.json"
    worker = start_worker("noop", "--health-file", str(path))
    wait_until(path.exists, timeout=30, what="the health file to appear")
    healthy = probe(worker_env, path)
    assert healthy.returncode == 0, healthy.stderr
    assert healthy.stdout.startswith(f"Healthy: pid {worker.pid} on ")

    worker.signal(signal.SIGSTOP)  # hung: nothing refreshes the file
    try:
        stale = wait_until(
            lambda: (p := probe(worker_env, path, max_age="1")).returncode == 1 and p,
            timeout=30,
            what="the probe to report the frozen worker",
        )
        assert "was last written" in stale.stderr and "more than 1 s" in stale.stderr
        assert len(stale.stderr.strip().splitlines()) == 1  # one line, no traceback
    finally:
        worker.signal(signal.SIGCONT)
    wait_until(lambda: probe(worker_env, path).returncode == 0, timeout=30, what="healthy again")

    worker.signal(signal.SIGTERM)
    assert worker.wait() == 0
    assert not path.exists()
    gone = probe(worker_env, path)
    assert gone.returncode == 1
    assert "does not exist (the worker is not running, or stopped)" in gone.stderr


def test_the_probe_refuses_a_bad_max_age(worker_env: dict[str, str], tmp_path: Path) -> None:
    out = probe(worker_env, tmp_path / "none.json", max_age="soon")
    assert out.returncode != 0
    assert "argument --max-age: 'soon' is not a number of seconds" in out.stderr
    assert "Traceback" not in out.stderr


def test_the_worker_never_follows_a_link_planted_where_it_writes(
    start_worker, tmp_path: Path
) -> None:
    """A shared directory (/tmp): another local user plants a link at the temporary name the
    worker would write (it sees the pid); the file it points at stays as it was."""
    shared = tmp_path / "shared"
    shared.mkdir()
    victim = tmp_path / "victim.conf"
    victim.write_text("precious settings\n")
    health = shared / "worker-health.json"
    worker = start_worker("noop", "--health-file", str(health))
    planted = shared / f".{health.name}.{worker.pid}.tmp"
    planted.symlink_to(victim)
    wait_until(health.exists, timeout=60, what="the health file to appear")
    worker.kill()
    assert victim.read_text() == "precious settings\n"
    assert not health.is_symlink()


def test_the_probe_refuses_a_link_at_the_path(worker_env: dict[str, str], tmp_path: Path) -> None:
    """A fresh file that another user linked (or wrote) at the path is not the worker's."""
    fresh = tmp_path / "anything.json"
    fresh.write_text('{"pid": 1, "host": "elsewhere"}\n')
    path = tmp_path / "worker-health.json"
    path.symlink_to(fresh)
    out = probe(worker_env, path)
    assert out.returncode == 1
    assert "is a link, not the worker's file" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
