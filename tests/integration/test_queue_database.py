"""A queue database of its own: the shipped router, transactions across two databases.

The work tables live on the ``work`` alias (a second database on the same
server, tests/settings.py), sent there by ``django_dbworker.routing.QueueRouter``;
the project's other tables stay on ``default``. Transactions are per alias,
so an enqueue is atomic only with a transaction on the work alias: what it
says when the caller has one open on ``default`` instead, and the two
patterns that do what such a caller means.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import User
from django.core.management import call_command
from django.db import DatabaseError, connections, router, transaction
from django.db.models.functions import Now
from django.test import override_settings

from django_dbworker import batch, enqueue
from django_dbworker.batches.models import Batch, Dependency
from django_dbworker.checks import check_work_database, not_atomic_warnings
from django_dbworker.contrib.prometheus.collector import register
from django_dbworker.db import operations, setup_problem
from django_dbworker.flow.models import QueueState
from django_dbworker.models import Status, WorkItem
from django_dbworker.retention import PruneFinished, prune
from django_dbworker.routing import NOT_ATOMIC_CHECK, QueueRouter
from django_dbworker.stale import recover_stale
from tests.factories import age_heartbeat
from tests.routers import WORK_ALIAS
from tests.testapp.models import Effect
from tests.testapp.workers import Echo, Noop

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", WORK_ALIAS])


def rows(alias: str) -> Any:
    return WorkItem.objects.using(alias)


# -- the router ---------------------------------------------------------------


def test_queue_router_keeps_the_work_tables_and_only_them_on_its_alias() -> None:
    r = QueueRouter()
    for model in (WorkItem, Batch, Dependency, QueueState):
        assert r.db_for_read(model) == r.db_for_write(model) == "queue"
        assert r.allow_migrate("queue", "django_dbworker", model._meta.model_name) is True
        assert r.allow_migrate("default", "django_dbworker", model._meta.model_name) is False
    # Everything else is the next router's (default without one), never the queue's.
    for model in (User, LogEntry, Effect):
        assert r.db_for_read(model) is None and r.db_for_write(model) is None
        assert r.allow_migrate("queue", model._meta.app_label) is False
        assert r.allow_migrate("default", model._meta.app_label) is None
    # RunPython/RunSQL in the app's migrations ask without a model.
    assert r.allow_migrate("queue", "django_dbworker") is True
    assert r.allow_migrate("default", "django_dbworker") is False
    item, user = WorkItem(handler="noop"), User(username="u")
    assert r.allow_relation(item, Batch()) is True
    assert r.allow_relation(item, user) is False
    assert r.allow_relation(user, LogEntry()) is None


def test_a_subclass_names_another_alias(routed: None) -> None:
    assert router.db_for_write(WorkItem) == router.db_for_read(Batch) == WORK_ALIAS
    assert router.db_for_write(User) == "default"
    assert router.allow_migrate_model(WORK_ALIAS, WorkItem)
    assert not router.allow_migrate_model("default", WorkItem)
    assert not router.allow_migrate_model(WORK_ALIAS, User)


# -- the system check -----------------------------------------------------------


def test_no_warning_while_the_work_is_on_default() -> None:
    assert check_work_database() == []


def test_the_check_warns_when_the_work_is_on_another_alias(routed: None) -> None:
    [warning] = check_work_database()
    assert warning.id == NOT_ATOMIC_CHECK == "django_dbworker.W006"
    assert "written to database 'work'" in warning.msg
    assert "not 'default'" in warning.msg
    assert "ATOMIC_REQUESTS" not in warning.msg
    assert "transaction.on_commit(lambda: Handler.enqueue(...), using='default')" in str(
        warning.hint
    )
    assert "transaction.atomic(using='work')" in str(warning.hint)


def test_the_check_names_atomic_requests(settings: Any) -> None:
    databases = {**settings.DATABASES}
    databases["default"] = {**databases["default"], "ATOMIC_REQUESTS": True}
    [warning] = not_atomic_warnings(WORK_ALIAS, databases)
    assert "every request: ATOMIC_REQUESTS on 'default'" in warning.msg
    # The work on default and requests atomic on default: one transaction, nothing to say.
    assert not_atomic_warnings("default", databases) == []
    # Requests atomic on the work alias only: default's atomic() is still another one.
    databases = {**settings.DATABASES}
    databases[WORK_ALIAS] = {**databases[WORK_ALIAS], "ATOMIC_REQUESTS": True}
    [warning] = not_atomic_warnings(WORK_ALIAS, databases)
    assert "ATOMIC_REQUESTS" not in warning.msg


# -- enqueue inside a transaction of another database ---------------------------------


def test_enqueue_in_atomic_on_default_commits_at_once_and_says_so(routed: None) -> None:
    with transaction.atomic():
        Effect.objects.create(key="order")
        with pytest.warns(RuntimeWarning, match="writes to database 'work', where no transaction"):
            Noop.enqueue({"n": 1})
        transaction.set_rollback(True)
    # The caller's data rolled back; the item did not: it was never part of it.
    assert not Effect.objects.filter(key="order").exists()
    assert rows(WORK_ALIAS).count() == 1


def test_the_warning_points_at_the_enqueuing_line(routed: None) -> None:
    with pytest.warns(RuntimeWarning) as record, transaction.atomic():
        Noop.enqueue_many([{"n": 1}, {"n": 2}])
    assert record[0].filename == __file__


def test_every_way_in_warns(routed: None) -> None:
    from tests.testapp.tasks import add

    with transaction.atomic():
        with pytest.warns(RuntimeWarning):
            enqueue("noop", {"n": 1})
        with pytest.warns(RuntimeWarning):
            add.enqueue(1, 2)
        # Once, for the batch; its items are in its transaction.
        with pytest.warns(RuntimeWarning) as record, batch(on_complete=Noop):
            Noop.enqueue({"n": 2})
        assert len(record) == 1
    assert rows(WORK_ALIAS).count() == 3


@pytest.mark.parametrize("commit", [True, False])
def test_on_commit_enqueues_only_once_the_data_has_committed(routed: None, commit: bool) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with transaction.atomic():
            Effect.objects.create(key="order")
            transaction.on_commit(lambda: Noop.enqueue({"n": 1}), using="default")
            assert not rows(WORK_ALIAS).exists()
            transaction.set_rollback(not commit)
    assert rows(WORK_ALIAS).count() == int(commit)


def test_atomic_on_the_work_alias_groups_enqueues(routed: None) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with transaction.atomic(), transaction.atomic(using=WORK_ALIAS):
            Noop.enqueue({"n": 1})
            Noop.enqueue_many([{"n": 2}])
            transaction.set_rollback(True, using=WORK_ALIAS)
    assert not rows(WORK_ALIAS).exists()


def test_no_warning_without_a_transaction_or_once_silenced(routed: None) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Noop.enqueue({"n": 1})
        with override_settings(SILENCED_SYSTEM_CHECKS=[NOT_ATOMIC_CHECK]), transaction.atomic():
            Noop.enqueue({"n": 2})
    assert rows(WORK_ALIAS).count() == 2


def test_no_warning_when_work_and_transaction_share_the_alias() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with transaction.atomic():
            Noop.enqueue({"n": 1})
            transaction.set_rollback(True)
    assert not rows("default").exists()


# -- the retention run prunes where it runs ---------------------------------------------


@pytest.fixture
def queue_collector() -> Iterator[None]:
    # run_workers takes the web process's queue collector off the global registry.
    yield
    register()


def test_the_retention_run_prunes_the_database_its_worker_runs_on(queue_collector: None) -> None:
    """``run_workers --database work`` without routers: its hourly retention run prunes ``work``."""
    old = {}
    for alias in ("default", WORK_ALIAS):
        old[alias] = WorkItem.objects.using(alias).create(
            handler="noop", payload={}, max_attempts=1, status=Status.SUCCEEDED
        )
        WorkItem.objects.using(alias).filter(pk=old[alias].pk).update(
            finished_at=Now() - timedelta(days=10)
        )
    PruneFinished.enqueue(using=WORK_ALIAS)
    call_command("run_workers", PruneFinished.name, "--burst", "--database", WORK_ALIAS)
    assert not rows(WORK_ALIAS).filter(pk=old[WORK_ALIAS].pk).exists()
    assert rows("default").filter(pk=old["default"].pk).exists()


# -- internal entry points without an alias follow the routers as a whole ------------------


def test_stale_recovery_without_an_alias_settles_on_the_routed_alias(routed: None) -> None:
    """A row recovered for the last time ends its batch there, not on ``default``."""

    with batch(on_complete=Echo) as b:
        item = enqueue("noop", {"n": 1}, max_attempts=1)
    [claimed] = operations(WORK_ALIAS).claim(
        limit=1, handlers=["noop"], queues=None, worker="test:1:main", limits=None
    )
    assert claimed._state.db == WORK_ALIAS
    age_heartbeat(item, 3600)
    assert recover_stale(stale_after=60, log=False).failed == 1
    assert rows(WORK_ALIAS).get(pk=item.pk).status == Status.FAILED
    assert Batch.objects.using(WORK_ALIAS).get(pk=b.pk).completed_at is not None


def test_prune_without_an_alias_opens_its_transactions_on_the_routed_alias(routed: None) -> None:

    old = Noop.enqueue({"n": 1})
    rows(WORK_ALIAS).filter(pk=old.pk).update(
        status=Status.SUCCEEDED, finished_at=Now() - timedelta(days=10)
    )
    seen: list[bool] = []

    def record(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        if sql.startswith("DELETE"):
            seen.append(connections["default"].in_atomic_block)
        return execute(sql, params, many, context)

    with connections[WORK_ALIAS].execute_wrapper(record):
        assert prune(older_than=timedelta(days=7), statuses=[Status.SUCCEEDED]) == 1
    assert seen and not any(seen), "a transaction on default around the queue's deletes"


def test_vendor_operations_without_an_alias_are_the_routed_alias(routed: None) -> None:
    assert operations().using == WORK_ALIAS
    assert operations("default").using == "default"


def test_a_missing_work_table_on_the_queue_database_names_its_migrate_command() -> None:
    def missing_table(alias: str) -> DatabaseError:
        with pytest.raises(DatabaseError) as missing, connections[alias].cursor() as cursor:
            cursor.execute("SELECT id FROM django_dbworker_no_such_table")
        return missing.value

    problem = setup_problem(WORK_ALIAS, missing_table(WORK_ALIAS))
    assert problem is not None and "`manage.py migrate --database work`" in problem
    assert "run `manage.py migrate` first" in str(
        setup_problem("default", missing_table("default"))
    )
