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
from pathlib import Path
from typing import Any

import django
import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import User
from django.core.management import call_command
from django.core.management.color import no_style
from django.db import DatabaseError, connections, router, transaction
from django.db.models.functions import Now
from django.test import override_settings

from django_dbworker import EnqueueError, batch, enqueue
from django_dbworker.batches.models import Batch, Dependency
from django_dbworker.checks import check_work_database, not_atomic_warnings
from django_dbworker.contrib.prometheus.collector import register
from django_dbworker.db import operations, setup_problem
from django_dbworker.flow.models import QueueState
from django_dbworker.models import Status, WorkItem
from django_dbworker.retention import PruneFinished, prune
from django_dbworker.routing import NOT_ATOMIC_CHECK, QueueRouter
from django_dbworker.stale import recover_stale
from django_dbworker.testing import run_until_empty
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


# -- after= and a parent of another database ---------------------------------------------
#
# ``after=`` takes work items (or ids), and an item names its own database
# (``item._state.db``): a parent enqueued on the ``work`` alias given to an enqueue that
# goes to ``default`` is refused, not matched by id against ``default``'s rows (an
# unrelated row could have that id), as ``batch()`` refuses the same mismatch.


def test_after_a_parent_of_another_database_is_refused_not_matched_by_id() -> None:
    parent = Noop.enqueue({"n": "parent"}, using=WORK_ALIAS)
    assert parent._state.db == WORK_ALIAS
    # default holds an unrelated row with the same id (ids are per database).
    WorkItem.objects.using("default").filter(pk=parent.pk).delete()
    stranger = WorkItem.objects.using("default").create(
        pk=parent.pk,
        handler="noop",
        payload={"n": "stranger"},
        max_attempts=1,
        status=Status.FAILED,
    )
    default = connections["default"]
    with default.cursor() as cursor:  # default's ids go on after the stranger's
        for sql in default.ops.sequence_reset_sql(no_style(), [WorkItem]):
            cursor.execute(sql)
    try:
        child = Noop.enqueue({"n": "child"}, after=[parent])
    except EnqueueError:
        return  # refused: the parent is not on the child's database
    # Accepted: the child waits for default's row, and is settled by it.
    links = list(
        Dependency.objects.using("default")
        .filter(child_id=child.pk)
        .values_list("parent_id", flat=True)
    )
    child.refresh_from_db()
    pytest.fail(
        f"child #{child.pk} on {child._state.db!r} was linked to {links} there "
        f"(default's row #{stranger.pk}, {stranger.status}) for parent #{parent.pk} on "
        f"{parent._state.db!r}; it is now {child.status}: {child.last_error[:120]!r}"
    )


# -- the enqueue-time warning points at the enqueuing line -------------------------------
#
# The warning of a queue database of its own points at "the enqueuing line"
# (``routing._caller_level``: the first frame outside django-dbworker and Django), so
# that Python shows it once per line of the project's code, also when the project's
# package name starts with "django" (a plain prefix of Django's folder), and not in an
# on-commit callback or another thread, where the enqueue is not in the caller's
# transaction.


def _run_as(filename: str) -> None:
    """Enqueue inside atomic() on default from code whose file is ``filename``."""
    source = "def place_order():\n    Noop.enqueue({'n': 1})\n"
    namespace = {"Noop": Noop}
    exec(compile(source, filename, "exec"), namespace)
    with transaction.atomic():
        namespace["place_order"]()  # type: ignore[operator]


@pytest.mark.parametrize(
    "package",
    [
        # A project's app or a third-party app installed next to Django.
        str(Path(django.__file__).resolve().parent) + "_myapp",
        str(Path(django.__file__).resolve().parent) + "_celery_beat",
    ],
    ids=["django_myapp", "django_celery_beat"],
)
def test_the_warning_points_at_an_enqueue_in_a_package_named_django_something(
    routed: None, package: str
) -> None:
    views = f"{package}/views.py"
    with pytest.warns(RuntimeWarning, match="writes to database 'work'") as record:
        _run_as(views)
    assert record[0].filename == views, record[0].filename


def test_control_an_enqueue_in_any_other_package_is_pointed_at(routed: None) -> None:
    views = str(Path(django.__file__).resolve().parent.parent / "myapp" / "views.py")
    with pytest.warns(RuntimeWarning) as record:
        _run_as(views)
    assert record[0].filename == views


def _enqueuing_view(request: object) -> object:
    from django.http import HttpResponse

    Noop.enqueue({"n": "view"})  # the line the warning must name
    return HttpResponse("ok")


