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


def lock_waiters(table: str = "django_dbworker_workitem") -> int:
    """Transactions of this database server waiting for a row lock right now.

    MariaDB waits for a row found by its primary key while optimising
    (processlist state "Statistics", not yet LOCK WAIT): those on ``table``
    count too. Poll it at most every 0.2 s on MariaDB: InnoDB refreshes its
    INNODB_TRX cache only when the previous read is more than 0.1 s old.
    """
    from django_dbworker.db.postgresql_sql import WAKE_TURN_SPACE

    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            # Workers waiting for their wake-up turn (worker/wakeup.py) wait on a lock too.
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND datname = current_database() AND query NOT LIKE %s",
                [f"%pg_advisory_lock({WAKE_TURN_SPACE},%"],
            )
        else:
            cursor.execute(
                "SELECT (SELECT count(*) FROM information_schema.innodb_trx"
                "        WHERE trx_state = 'LOCK WAIT')"
                " + (SELECT count(*) FROM information_schema.processlist"
                "    WHERE state = 'Statistics' AND info LIKE %s)",
                [f"%{table}%"],
            )
        (n,) = cursor.fetchone()
    return int(n)


def wake_turns(using: str = "default") -> tuple[int, int]:
    """Workers holding a wake-up turn, and workers waiting for one (PostgreSQL's ``pg_locks``)."""
    from django.db import connections

    from django_dbworker.db.postgresql_sql import WAKE_TURN_SPACE

    with connections[using].cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FILTER (WHERE granted), count(*) FILTER (WHERE NOT granted) "
            "FROM pg_locks WHERE locktype = 'advisory' AND classid = %s "
            "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
            [WAKE_TURN_SPACE],
        )
        held, waiting = cursor.fetchone()
    return int(held), int(waiting)


@pytest.fixture
def slow_retries() -> Iterator[None]:
    """Retries due 30-60 s after a failure, for in-process tests that run one attempt,
    look at the retry, then make it due (``factories.make_due``). With the suite's
    25-50 ms backoff, a loaded machine could let ``run_until_empty`` claim the retry
    again before it stops."""
    from django.conf import settings
    from django.test import override_settings

    with override_settings(
        DBWORKER={**settings.DBWORKER, "RETRY_BACKOFF": 60.0, "RETRY_BACKOFF_MAX": 120.0}
    ):
        yield


#: Folders whose tests hold the same on any database: the admin's pages, the
#: browser tests, the docs' examples and the deployment recipes. With the
#: tests that use no database, they run once per Django version, in the
#: vendor-neutral leg of scripts/test (on SQLite); the rest runs on every database.
NEUTRAL_FOLDERS = ("unit", "integration/admin", "e2e", "docs", "deploy")
#: Markers that tie a test to databases: such a test runs in the vendor legs.
VENDOR_MARKERS = ("postgres_only", "server_db", "mysql_only", "sqlite_only", "pgbouncer")
#: Fixtures through which a test reaches the database (pytest-django's).
DATABASE_FIXTURES = frozenset(
    {
        "db",
        "transactional_db",
        "django_db_reset_sequences",
        "django_db_serialized_rollback",
        "live_server",
    }
)


