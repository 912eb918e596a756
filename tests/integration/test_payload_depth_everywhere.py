"""A payload nested deeper than the database stores is an EnqueueError that names the limit,
on every path that stores a user's payload (MariaDB: 31 levels; docs: "payload depth on
MariaDB"): ``batch(payload=...)`` too, whose payload is stored on the Batch row at the block
and becomes the callback's payload.
"""

from __future__ import annotations

from typing import Any

import pytest

from django_dbworker import EnqueueError, batch
from django_dbworker.batches.models import Batch
from django_dbworker.db import operations
from tests.testapp.workers import BatchDone, Noop

pytestmark = [pytest.mark.mysql_only, pytest.mark.django_db(transaction=True)]


def _nested(levels: int) -> Any:
    value: Any = 1
    for _ in range(levels):
        value = [value]
    return value


def test_a_batch_payload_too_deep_for_the_database_is_an_enqueue_error() -> None:
    depth = operations().max_json_depth
    assert depth is not None
    # A dict at the top (batch payloads are dicts): one level, plus the nested list.
    payload = {"tree": _nested(depth)}
    with pytest.raises(EnqueueError, match="nest"):
        Noop.enqueue(payload)  # the enqueue path says so
    with pytest.raises(EnqueueError, match="nest"), batch(on_complete=BatchDone, payload=payload):
        Noop.enqueue({})
    assert not Batch.objects.exists()
