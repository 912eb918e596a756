"""``run_workers``' start-up check of django_dbworker's migrations (a fast start).

The check reads ``django_migrations`` against the shipped migration files
instead of building every app's migration graph; these tests hold it to the
graph's answer.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.db.migrations.recorder import MigrationRecorder
from django.test import override_settings

import django_dbworker
from django_dbworker.management.commands.run_workers import _pending_migrations

pytestmark = pytest.mark.django_db

#: The newest migration: a graph counts an unapplied one only below no applied child.
LATEST = max(
    path.stem for path in (Path(django_dbworker.__file__).parent / "migrations").glob("0*.py")
)


def _graph_plan() -> int:
    executor = MigrationExecutor(connection)
    targets = [key for key in executor.loader.graph.leaf_nodes() if key[0] == "django_dbworker"]
    return len(executor.migration_plan(targets))


def test_a_migrated_database_has_nothing_pending() -> None:
    assert _pending_migrations(connection) == 0 == _graph_plan()


def test_unapplied_migrations_are_counted_as_the_graph_counts_them() -> None:
    recorded = MigrationRecorder(connection).migration_qs.filter(app="django_dbworker")
    names = list(recorded.order_by("-name").values_list("name", flat=True)[:2])
    recorded.filter(name__in=names).delete()
    assert _pending_migrations(connection) == len(names) == _graph_plan()


def test_another_apps_rows_do_not_count() -> None:
    recorded = MigrationRecorder(connection).migration_qs
    recorded.create(app="other_app", name=LATEST)
    recorded.filter(app="django_dbworker", name=LATEST).delete()
    assert _pending_migrations(connection) == 1 == _graph_plan()


@override_settings(MIGRATION_MODULES={"django_dbworker": "django_dbworker.migrations"})
def test_moved_migrations_are_read_from_the_graph() -> None:
    MigrationRecorder(connection).migration_qs.filter(app="django_dbworker", name=LATEST).delete()
    assert _pending_migrations(connection) == 1
