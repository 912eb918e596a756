"""Fenced transitions and stale recovery, identical on every database."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.db.models.functions import Now

from django_dbworker import transitions
from django_dbworker.models import Status, WorkItem
from tests.factories import age_heartbeat, claim, make_item

# The PgBouncer leg runs these too: claims and transitions through a transaction-mode pooler.
pytestmark = [pytest.mark.django_db, pytest.mark.pgbouncer]


def test_succeed_records_result_and_finish_time() -> None:
    make_item()
    (item,) = claim()
    assert transitions.succeed([(item.pk, item.claim_token, '{"ok": true}')]) == {
        (item.pk, item.claim_token)
    }
    row = WorkItem.objects.get()
    assert row.status == Status.SUCCEEDED
    assert row.result == {"ok": True}
    assert row.finished_at is not None


def test_writes_under_a_stale_token_are_fenced_out() -> None:
    make_item()
    (item,) = claim()
    WorkItem.objects.update(status=Status.PENDING)  # recovered...
    (newer,) = claim()  # ...and claimed again
    assert not transitions.succeed([(item.pk, item.claim_token, '"late"')])
    assert not transitions.fail(item, error="late")
    assert not transitions.retry_later(item, delay=0, error="late")
    assert transitions.release([item]) == 0
    row = WorkItem.objects.get()
    assert row.status == Status.CLAIMED and row.claim_token == newer.claim_token
    assert row.result is None and row.last_error == ""


def test_retry_later_schedules_on_the_database_clock() -> None:
    make_item()
    (item,) = claim()
    assert transitions.retry_later(item, delay=3600, error="boom")
    row = WorkItem.objects.get()
    assert row.status == Status.PENDING and row.last_error == "boom"
    assert row.claim_token is None
    assert WorkItem.objects.filter(run_after__gt=Now()).count() == 1
    assert claim() == []


def test_heartbeat_reports_lost_claims() -> None:
    make_item()
    make_item()
    a, b = claim()
    WorkItem.objects.filter(pk=b.pk).update(status=Status.PENDING, claim_token=None)
    held = transitions.heartbeat({(a.pk, a.claim_token), (b.pk, b.claim_token)})
    assert held == {(a.pk, a.claim_token)}


def test_heartbeat_with_a_foreign_token_does_not_touch_the_row() -> None:
    make_item()
    (a,) = claim()
    age_heartbeat(a, 100)
    assert transitions.heartbeat({(a.pk, uuid.uuid4())}) == set()
    assert WorkItem.objects.stale(__import__("datetime").timedelta(seconds=50)).count() == 1


def test_heartbeat_tells_two_attempts_of_one_row_apart() -> None:
    make_item()
    (a,) = claim()
    old_token = uuid.uuid4()  # a superseded attempt of the same row
    held = transitions.heartbeat({(a.pk, old_token), (a.pk, a.claim_token)})
    assert held == {(a.pk, a.claim_token)}


def test_succeed_many_tells_two_attempts_of_one_row_apart() -> None:

    make_item()
    (a,) = claim()
    done = transitions.succeed([(a.pk, uuid.uuid4(), '"late"'), (a.pk, a.claim_token, "1")])
    assert done == {(a.pk, a.claim_token)}
    assert WorkItem.objects.get(pk=a.pk).result == 1


def test_release_hands_the_attempt_back() -> None:
    make_item()
    (item,) = claim()
    assert transitions.release([item]) == 1
    row = WorkItem.objects.get()
    assert row.status == Status.PENDING and row.attempts == 0 and row.claim_token is None


def test_stale_rows_are_requeued_and_the_lost_run_counts() -> None:
    make_item()
    (item,) = claim(worker="deadhost:1:t")
    age_heartbeat(item, 120)
    result = transitions.recover_stale(stale_after=60)
    assert (result.requeued, result.failed, result.by_handler) == (1, 0, {"noop": 1})
    row = WorkItem.objects.get()
    assert row.status == Status.PENDING and row.attempts == 1
    assert "deadhost:1:t" in row.last_error and "stale" in row.last_error
    assert not transitions.succeed([(item.pk, item.claim_token, '"late"')])


def test_fresh_heartbeats_are_not_stale() -> None:
    make_item()
    (item,) = claim()
    age_heartbeat(item, 30)
    assert transitions.recover_stale(stale_after=60).total == 0
    assert WorkItem.objects.get().status == Status.CLAIMED


def test_stale_rows_with_attempts_used_up_end_failed() -> None:
    make_item(attempts=2, max_attempts=3)
    (item,) = claim()
    assert item.attempts == 3
    age_heartbeat(item, 120)
    result = transitions.recover_stale(stale_after=60)
    assert (result.requeued, result.failed) == (0, 1)
    row = WorkItem.objects.get()
    assert row.status == Status.FAILED and row.finished_at is not None
    assert "attempts used up" in row.last_error


def test_recovery_is_idempotent_and_batched() -> None:
    for _ in range(7):
        make_item()
    for item in claim():
        age_heartbeat(item, 120)
    assert transitions.recover_stale(stale_after=60, batch_size=3).requeued == 7
    assert transitions.recover_stale(stale_after=60, batch_size=3).total == 0


def test_recovery_can_be_limited_to_handlers() -> None:
    make_item(handler="noop")
    make_item(handler="echo")
    for item in claim():
        age_heartbeat(item, 120)
    assert transitions.recover_stale(stale_after=60, handlers=["echo"]).by_handler == {"echo": 1}
    assert WorkItem.objects.get(handler="noop").status == Status.CLAIMED


def test_operator_transitions_only_touch_eligible_rows() -> None:
    pending = make_item()
    failed = make_item(status=Status.FAILED, attempts=3)
    claimed = make_item(status=Status.CLAIMED)
    everything = WorkItem.objects.all()
    assert everything.retry() == 1
    row = WorkItem.objects.get(pk=failed.pk)
    assert row.status == Status.PENDING and row.attempts == 0
    assert WorkItem.objects.filter(pk__in=[pending.pk, claimed.pk]).cancel() == 1
    assert WorkItem.objects.get(pk=pending.pk).status == Status.CANCELLED
    assert WorkItem.objects.get(pk=claimed.pk).status == Status.CLAIMED
    assert everything.run_now() == 1


def test_model_methods_delegate_to_transitions() -> None:
    item = make_item()
    assert item.cancel() and item.status == Status.CANCELLED
    assert not item.cancel()
    assert item.retry() and item.status == Status.PENDING
    assert item.run_now()


def test_succeed_many_is_fenced_per_row() -> None:

    for _ in range(4):
        make_item()
    a, b, c, d = claim()
    WorkItem.objects.filter(pk=b.pk).update(status=Status.PENDING)  # recovered...
    (b_again,) = claim(limit=1)  # ...and re-claimed under a new token
    done = transitions.succeed(
        [
            (a.pk, a.claim_token, '{"n": 1}'),
            (b.pk, b.claim_token, '"late"'),
            (c.pk, c.claim_token, None),
            (d.pk, uuid.uuid4(), "1"),
        ]
    )
    assert done == {(a.pk, a.claim_token), (c.pk, c.claim_token)}
    rows = {r.pk: r for r in WorkItem.objects.all()}
    assert (rows[a.pk].status, rows[a.pk].result) == (Status.SUCCEEDED, {"n": 1})
    assert (rows[c.pk].status, rows[c.pk].result) == (Status.SUCCEEDED, None)
    assert rows[c.pk].finished_at is not None
    assert rows[b.pk].status == Status.CLAIMED and rows[b.pk].claim_token == b_again.claim_token
    assert rows[d.pk].status == Status.CLAIMED
    assert transitions.succeed([]) == set()


def test_retry_skips_rows_whose_unique_key_is_live_again() -> None:
    old = make_item(handler="echo", status=Status.FAILED, unique_key="k")
    other = make_item(handler="echo", status=Status.FAILED, unique_key="k2")
    make_item(handler="echo", unique_key="k")  # a newer live row holds the key
    assert WorkItem.objects.filter(pk__in=[old.pk, other.pk]).retry() == 1
    assert WorkItem.objects.get(pk=old.pk).status == Status.FAILED
    assert WorkItem.objects.get(pk=other.pk).status == Status.PENDING


def test_every_attempt_that_ends_without_success_joins_the_error_history() -> None:
    make_item(max_attempts=5)
    (first,) = claim(worker="host:1:a")
    assert transitions.retry_later(first, delay=0, error="boom 1", error_class="x.Boom")
    due_now = {"run_after": Now() - timedelta(seconds=1)}
    WorkItem.objects.update(**due_now)
    (second,) = claim(worker="host:2:b")
    age_heartbeat(second, 120)
    assert transitions.recover_stale(stale_after=60).requeued == 1
    WorkItem.objects.update(**due_now)
    (third,) = claim(worker="host:3:c")
    assert transitions.fail(third, error="boom 3", error_class="builtins.ValueError")
    row = WorkItem.objects.get()
    history = row.error_history
    assert [e["attempt"] for e in history] == [1, 2, 3]
    assert [e["worker"] for e in history] == ["host:1:a", "host:2:b", "host:3:c"]
    assert [e["exception_class_path"] for e in history] == [
        "x.Boom",
        transitions.WORKER_LOST,
        "builtins.ValueError",
    ]
    assert history[0]["error"] == "boom 1" and "no heartbeat" in history[1]["error"]
    assert all(e["started_at"] and e["finished_at"] for e in history)
    # What stale recovery names is a real exception class.
    from django.utils.module_loading import import_string

    from django_dbworker.errors import WorkerLost

    assert import_string(transitions.WORKER_LOST) is WorkerLost


def test_the_error_history_keeps_the_newest_entries() -> None:
    from django_dbworker.models import ERROR_HISTORY_LIMIT

    item = make_item(max_attempts=100)
    old = [{"attempt": n, "error": f"old {n}"} for n in range(ERROR_HISTORY_LIMIT)]
    WorkItem.objects.filter(pk=item.pk).update(error_history=old)
    (claimed,) = claim()
    assert transitions.retry_later(claimed, delay=0, error="newest")
    history = WorkItem.objects.get().error_history
    assert len(history) == ERROR_HISTORY_LIMIT
    assert history[0]["error"] == "old 1" and history[-1]["error"] == "newest"


def test_successes_and_releases_leave_the_error_history_alone() -> None:
    make_item()
    make_item()
    a, b = claim()
    assert transitions.succeed([(a.pk, a.claim_token, None)])
    assert transitions.release([b]) == 1
    assert list(WorkItem.objects.values_list("error_history", flat=True)) == [None, None]
