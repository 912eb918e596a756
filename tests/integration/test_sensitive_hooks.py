"""A sensitive handler's ``attempt_recorded`` hook that raises is logged redacted.

The hook is user code (a Django ``task_finished`` receiver): what it raises
may quote the payload. For a ``sensitive`` handler the log line carries the
redacted summary and no traceback, whichever route the ending took (a
failure recorded by the thread that ran it, a success the writer recorded).
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from django_dbworker.handlers import WorkItemHandler
from django_dbworker.models import WorkItem
from django_dbworker.testing import run_until_empty

pytestmark = pytest.mark.django_db

SECRET = "hook-s3cr3t"


class _LeakyHook(WorkItemHandler):
    abstract = True
    max_attempts = 1

    def handle(self, payload: Any) -> Any:
        if payload.get("fail"):
            raise ValueError(f"handler saw {payload['password']}")
        return None

    def attempt_recorded(
        self, item: WorkItem, status: str | None, error: BaseException | None
    ) -> None:
        raise RuntimeError(f"hook saw {item.payload['password']}")


class SensitiveLeakyHook(_LeakyHook):
    name = "sensitive_leaky_hook"
    sensitive = True


class PlainLeakyHook(_LeakyHook):
    name = "plain_leaky_hook"


@pytest.mark.parametrize("fail", [False, True], ids=["success", "failure"])
def test_a_sensitive_hook_that_raises_is_logged_without_its_message(
    fail: bool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="django_dbworker")
    SensitiveLeakyHook.enqueue({"password": SECRET, "fail": fail})
    run_until_empty(["sensitive_leaky_hook"])
    assert "SensitiveLeakyHook.attempt_recorded raised" in caplog.text
    assert "RuntimeError: [redacted]" in caplog.text
    assert SECRET not in caplog.text


def test_a_plain_hook_that_raises_is_logged_with_its_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="django_dbworker")
    PlainLeakyHook.enqueue({"password": SECRET})
    run_until_empty(["plain_leaky_hook"])
    assert "PlainLeakyHook.attempt_recorded raised" in caplog.text
    assert f"hook saw {SECRET}" in caplog.text  # the traceback, as before
