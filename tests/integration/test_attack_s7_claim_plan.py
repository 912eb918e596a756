"""Attack (session 7) on the PostgreSQL claim sent with ``CLAIM_PLAN`` in one message.

In autocommit and outside ``atomic()``, ``claim`` sends ``SET LOCAL
enable_sort = off; SET LOCAL enable_incremental_sort = off;`` and the claim
as one simple-protocol message on a ``psycopg.ClientCursor`` (parameters
quoted on the client). What must hold: the settings end with the claim; the
quoting is exact for any name; the rows read back as on the bound path; a
claim that fails leaves the connection idle and usable; Django's wrappers see
it; and the plan is the claim index's, fresh statistics or stale.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from django.db import OperationalError, connection, transaction
from django.test.utils import CaptureQueriesContext
from psycopg.pq import TransactionStatus

from bench.bigtable import fill
from django_dbworker.db import operations
from django_dbworker.db.sql import CLAIM_COLUMNS
from django_dbworker.models import WorkItem
from tests.factories import auto_explained, make_item

pytestmark = [pytest.mark.postgres_only, pytest.mark.django_db(transaction=True)]

TABLE = "django_dbworker_workitem"


def _show(name: str) -> str:
    with connection.cursor() as cursor:
        cursor.execute(f"SHOW {name}")
        return str(cursor.fetchone()[0])


def _claim(handlers: list[str], queues: list[str] | None = None, **kw: Any) -> list[WorkItem]:
    return operations().claim(
        limit=kw.pop("limit", 10),
        handlers=handlers,
        queues=queues,
        worker=kw.pop("worker", "test:1:main"),
        limits=None,
    )


def test_the_settings_end_with_the_claim() -> None:
    make_item("noop")
    connection.ensure_connection()
    with CaptureQueriesContext(connection) as queries:
        assert len(_claim(["noop"])) == 1
    assert any("SET LOCAL enable_sort = off" in q["sql"] for q in queries.captured_queries)
    assert connection.connection.info.transaction_status == TransactionStatus.IDLE
    assert _show("enable_sort") == "on" and _show("enable_incremental_sort") == "on"


def test_inside_a_callers_transaction_the_settings_never_apply() -> None:
    make_item("noop")
    with transaction.atomic():
        assert len(_claim(["noop"])) == 1
        assert _show("enable_sort") == "on" and _show("enable_incremental_sort") == "on"
    assert _show("enable_sort") == "on"


def test_manual_autocommit_off_never_sends_the_settings() -> None:
    make_item("noop")
    transaction.set_autocommit(False)
    try:
        with CaptureQueriesContext(connection) as queries:
            assert len(_claim(["noop"])) == 1
        assert not any("SET LOCAL" in q["sql"] for q in queries.captured_queries)
        assert _show("enable_sort") == "on"
        transaction.commit()
    finally:
        transaction.set_autocommit(True)


NAMES = [
    "o'k",
    'q"x',
    "back\\slash",
    "NULL",
    "null",
    "a,b",
    "{x}",
    " spaced ",
    "é☃ 日本 🙂",
    "%(limit)s",
    "%s",
    "semi; DROP TABLE x; --",
    "x" * 200,
]


def test_any_handler_name_is_quoted_exactly() -> None:
    items = {name: make_item(name) for name in NAMES}
    make_item("other")  # not asked for
    claimed = _claim(NAMES, limit=50)
    assert sorted(i.handler for i in claimed) == sorted(NAMES)
    assert {i.pk for i in claimed} == {i.pk for i in items.values()}


@pytest.mark.parametrize("queue", ["a:b.c-d_e", "q" * 100])
def test_queue_and_worker_names_are_quoted_exactly(queue: str) -> None:
    item = make_item("noop", queue=queue)
    make_item("noop", queue="elsewhere")
    worker = 'h\'o\\st é "x":12345:Thread-1 %(worker)s ' + "w" * 200
    worker = worker[:255]
    [claimed] = _claim(["noop"], [queue], worker=worker)
    assert claimed.pk == item.pk
    assert claimed.claimed_by == worker
    assert WorkItem.objects.get(pk=item.pk).claimed_by == worker


def test_claimed_rows_read_back_as_the_table_holds_them() -> None:
    item = make_item("noop", payload={"s": "é\\'\"", "n": [1, None]}, priority=5)
    [claimed] = _claim(["noop"])
    stored = WorkItem.objects.get(pk=item.pk)
    for field in ("run_after", "priority", "payload", "attempts", "claimed_by", "claim_token"):
        assert getattr(claimed, field) == getattr(stored, field), field
    assert claimed.run_after.utcoffset() is not None
    assert claimed.run_after.utcoffset().total_seconds() == 0
    assert claimed.run_after == stored.run_after


def test_a_claim_that_fails_leaves_the_connection_idle_and_usable() -> None:
    make_item("noop")
    connection.ensure_connection()
    params = connection.get_connection_params()
    with psycopg.connect(**params) as holder:
        holder.execute("LOCK TABLE django_dbworker_queuestate IN ACCESS EXCLUSIVE MODE")
        with connection.cursor() as cursor:
            cursor.execute("SET lock_timeout = '100ms'")
        try:
            with pytest.raises(OperationalError, match="lock timeout"):
                _claim(["noop"])
            assert connection.connection.info.transaction_status == TransactionStatus.IDLE
        finally:
            with connection.cursor() as cursor:
                cursor.execute("RESET lock_timeout")
        holder.rollback()
    assert _show("enable_sort") == "on"
    assert len(_claim(["noop"])) == 1


def test_execute_wrappers_see_the_claim() -> None:
    make_item("noop")
    connection.ensure_connection()
    seen: list[str] = []

    def record(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        seen.append(sql)
        return execute(sql, params, many, context)

    with connection.execute_wrapper(record):
        assert len(_claim(["noop"])) == 1
    assert any("UPDATE django_dbworker_workitem" in sql for sql in seen), seen


def _claim_plans(queues: list[str] | None, limit: int) -> list[str]:
    """The plans the server chose for the statements of one claim (auto_explain notices)."""
    # The fill's pending rows are of these two handlers.
    claimed, notices = auto_explained(lambda: _claim(["echo", "record"], queues, limit=limit))
    assert len(claimed) == limit
    return [n for n in notices if "Update on" in n]


@pytest.mark.parametrize(
    ("queues", "index"), [(None, "dbworker_claim_idx"), (["urgent"], "dbworker_claim_queue_idx")]
)
def test_fresh_statistics_on_a_big_table_keep_the_index_path(
    queues: list[str] | None, index: str
) -> None:
    fill(100_000)
    (plan,) = _claim_plans(queues, limit=8)
    assert f"Index Scan using {index}" in plan, plan
    assert "Sort" not in plan and f"Seq Scan on {TABLE}" not in plan, plan


#: The claimed columns, as the ORM names them (``id`` is ``pk``).
FIELDS = ("pk", *CLAIM_COLUMNS[1:])


def _fields(item: WorkItem) -> dict[str, tuple[type, Any]]:
    return {f: (type(getattr(item, f)), getattr(item, f)) for f in FIELDS}


@pytest.mark.parametrize("time_zone", ["UTC", "America/New_York", "Asia/Kolkata"])
def test_both_paths_read_rows_alike_whatever_the_time_zone(time_zone: str) -> None:
    from django.test import override_settings

    with override_settings(TIME_ZONE=time_zone):
        connection.close()  # a new session, in the new setting's time zone
        try:
            a = make_item("noop", payload={"k": "é"}, trace_context={"traceparent": "x"})
            [one_message] = _claim(["noop"])  # CLAIM_PLAN, ClientCursor
            b = make_item("noop", payload={"k": "é"}, trace_context={"traceparent": "x"})
            with transaction.atomic():
                [bound] = _claim(["noop"])  # server-side binding
        finally:
            connection.close()
    got_a, got_b = _fields(one_message), _fields(bound)
    for field in FIELDS:
        assert got_a[field][0] is got_b[field][0], (field, got_a[field], got_b[field])
    for item, stored in ((one_message, a), (bound, b)):
        stored.refresh_from_db()
        assert item.run_after == stored.run_after
        assert item.run_after.utcoffset() is not None
        assert item.run_after.tzinfo == stored.run_after.tzinfo


@pytest.mark.parametrize(
    "options",
    [{"server_side_binding": True}, {"prepare_threshold": 0}, {"isolation_level": 3}],
    ids=["server_side_binding", "prepare_threshold", "serializable"],
)
def test_connection_options_keep_the_claim_and_its_settings_to_itself(
    options: dict[str, Any],
) -> None:
    """OPTIONS that change Django's cursors or transactions (set on a new session)."""
    saved = dict(connection.settings_dict["OPTIONS"])
    connection.close()
    connection.settings_dict["OPTIONS"] = {**saved, **options}
    try:
        make_item("noop")
        make_item("noop")
        raw = connection.connection
        if "prepare_threshold" in options:
            assert raw.prepare_threshold == 0
        if "isolation_level" in options:
            assert int(raw.isolation_level) == 3
        if "server_side_binding" in options:
            assert raw.cursor_factory is not psycopg.ClientCursor
        for _ in range(2):  # twice: a prepared statement would be used the second time
            with CaptureQueriesContext(connection) as queries:
                assert len(_claim(["noop"], limit=1)) == 1
            assert any("SET LOCAL" in q["sql"] for q in queries.captured_queries)
            assert _show("enable_sort") == "on"
            assert connection.connection.info.transaction_status == TransactionStatus.IDLE
        with transaction.atomic():
            assert _show("enable_sort") == "on"
    finally:
        connection.close()
        connection.settings_dict["OPTIONS"] = saved
