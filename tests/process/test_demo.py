"""scripts/demo's start: a taken port is refused before anything starts.

The demo runs in a copy of the repository whose ``.venv/bin/python`` is a
stub that does nothing, so that only the script's own logic runs (no
install, no server): its port check uses ``$PYTHON``, the real interpreter.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
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
