"""scripts/demo's start and stop: a taken port is refused before anything starts; a signal
stops everything it started.

The demo runs in a copy of the repository whose ``.venv/bin/python`` is a
stub that does nothing, so that only the script's own logic runs (no
install, no server): its port check uses ``$PYTHON``, the real interpreter.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ROOT


@pytest.fixture
def demo(tmp_path: Path) -> Path:
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "demo", tmp_path / "scripts" / "demo")
    stub = tmp_path / ".venv" / "bin" / "python"
    stub.parent.mkdir(parents=True)
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(0o755)
    return tmp_path / "scripts" / "demo"


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def _run(demo: Path, port: object) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable, "DEMO_PORT": str(port)}
    return subprocess.run(["bash", str(demo)], env=env, capture_output=True, text=True, timeout=60)


def test_a_taken_port_is_refused_before_the_banner_suggesting_demo_port(
    demo: Path, taken_port: int
) -> None:
    done = _run(demo, taken_port)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Demo running" not in done.stdout
    assert f"Port {taken_port} on 127.0.0.1 is taken" in done.stderr
    assert f"DEMO_PORT={taken_port + 1} scripts/demo" in done.stderr


def test_a_free_port_starts_the_demo(demo: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    done = _run(demo, port)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"Demo running. Open http://127.0.0.1:{port}/" in done.stdout


def test_a_port_that_is_not_a_number_is_refused(demo: Path) -> None:
    done = _run(demo, "80a")
    assert done.returncode == 1
    assert "DEMO_PORT='80a' is not a port number" in done.stderr


#: A python that, as the development server, the worker or the stream, runs
#: until SIGTERM and then notes which one stopped (in $DEMO_LOG).
_LONG_RUNNING_STUB = """#!/bin/sh
case "$2" in
  runserver|run_workers|demo_stream)
    trap 'echo "$2 stopped" >> "$DEMO_LOG"; exit 0' TERM
    echo "$2 started" >> "$DEMO_LOG"
    echo "$$" >> "$DEMO_LOG.pids"
    while :; do sleep 0.05; done ;;
esac
exit 0
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_demo_stops_the_server_the_worker_and_the_stream(
    demo: Path, tmp_path: Path, signum: signal.Signals
) -> None:
    """``kill <pid of scripts/demo>`` stops it as Ctrl-C does: with the development
    server in the foreground, bash ran no trap until the server exited by itself."""
    stub = tmp_path / ".venv" / "bin" / "python"
    stub.write_text(_LONG_RUNNING_STUB)
    log = tmp_path / "demo.log"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "PYTHON": sys.executable, "DEMO_PORT": str(port), "DEMO_LOG": str(log)}
    proc = subprocess.Popen(
        ["bash", str(demo)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 30
        started = {"runserver started", "run_workers started", "demo_stream started"}
        while not (log.exists() and started <= set(log.read_text().splitlines())):
            assert time.monotonic() < deadline, log.read_text() if log.exists() else "no log"
            assert proc.poll() is None, proc.communicate()[0]
            time.sleep(0.05)
        proc.send_signal(signum)
        output, _ = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in Path(f"{log}.pids").read_text().split() if Path(f"{log}.pids").exists() else []:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
    assert proc.returncode == 0, output
    stopped = {"runserver stopped", "run_workers stopped", "demo_stream stopped"}
    assert stopped <= set(log.read_text().splitlines()), log.read_text()


def test_the_demo_enqueues_its_images_in_a_batch_for_the_batches_page(tmp_path: Path) -> None:
    """``demo_enqueue`` (and the home page's button) puts the ten image resizes in a
    ``batch()`` whose callback is ``images_resized``: the admin's Batches page lists it."""
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "example_project.settings",
        "DATABASE_URL": f"sqlite:///{tmp_path / 'demo.sqlite3'}",
    }

    def manage(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, str(ROOT / "manage.py"), *args],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    manage("migrate", "--noinput", "-v0")
    assert "Enqueued 29 demo work items" in manage("demo_enqueue")
    shown = manage(
        "shell",
        "-c",
        "from django_dbworker.batches.models import Batch; "
        "print([(b.on_complete, b.total, b.payload, b.sealed_at is not None, "
        "sorted(set(b.items.values_list('handler', flat=True)))) for b in Batch.objects.all()])",
    )
    # The last line: the shell may first say what it imported.
    assert shown.strip().splitlines()[-1] == (
        "[('images_resized', 10, {'album': 'holidays'}, True, ['resize_image'])]"
    ), shown
