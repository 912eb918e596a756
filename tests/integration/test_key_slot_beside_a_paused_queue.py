"""A key's slot goes to its best ready row, whichever worker serves it, also when the key's
very best row waits in a paused queue.

A worker of some queues leaves a limited key's row while a better row of the key waits in
a queue it does not serve (SPEC "Flow control", docs "the best ready row of a key"): a
key split across queues of different workers starved one of them. A row in a paused queue
is claimed by no worker: it cannot take the slot, so the better rows behind it in other
served queues must still be preferred. The rule only looks at the key's single best row,
and a paused one switches it off for the whole key.
"""

from __future__ import annotations

import pytest

from django_dbworker import pause_queue
from django_dbworker.models import WorkItem
from tests.factories import claim
from tests.testapp.workers import Keyed

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_paused_best_row_does_not_hand_the_keys_slot_to_a_worse_row() -> None:
    held = Keyed.enqueue({"key": "held"}, concurrency_key="K", queue="held", priority=10)
    theirs = Keyed.enqueue({"key": "theirs"}, concurrency_key="K", queue="theirs", priority=5)
    mine = Keyed.enqueue({"key": "mine"}, concurrency_key="K", queue="mine", priority=0)
    pause_queue("held")
    # The worker of "mine" alone: "theirs" (priority 5, ready, not paused) is the best row
    # any worker can take for K, and waits in a queue this worker does not serve.
    got = claim(limit=10, handlers=["keyed"], queues=["mine"], limited=True)
    assert [i.pk for i in got] == [], (
        f"the worker of 'mine' took K's slot for #{mine.pk} (priority 0) while #{theirs.pk} "
        f"(priority 5) waits in 'theirs'; #{held.pk} (priority 10) is paused"
    )
    # Without the paused row it does leave the key to "theirs" (the rule as it stands).
    WorkItem.objects.filter(pk=held.pk).delete()
    assert claim(limit=10, handlers=["keyed"], queues=["mine"], limited=True) == []
