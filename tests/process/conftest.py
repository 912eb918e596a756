"""Fixtures of the process tests: a worker subprocess on a queue database of its own."""

from __future__ import annotations

import pytest
from django.db import connections

from tests.conftest import QUEUE_ROUTER
from tests.routers import WORK_ALIAS


@pytest.fixture
def queue_env(worker_env: dict[str, str]) -> dict[str, str]:
    """The subprocess's settings: the same router, the ``work`` alias at its test database."""
    return {
        **worker_env,
        "DBWORKER_TEST_ROUTERS": QUEUE_ROUTER,
        "DBWORKER_TEST_WORK_DB_NAME": str(connections[WORK_ALIAS].settings_dict["NAME"]),
    }
