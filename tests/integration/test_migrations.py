"""One migration for 0.1: it builds what the development migrations (0001-0012) built.

Fresh installs run ``0001_initial`` alone. A database migrated by the development
migrations has ``0001_initial`` recorded, so Django counts the new one as applied: that
is safe only if both build the same schema, on every database. The development
migrations are taken from this clone's history (the commit before the one that removed
``0012_rate_start_buckets.py``), each set migrates a fresh database of its own in a
subprocess, and their tables, columns, indexes and constraints are compared.
"""

from __future__ import annotations

import io
import json
import os
import pkgutil
import subprocess
import sys
import tarfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from django.db import connection
from django.db.migrations.recorder import MigrationRecorder

from django_dbworker.db import DEVELOPMENT_MIGRATIONS
from django_dbworker.management.commands.run_workers import _pending_migrations
from tests.conftest import ROOT

pytestmark = pytest.mark.django_db(transaction=True)

#: The development migrations' names: what a database migrated before 0.1 has recorded.
DEVELOPMENT = ["0001_initial", *DEVELOPMENT_MIGRATIONS]
#: The migrations added after 0.1's ``0001_initial``, which such a database runs as any does.
AFTER_0001 = ["0002_workitem_dbworker_concurrency_key_idx", "0003_liveworker", "0004_fair_key"]

#: Run in a subprocess pointed at one database: its django_dbworker tables as JSON.
DUMP = r"""
import json, re
import django
django.setup()
from django.db import connection

out = {}
with connection.cursor() as c:
    tables = sorted(t for t in connection.introspection.table_names()
                    if t.startswith("django_dbworker_"))
    for t in tables:
        if connection.vendor == "postgresql":
            c.execute("SELECT column_name, data_type, is_nullable, column_default, "
                      "character_maximum_length FROM information_schema.columns "
                      "WHERE table_name = %s", [t])
            cols = sorted(map(list, c.fetchall()))
            c.execute("SELECT indexname, indexdef FROM pg_indexes WHERE tablename = %s", [t])
            idx = sorted(map(list, c.fetchall()))
            c.execute("SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint "
                      "WHERE conrelid = %s::regclass", [t])
            cons = sorted(map(list, c.fetchall()))
        elif connection.vendor == "mysql":
            c.execute("SELECT column_name, column_type, is_nullable, column_default, "
                      "collation_name, extra, generation_expression "
                      "FROM information_schema.columns "
                      "WHERE table_schema = DATABASE() AND table_name = %s", [t])
            cols = sorted(map(list, c.fetchall()))
            c.execute("SELECT index_name, seq_in_index, column_name, collation, non_unique, "
                      "sub_part FROM information_schema.statistics "
                      "WHERE table_schema = DATABASE() AND table_name = %s", [t])
            idx = sorted(map(list, c.fetchall()))
            c.execute("SELECT tc.constraint_name, tc.constraint_type, cc.check_clause "
                      "FROM information_schema.table_constraints AS tc "
                      "LEFT JOIN information_schema.check_constraints AS cc "
                      "ON cc.constraint_schema = tc.constraint_schema "
                      "AND cc.constraint_name = tc.constraint_name "
                      "WHERE tc.table_schema = DATABASE() AND tc.table_name = %s", [t])
            cons = sorted(map(list, c.fetchall()))
        else:
            c.execute(f'PRAGMA table_info("{t}")')
            cols = sorted([r[1], r[2], r[3], r[4], r[5]] for r in c.fetchall())
            c.execute("SELECT name, sql FROM sqlite_master WHERE type = 'index' "
                      "AND tbl_name = %s AND sql IS NOT NULL", [t])
            idx = sorted(map(list, c.fetchall()))
            c.execute("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = %s", [t])
            sql = c.fetchone()[0]
            cons = sorted(re.findall(r'(?:CONSTRAINT "[^"]+" )?CHECK \((?:[^()]|\([^()]*\))*\)',
                                     sql) + re.findall(r"UNIQUE \([^)]*\)", sql))
        out[t] = {"columns": cols, "indexes": idx, "constraints": cons}
print(json.dumps(out, default=str, sort_keys=True))
"""


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()


