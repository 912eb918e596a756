"""Failure log lines and stored errors of a handler whose message holds control characters."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from django_dbworker import WorkItemHandler
from django_dbworker.models import Status, WorkItem
from django_dbworker.testing import run_until_empty

pytestmark = pytest.mark.django_db

#: A message that would forge a log line, clear the screen and break lines the
#: ways log viewers and terminals do.
FORGING = "boom\r\n2026-12-01 INFO all good\x1b[2J\u2028\x85done"


class ForgingMessage(WorkItemHandler):
    name = "log_lines_forging_message"
    max_attempts = 1

    def handle(self, payload: Any) -> None:
        raise ValueError(FORGING)


def _controls(text: str, allowed: str = "") -> list[str]:
    return [
        c
        for c in text
        if (ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F or c in "\u2028\u2029") and c not in allowed
    ]


def test_a_failure_log_line_is_one_line_without_control_characters(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="django_dbworker")
    item = ForgingMessage.enqueue({})
    assert run_until_empty(handlers=[ForgingMessage.name]) == {"failed": 1}
    (line,) = [r.getMessage() for r in caplog.records if "failed on attempt" in r.getMessage()]
    assert len(line.splitlines()) == 1 and not _controls(line), repr(line)
    assert "boom\\r 2026-12-01 INFO all good\\x1b[2J\\u2028\\x85done" in line
    row = WorkItem.objects.get(pk=item.pk)
    assert row.status == Status.FAILED
    # last_error keeps the traceback's lines; the message's controls are escapes.
    assert "\nTraceback (most recent call last):\n" in row.last_error
    assert not _controls(row.last_error, allowed="\n\t"), repr(row.last_error)
    assert "ValueError: boom\\r\n2026-12-01 INFO all good\\x1b[2J\\u2028\\x85done" in row.last_error