urlpatterns = [__import__("django.urls").urls.path("enqueue/", _enqueuing_view)]


def test_a_view_under_atomic_requests_is_warned_at_its_enqueue(routed: None) -> None:
    from django.db import connections
    from django.test import Client

    default = connections["default"]
    default.settings_dict["ATOMIC_REQUESTS"] = True
    try:
        with (
            override_settings(ROOT_URLCONF=__name__),
            pytest.warns(RuntimeWarning, match="open on 'default'") as record,
        ):
            assert Client().get("/enqueue/").status_code == 200
    finally:
        default.settings_dict["ATOMIC_REQUESTS"] = False
    assert record[0].filename == __file__
    assert record[0].lineno == _enqueuing_view.__code__.co_firstlineno + 3


def test_no_warning_in_an_on_commit_callback_or_another_thread(routed: None) -> None:
    import threading
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with transaction.atomic():
            transaction.on_commit(lambda: Noop.enqueue({"n": "later"}))
            errors: list[BaseException] = []

            def elsewhere() -> None:
                try:
                    Noop.enqueue({"n": "thread"})
                except BaseException as exc:
                    errors.append(exc)
                finally:
                    from django.db import connections

                    connections.close_all()

            thread = threading.Thread(target=elsewhere)
            thread.start()
            thread.join(30)
            assert errors == []


# -- run_until_empty keeps a caller's transactions on other aliases ----------------------
#
# A worker thread tidies every connection it opened after each job, leaving alone a
# caller's transaction: in Django's manual transaction mode (``set_autocommit(False)``,
# ``AUTOCOMMIT: False``) too, where ``in_atomic_block`` is False. ``run_until_empty``
# (the calling thread, the caller's connections) keeps the caller's uncommitted writes
# on the other alias and its autocommit setting.


@pytest.fixture
def manual_on_other_alias() -> Iterator[None]:
    transaction.set_autocommit(False, using=WORK_ALIAS)
    try:
        yield
    finally:
        if not connections[WORK_ALIAS].get_autocommit():
            transaction.rollback(using=WORK_ALIAS)
            transaction.set_autocommit(True, using=WORK_ALIAS)


def test_run_until_empty_keeps_a_manual_transaction_on_another_alias(
    manual_on_other_alias: None,
) -> None:
    # The caller's uncommitted write on the other alias (any table will do).
    mine = WorkItem.objects.using(WORK_ALIAS).create(
        handler="noop", payload={"mine": True}, max_attempts=1, status=Status.SUCCEEDED
    )
    Noop.enqueue({"n": 1})  # the work: on default
    counts = run_until_empty()
    assert counts.get("succeeded") == 1, counts
    still_manual = not connections[WORK_ALIAS].get_autocommit()
    transaction.commit(using=WORK_ALIAS)
    kept = WorkItem.objects.using(WORK_ALIAS).filter(pk=mine.pk).exists()
    assert still_manual and kept, (
        f"run_until_empty on default tidied the caller's manual transaction on "
        f"{WORK_ALIAS!r}: autocommit turned back on: {not still_manual}; its "
        f"uncommitted row #{mine.pk} kept: {kept}"
    )


# The enqueue on default inside work's atomic block is meant: the warning says so.
@pytest.mark.filterwarnings("ignore:This enqueue writes to database:RuntimeWarning")
def test_run_until_empty_keeps_an_atomic_block_on_another_alias() -> None:
    """Control: the caller's ``atomic()`` on the other alias is left alone."""
    with transaction.atomic(using=WORK_ALIAS):
        mine = WorkItem.objects.using(WORK_ALIAS).create(
            handler="noop", payload={"mine": True}, max_attempts=1, status=Status.SUCCEEDED
        )
        Noop.enqueue({"n": 1})
        assert run_until_empty().get("succeeded") == 1
    assert WorkItem.objects.using(WORK_ALIAS).filter(pk=mine.pk).exists()


@pytest.mark.django_db(transaction=False, databases="__all__")
def test_run_until_empty_in_a_testcase_on_every_alias_keeps_its_writes() -> None:
    """Control: a TestCase's transactions on every alias are left alone."""
    mine = WorkItem.objects.using(WORK_ALIAS).create(
        handler="noop", payload={"mine": True}, max_attempts=1, status=Status.SUCCEEDED
    )
    Noop.enqueue({"n": 1})
    assert run_until_empty().get("succeeded") == 1
    assert connections[WORK_ALIAS].in_atomic_block
    assert WorkItem.objects.using(WORK_ALIAS).filter(pk=mine.pk).exists()
