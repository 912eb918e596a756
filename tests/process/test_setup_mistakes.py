"""Setup mistakes of a first day, in fresh processes: one clear line, not a traceback.

Enqueue before ``migrate`` (the tables do not exist), and a SQLite file in
a folder that does not exist: the last line of what the user sees names the
fix (``manage.py migrate``, the missing folder); ``run_workers`` exits
non-zero with one line. Each on this leg's database: an empty database on
the same server (PostgreSQL, MariaDB) or an empty SQLite file.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.db import connection

from tests.conftest import ROOT

# Each test reaches the database through worker_env (transactional_db), or not at all.

ENQUEUE = """
import django
django.setup()
from tests.testapp.workers import Echo
Echo.enqueue({"a": 1})
"""


@pytest.fixture
def empty_database(tmp_path: Path) -> Iterator[str]:
    """The NAME of a database without any tables, on this leg's server."""
    if connection.vendor == "sqlite":
        yield str(tmp_path / "empty.sqlite3")
        return
    name = f"dbw_empty_{uuid.uuid4().hex[:10]}"
    with connection.cursor() as cursor:
        cursor.execute(f"CREATE DATABASE {name}")
    try:
        yield name
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f"DROP DATABASE {name}")


def _run(args: list[str], env: dict[str, str], name: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args,
        cwd=ROOT,
        env={**env, "DBWORKER_TEST_DB_NAME": name},
        capture_output=True,
        text=True,
        timeout=120,
    )


def _last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


def test_enqueue_before_migrate_ends_with_one_line_saying_run_migrate(
    worker_env: dict[str, str], empty_database: str
) -> None:
    done = _run([sys.executable, "-c", ENQUEUE], worker_env, empty_database)
    assert done.returncode == 1
    last = _last_line(done.stderr)
    assert last.startswith("django_dbworker.errors.DatabaseNotReady: "), done.stderr
    assert "manage.py migrate" in last
    assert "django_dbworker" in last and repr("default") in last
    # Chained: the database's own error is still there, above.
    assert "The above exception was the direct cause" in done.stderr


def test_run_workers_before_migrate_exits_non_zero_with_one_line(
    worker_env: dict[str, str], empty_database: str
) -> None:
    done = _run(
        [sys.executable, "-m", "django", "run_workers", "--burst"], worker_env, empty_database
    )
    assert done.returncode == 1
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert len(lines) == 1, done.stdout + done.stderr
    assert lines[0].startswith("CommandError: ") and "manage.py migrate" in lines[0]


def test_a_sqlite_file_in_a_missing_folder_is_named_by_enqueue_and_run_workers(
    tmp_path: Path,
) -> None:
    # Its own SQLite file, not the test database: vendor-neutral, so it runs in the
    # neutral legs, on the oldest and the newest Django (6.1's checks probe databases).
    if connection.vendor != "sqlite":
        pytest.skip(f"about a SQLite file; this run's database is {connection.vendor}")
    worker_env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    folder = tmp_path / "no" / "such"
    name = str(folder / "db.sqlite3")
    done = _run([sys.executable, "-c", ENQUEUE], worker_env, name)
    assert done.returncode == 1
    last = _last_line(done.stderr)
    assert last.startswith("django_dbworker.errors.DatabaseNotReady: "), done.stderr
    assert f"the folder {folder} does not exist" in last
    assert "The above exception was the direct cause" in done.stderr

    done = _run([sys.executable, "-m", "django", "run_workers", "--burst"], worker_env, name)
    assert done.returncode == 1
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert len(lines) == 1, done.stdout + done.stderr
    assert lines[0].startswith("CommandError: ")
    assert f"the folder {folder} does not exist" in lines[0]
    assert "server is running" not in lines[0]
    assert not folder.exists()


@pytest.mark.parametrize(
    "command",
    [
        ["dbworker_stats"],
        ["dbworker_prune", "--older-than", "7d"],
        # The queue verbs too: one line, not a traceback.
        ["dbworker_queue", "pause", "default"],
        ["dbworker_queue", "resume", "default"],
        ["dbworker_queue", "list"],
    ],
    ids=lambda command: " ".join(command[:2]),
)
def test_a_command_before_migrate_exits_non_zero_with_one_line(
    worker_env: dict[str, str], empty_database: str, command: list[str]
) -> None:
    done = _run([sys.executable, "-m", "django", *command], worker_env, empty_database)
    assert done.returncode == 1
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert len(lines) == 1, done.stdout + done.stderr
    assert lines[0].startswith("CommandError: ") and "manage.py migrate" in lines[0]


def test_dbworker_queue_with_an_unknown_database_says_so_in_one_line(
    worker_env: dict[str, str],
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "django", "dbworker_queue", "--database", "nope", "list"],
        cwd=ROOT,
        env=worker_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert lines == ["CommandError: No database 'nope' in DATABASES."], done.stderr