def is_vendor_neutral(item: pytest.Item) -> bool:
    """Whether ``item`` runs in the vendor-neutral leg (once) rather than on every database.

    A test is vendor-neutral unless it carries a vendor marker or
    ``every_database``, and it either sits in one of ``NEUTRAL_FOLDERS`` or
    uses no database (no ``django_db`` marker, none of ``DATABASE_FIXTURES``).
    So a new test that uses the database runs on every database by default.
    """
    if item.get_closest_marker("every_database"):
        return False
    if any(item.get_closest_marker(name) for name in VENDOR_MARKERS):
        return False
    parent = Path(str(item.path)).resolve().parent
    tests = ROOT / "tests"
    folder = parent.relative_to(tests).as_posix() if parent.is_relative_to(tests) else ""
    if any(folder == f or folder.startswith(f + "/") for f in NEUTRAL_FOLDERS):
        return True
    uses_db = item.get_closest_marker("django_db") is not None or bool(
        DATABASE_FIXTURES & set(getattr(item, "fixturenames", ()))
    )
    return not uses_db


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the vendor-neutral tests ``vendor_neutral`` (scripts/test selects by it)."""
    for item in items:
        if is_vendor_neutral(item):
            item.add_marker(pytest.mark.vendor_neutral)


class Shard:
    """``DBWORKER_SHARD=K/N``: run the K-th of N parts of what the leg selected.

    scripts/test splits its longest legs in parts that run side by side, each
    on a server of its own, so that the lanes end together. Whole files go to
    one part (their module fixtures are built once), largest first onto the
    lightest part. A file weighs its number of tests, a process test three
    (measured on the PostgreSQL leg: a process test takes 2.5 s, the others
    0.5; this weighting split it 277 s / 263 s). Runs after the marker
    selection (``trylast``), so it divides what the leg actually runs.
    """

    def __init__(self, spec: str) -> None:
        try:
            index, count = (int(part) for part in spec.split("/"))
        except ValueError:
            raise pytest.UsageError(f"DBWORKER_SHARD={spec!r}: expected K/N, e.g. 1/2") from None
        if not 1 <= index <= count:
            raise pytest.UsageError(f"DBWORKER_SHARD={spec!r}: K must be between 1 and N")
        self.index, self.count = index, count

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(
        self, config: pytest.Config, items: list[pytest.Item]
    ) -> None:
        weights: dict[str, int] = {}
        for item in items:
            path = Path(str(item.path))
            weights[str(path)] = weights.get(str(path), 0) + (
                3 if path.parent.name == "process" else 1
            )
        loads = [0] * self.count
        part_of: dict[str, int] = {}
        for path in sorted(weights, key=lambda p: (-weights[p], p)):
            part = loads.index(min(loads))
            loads[part] += weights[path]
            part_of[path] = part
        keep = [item for item in items if part_of[str(item.path)] == self.index - 1]
        dropped = [item for item in items if part_of[str(item.path)] != self.index - 1]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
        items[:] = keep


def pytest_configure(config: pytest.Config) -> None:
    spec = os.environ.get("DBWORKER_SHARD")
    if spec:
        config.pluginmanager.register(Shard(spec), "dbworker-shard")


def is_postgres() -> bool:
    return connection.vendor == "postgresql"


def is_server_database() -> bool:
    """A database server with row locks: PostgreSQL, or MySQL/MariaDB."""
    return connection.vendor in ("postgresql", "mysql")


@pytest.fixture(autouse=True)
def _vendor_markers(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("postgres_only") and not is_postgres():
        pytest.skip(f"needs PostgreSQL; this leg runs on {connection.vendor}")
    if request.node.get_closest_marker("server_db") and not is_server_database():
        pytest.skip(
            f"needs a database server (PostgreSQL or MariaDB); this leg runs on {connection.vendor}"
        )
    if request.node.get_closest_marker("mysql_only") and connection.vendor != "mysql":
        pytest.skip(f"about MySQL/MariaDB; this leg runs on {connection.vendor}")
    if request.node.get_closest_marker("sqlite_only") and connection.vendor != "sqlite":
        pytest.skip(f"about SQLite's database write lock; this leg runs on {connection.vendor}")


@pytest.fixture(autouse=True)
def _no_broken_connection_from_an_earlier_test() -> None:
    """Reconnect when an earlier test left the connection broken.

    A test that kills server sessions (or restarts the server) can lose its
    own connection at its end; without this, every later test in the run
    would fail on "the connection is closed" and hide which one broke it.
    """
    raw = connection.connection
    if raw is not None and getattr(raw, "closed", False):
        connection.close()


@pytest.fixture(scope="session", autouse=True)
def _pgbouncer_lets_go_of_the_test_database(request: pytest.FixtureRequest) -> Iterator[None]:
    """In the PgBouncer leg: end PgBouncer's server sessions on the test database at the end.

    PgBouncer keeps idle server connections to the test database after its
    clients closed theirs, so pytest-django's DROP DATABASE would fail
    ("being accessed by other users"). Set up after the test databases,
    this is torn down before them: it terminates those sessions over the
    direct connection (DBWORKER_DIRECT_URL), then the DROP goes through.
    """
    direct = os.environ.get("DBWORKER_DIRECT_URL")
    if not direct:
        yield
        return
    request.getfixturevalue("django_db_setup")
    name = str(connection.settings_dict["NAME"])
    yield
    import psycopg

    with psycopg.connect(direct, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = %s AND pid <> pg_backend_pid()",
            [name],
        )


def kill_other_connections() -> int:
    """Kill every other connection to the test database (as a failover or a DBA would).

    Returns how many were killed.
    """
    with connection.cursor() as cursor:
        if connection.vendor == "mysql":
            cursor.execute(
                "SELECT id FROM information_schema.processlist "
                "WHERE db = DATABASE() AND id <> CONNECTION_ID()"
            )
            killed = 0
            for (pid,) in cursor.fetchall():
                try:
                    cursor.execute(f"KILL CONNECTION {int(pid)}")
                    killed += 1
                except Exception:  # it ended meanwhile (errno 1094: unknown thread)
                    pass
            return killed
        cursor.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        return int(cursor.fetchone()[0])


def restart_server() -> None:
    """Restart this leg's own database server in place, or skip saying why not."""
    if connection.vendor == "mysql":
        variable, script = "DBWORKER_MARIADB_STATE", "mariadbcluster.py"
    else:
        variable, script = "DBWORKER_PG_STATE", "pgcluster.py"
    state = os.environ.get(variable)
    if not state:
        pytest.skip(
            f"{variable} is not set: this run did not start its own database server "
            "(scripts/test sets it), so the server cannot be restarted"
        )
    connection.close()
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / script), "restart", "--state", state],
        check=True,
        timeout=120,
    )


class WorkerProcess:
    """A real ``manage.py run_workers`` subprocess with its log captured to a file."""

    def __init__(
        self,
        args: list[str],
        env: dict[str, str],
        log_path: Path,
        cwd: Path = ROOT,
        *,
        new_session: bool = False,
    ) -> None:
        self.args = args
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in wait()/kill()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "django", "run_workers", *args],
            cwd=cwd,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            # Its own process group, as a terminal's foreground job (os.killpg: Ctrl-C).
            start_new_session=new_session,
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


#: The router that sends the app's tables to the ``work`` alias (a queue database).
QUEUE_ROUTER = "tests.routers.QueueOnWork"


@pytest.fixture
def routed() -> Iterator[None]:
    """This process routes the app to the ``work`` alias (``QUEUE_ROUTER``)."""
    from django.test import override_settings

    with override_settings(DATABASE_ROUTERS=[QUEUE_ROUTER]):
        yield


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

    def start(
        *args: str, env: dict[str, str] | None = None, new_session: bool = False
    ) -> WorkerProcess:
        merged = {**worker_env, **(env or {})}
        proc = WorkerProcess(
            list(args), merged, tmp_path / f"worker-{len(started)}.log", new_session=new_session
        )
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.kill()