@pytest.fixture(scope="module")
def development_migrations(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The development migrations as a module of their own (for MIGRATION_MODULES)."""
    last = f"django_dbworker/migrations/{DEVELOPMENT[-1]}.py"
    try:
        removed = _git("log", "--format=%H", "-1", "--", last)
        archive = subprocess.run(
            ["git", "archive", "--format=tar", f"{removed}^", "django_dbworker/migrations"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout
    except (subprocess.CalledProcessError, FileNotFoundError) as exc:
        pytest.skip(f"no git history to take the development migrations from ({exc})")
    if not removed:
        pytest.skip(f"{last} is not in this clone's history")
    root = tmp_path_factory.mktemp("development")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(root, filter="data")
    package = root / "development_migrations"
    (root / "django_dbworker" / "migrations").rename(package)
    assert sorted(p.stem for p in package.glob("0*.py")) == DEVELOPMENT
    return str(root)


@pytest.fixture
def fresh_database() -> Iterator[Callable[[], str]]:
    """Make empty databases on the test server (files for SQLite); drop them after."""
    made: list[str] = []

    def make() -> str:
        name = f"dbworker_schema_{uuid.uuid4().hex[:10]}"
        if connection.vendor == "sqlite":
            name = str(Path(connection.settings_dict["NAME"]).parent / f"{name}.sqlite3")
        else:
            with connection.cursor() as cursor:
                extra = (
                    " CHARACTER SET utf8mb4 COLLATE utf8mb4_unicode_ci"
                    if connection.vendor == "mysql"
                    else ""
                )
                cursor.execute(f"CREATE DATABASE {name}{extra}")
        made.append(name)
        return name

    yield make
    for name in made:
        if connection.vendor == "sqlite":
            for suffix in ("", "-wal", "-shm"):
                Path(name + suffix).unlink(missing_ok=True)
        else:
            with connection.cursor() as cursor:
                cursor.execute(f"DROP DATABASE IF EXISTS {name}")


def _env(name: str, migrations: str | None, path: str | None = None) -> dict[str, str]:
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "DBWORKER_TEST_DB_NAME": name,
        "PYTHONPATH": os.pathsep.join(p for p in (path, str(ROOT)) if p),
    }
    if migrations:
        env["DBWORKER_TEST_MIGRATIONS"] = migrations
    return env


def _schema(env: dict[str, str], target: str | None = None) -> dict[str, dict[str, list]]:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "django",
            "migrate",
            "django_dbworker",
            *([target] if target else []),
            "-v",
            "0",
        ],
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
        timeout=300,
    )
    done = subprocess.run(
        [sys.executable, "-c", DUMP], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_one_migration_builds_what_the_development_migrations_built(
    development_migrations: str, fresh_database: Callable[[], str]
) -> None:
    old = _schema(_env(fresh_database(), "development_migrations", development_migrations))
    new = _schema(_env(fresh_database(), None), "0001_initial")
    assert "django_dbworker_workitem" in new
    assert sorted(old) == sorted(new)
    for table in new:
        for part in ("columns", "indexes", "constraints"):
            assert old[table][part] == new[table][part], (table, part)


def test_a_database_at_the_development_migrations_migrates_only_what_came_after_0001() -> None:
    """What such a database has recorded: ``migrate`` runs only the migrations added since
    0.1's ``0001_initial`` (``migrate --prune`` would delete the names no file has any more),
    then ``run_workers`` starts. None of them may reuse a development migration's name:
    Django would count it as applied."""
    from django.db.migrations.executor import MigrationExecutor

    from django_dbworker import migrations

    shipped = {m.name for m in pkgutil.iter_modules(migrations.__path__) if m.name[:4].isdigit()}
    assert shipped == {"0001_initial", *AFTER_0001}
    assert not set(AFTER_0001) & set(DEVELOPMENT)
    recorder = MigrationRecorder(connection)
    recorded = set(
        recorder.migration_qs.filter(app="django_dbworker").values_list("name", flat=True)
    )
    added = [name for name in DEVELOPMENT if name not in recorded]
    for name in added:
        recorder.record_applied("django_dbworker", name)
    try:
        assert _pending_migrations(connection) == 0
        executor = MigrationExecutor(connection)
        targets = [key for key in executor.loader.graph.leaf_nodes() if key[0] == "django_dbworker"]
        assert executor.migration_plan(targets) == []
        for name in AFTER_0001:
            recorder.record_unapplied("django_dbworker", name)
        executor = MigrationExecutor(connection)
        plan = [migration.name for migration, _ in executor.migration_plan(targets)]
        assert plan == AFTER_0001
    finally:
        for name in AFTER_0001:
            if not recorder.migration_qs.filter(app="django_dbworker", name=name).exists():
                recorder.record_applied("django_dbworker", name)
        for name in added:
            recorder.record_unapplied("django_dbworker", name)


def test_a_database_a_snapshot_left_short_of_the_last_development_migration_is_refused() -> None:
    """Such a database has ``0001_initial`` recorded, so ``migrate`` would find nothing to
    do while its tables lack what 0.1 uses: ``migrate`` and ``check --database`` stop
    with E022, and ``run_workers`` refuses to start, each naming the way out."""
    from django.core.management import call_command
    from django.core.management.base import CommandError

    from django_dbworker.checks import check_development_migrations

    recorder = MigrationRecorder(connection)
    recorded = set(
        recorder.migration_qs.filter(app="django_dbworker").values_list("name", flat=True)
    )
    added = [name for name in DEVELOPMENT[:7] if name not in recorded]
    for name in added:
        recorder.record_applied("django_dbworker", name)
    try:
        [error] = check_development_migrations(databases=["default"])
        assert error.id == "django_dbworker.E022"
        assert "up to 0007_batches_and_dependencies" in error.msg
        assert "0012_rate_start_buckets.py" in error.msg and "migrate" in error.msg
        with pytest.raises(CommandError, match="development snapshot"):
            call_command("run_workers", "--burst")
        assert check_development_migrations(databases=None) == []
    finally:
        for name in added:
            recorder.record_unapplied("django_dbworker", name)
    assert check_development_migrations(databases=["default"]) == []
