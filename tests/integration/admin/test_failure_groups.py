"""The dashboard groups failures by a normalised message: ids and numbers folded."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.test import Client
from django.urls import reverse

from django_dbworker import stats
from django_dbworker.models import Status
from tests.integration.admin.test_pages import SUMMARY, _db_now, _finished

pytestmark = pytest.mark.django_db


def _failure_rows(html: str) -> list[tuple[str, str, str]]:
    section = html.split('id="dbw-failures"')[1].split("</table>")[0]
    return re.findall(
        r"<td(?: title=\"([^\"]*)\")?><code>(.*?)</code></td>.*?"
        r'<td class="dbw-num"><a href="[^"]+">(\d+)</a></td>',
        section,
        re.DOTALL,
    )


def test_failures_whose_messages_carry_ids_group_as_one(superuser_client: Client) -> None:
    now = _db_now()
    for i, order in enumerate((1234, 99, 500_001)):
        _finished(
            "echo",
            Status.FAILED,
            now - timedelta(minutes=5 + i),
            last_error=f"LookupError: Order {order} not found\n\nTraceback ...",
        )
    _finished(
        "echo",
        Status.FAILED,
        now - timedelta(minutes=2),
        last_error="DoesNotExist: Customer 6f1c2b7e-9a41-4c3e-8d2f-0b9e6a7c5d10 is gone",
    )
    _finished("echo", Status.FAILED, now - timedelta(minutes=3), last_error="KeyError: 'x'")

    groups = stats.failure_groups()
    assert [(g["error"], g["count"], g["messages"]) for g in groups] == [
        ("LookupError: Order <n> not found", 3, 3),
        ("DoesNotExist: Customer 6f1c2b7e-9a41-4c3e-8d2f-0b9e6a7c5d10 is gone", 1, 1),
        ("KeyError: 'x'", 1, 1),
    ]
    # The latest message of a folded group stands as its example.
    assert groups[0]["example"] == "LookupError: Order 1234 not found"

    html = superuser_client.get(reverse(SUMMARY)).content.decode()
    assert _failure_rows(html) == [
        (
            "3 different messages, e.g. LookupError: Order 1234 not found",
            "LookupError: Order &lt;n&gt; not found",
            "3",
        ),
        ("", "DoesNotExist: Customer 6f1c2b7e-9a41-4c3e-8d2f-0b9e6a7c5d10 is gone", "1"),
        ("", "KeyError: &#x27;x&#x27;", "1"),
    ]


def test_groups_stay_per_handler() -> None:
    now = _db_now()
    _finished("echo", Status.FAILED, now - timedelta(minutes=1), last_error="E: row 1")
    _finished("noop", Status.FAILED, now - timedelta(minutes=2), last_error="E: row 2")
    groups = stats.failure_groups()
    assert sorted((g["handler"], g["error"], g["count"]) for g in groups) == [
        ("echo", "E: row 1", 1),
        ("noop", "E: row 2", 1),
    ]


def test_the_sample_of_distinct_messages_is_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stats, "FAILURE_SAMPLE", 3)
    now = _db_now()
    for i in range(5):
        _finished("echo", Status.FAILED, now - timedelta(minutes=i), last_error=f"E: item {i}")
    (group,) = stats.failure_groups()
    # The 3 latest distinct messages are read, folded, and the group says so.
    assert (group["error"], group["count"], group["sampled"]) == ("E: item <n>", 3, True)
