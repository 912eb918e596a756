"""The batch finisher's races, interleaved on purpose (PostgreSQL, MariaDB).

Two endings of one batch's last items commit at the same moment, each
seeing the other's row unfinished: the callback must still be enqueued,
once. The success writer's quick path skips the batch row's lock when it
can share-lock a pending item (``db/batch_probe.py``); these tests hold a
finisher's transaction open right after that probe (or right after its
lock-path read) and run the other ending meanwhile.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from django.db import close_old_connections, connection

from django_dbworker import batch, transitions
from django_dbworker.batches import completion
from django_dbworker.batches.models import Batch
from django_dbworker.models import Status, WorkItem
from tests.conftest import lock_waiters, wait_until
from tests.factories import claim
from tests.testapp.workers import BatchDone, Noop

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.server_db]


def _in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # reported by the test
            errors.append(exc)
        finally:
            close_old_connections()
            connection.close()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, errors


def _callbacks(batch_id: int) -> int:
    return WorkItem.objects.filter(handler="batch_done", payload__batch=batch_id).count()


def test_a_cancel_of_the_pending_item_a_finisher_holds_waits_and_completes_the_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Finisher F ends item a and share-locks pending item c (so it skips the batch
    lock); an operator cancels c meanwhile. The cancel must wait for F's commit, so
    that its own check sees a succeeded: one callback. Were c only read, not locked,
    the cancel would check first, see a claimed, and neither would enqueue it."""
    with batch(on_complete=BatchDone) as b:
        Noop.enqueue({})
        pending = Noop.enqueue({})
    (running,) = claim(limit=1, handlers=["noop"])
    assert running.pk != pending.pk
    probed, release = threading.Event(), threading.Event()
    real = completion.holds_a_pending_item

    def held(batch_id: int, using: str) -> bool:
        found = real(batch_id, using)
        probed.set()
        assert release.wait(20)
        return found

    monkeypatch.setattr(completion, "holds_a_pending_item", held)
    finisher, errors = _in_thread(
        lambda: transitions.succeed(
            [(running.pk, running.claim_token, None)],
            linked=transitions.linked_rows([running]),
        )
    )
    assert probed.wait(20)
    monkeypatch.setattr(completion, "holds_a_pending_item", real)
    canceller, cancel_errors = _in_thread(
        lambda: WorkItem.objects.filter(pk=pending.pk).cancel_pending()
    )
    wait_until(
        lambda: lock_waiters() >= 1,
        interval=0.25,
        what="the cancel to wait for the finisher's lock",
    )
    release.set()
    finisher.join(20)
    canceller.join(20)
    assert not errors and not cancel_errors, errors + cancel_errors
    assert WorkItem.objects.get(pk=pending.pk).status == Status.CANCELLED
    assert _callbacks(b.id) == 1
    assert Batch.objects.get(pk=b.id).completed_at is not None


def test_two_finishers_of_the_last_two_items_enqueue_the_callback_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Both items claimed; finisher A writes its success and is held right before it
    locks the batch row; finisher B writes, locks, reads (sees A's item claimed) and
    commits; then A goes on: its read after the lock sees B's commit. One callback."""
    with batch(on_complete=BatchDone) as b:
        Noop.enqueue_many([{}, {}])
    first, second = claim(limit=2, handlers=["noop"])
    reached, release = threading.Event(), threading.Event()
    real = completion.complete_batches
    calls: list[int] = []

    def held(batch_ids: Any, using: str, *, quick: bool = False) -> list[int]:
        calls.append(1)
        if len(calls) == 1:
            reached.set()
            assert release.wait(20)
        return real(batch_ids, using, quick=quick)

    monkeypatch.setattr(completion, "complete_batches", held)
    a, errors_a = _in_thread(
        lambda: transitions.succeed(
            [(first.pk, first.claim_token, None)], linked=transitions.linked_rows([first])
        )
    )
    assert reached.wait(20)
    transitions.succeed(
        [(second.pk, second.claim_token, None)], linked=transitions.linked_rows([second])
    )
    assert _callbacks(b.id) == 0  # B saw A's item still claimed
    release.set()
    a.join(20)
    assert not errors_a, errors_a
    assert _callbacks(b.id) == 1
