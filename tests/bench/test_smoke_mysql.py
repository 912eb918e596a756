"""The benchmark scripts' MariaDB paths, run at tiny sizes (the MariaDB leg).

As in test_smoke.py, speed is not asserted: only that each script runs to
completion on the leg's server and prints its JSON result line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
BENCH = ROOT / "bench"

pytestmark = [pytest.mark.mysql_only, pytest.mark.django_db]


def bench_env() -> dict[str, str]:
    """The leg's server URL (its own database, not the test database)."""
    env = dict(os.environ)
    env.pop("DJANGO_SETTINGS_MODULE", None)
    return env


def run(script: str, *args: str) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        cwd=ROOT,
        env=bench_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


def test_raw_ceiling_inserts_on_mysql() -> None:
    result = run("raw_ceiling.py", "--inserts", "50")
    assert result["bench"] == "raw_ceiling"
    assert result["inserts"] == 50


def test_peers_script_runs_django_tasks_db_on_mysql() -> None:
    """Installs django-tasks-db (and mysqlclient) into bench/.peers from PyPI (once)."""
    result = run(
        "peers.py",
        "--mysql",
        "--only",
        "django-tasks-db",
        "--items",
        "100",
        "--single",
        "20",
        "--latency-items",
        "5",
        "--rate",
        "50",
    )
    assert result["peer"] == "django-tasks-db"
    assert result["database"] == "mariadb"
    assert result["w1"]["succeeded"] == 100
