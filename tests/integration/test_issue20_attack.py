"""Attacks on issue 20's claim-then-recover claim loop, in process (``run_until_empty``).

``run_until_empty`` drives the real worker in burst mode: rows a dead worker
left behind (stale heartbeats) are recovered by its pass and must be run
before it returns, as they were when the pass came before the claim.
"""

from __future__ import annotations

import pytest

from django_dbworker.models import Status, WorkItem
from django_dbworker.testing import run_until_empty
from tests.factories import age_heartbeat, claim, make_item

pytestmark = pytest.mark.django_db(transaction=True)


def test_run_until_empty_recovers_and_runs_a_dead_workers_row() -> None:
    make_item()
    [item] = claim(limit=1, handlers=["noop"], worker="dead:1:main")
    age_heartbeat(item, 3600)
    counts = run_until_empty(["noop"])
    assert WorkItem.objects.get(pk=item.pk).status == Status.SUCCEEDED, counts
