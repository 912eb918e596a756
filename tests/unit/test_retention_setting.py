"""``DBWORKER["RETENTION"]``: what it accepts, and what it refuses before a worker starts."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.test import override_settings

from django_dbworker.checks import check_settings
from django_dbworker.periodic.handler import periodic_handlers
from django_dbworker.retention import PruneFinished, retention_ages
from django_dbworker.validation import DEFAULT_RETENTION, retention


def test_default_keeps_a_week_and_failed_rows_a_month() -> None:
    assert retention_ages() == {"succeeded": 604800.0, "cancelled": 604800.0, "failed": 2592000.0}
    assert PruneFinished.scheduled()
    assert periodic_handlers([PruneFinished]) == [PruneFinished]


def test_a_partial_dict_keeps_the_other_defaults() -> None:
    ages = retention({"succeeded": timedelta(days=1), "failed": None})
    assert ages == {
        "succeeded": 86400.0,
        "cancelled": DEFAULT_RETENTION["cancelled"],
        "failed": None,
    }


def test_none_turns_retention_off_and_unschedules_it() -> None:
    with override_settings(DBWORKER={"RETENTION": None}):
        assert retention_ages() is None
        assert not PruneFinished.scheduled()
        assert periodic_handlers([PruneFinished]) == []
    every_status_kept = {"succeeded": None, "failed": None, "cancelled": None}
    with override_settings(DBWORKER={"RETENTION": every_status_kept}):
        assert not PruneFinished.scheduled()


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (7, "django_dbworker.E003"),
        ({"succeeded": "7d"}, "django_dbworker.E003"),
        ({"succeeded": 0}, "django_dbworker.E004"),
        ({"succeeded": -1.5}, "django_dbworker.E004"),
        ({"pending": 60}, "django_dbworker.E004"),
        ({"claimed": 60}, "django_dbworker.E004"),
    ],
)
def test_bad_retention_is_a_system_check_error(value: Any, expected: str) -> None:
    with override_settings(DBWORKER={"RETENTION": value}):
        errors = check_settings()
    assert [e.id for e in errors] == [expected]
    assert "RETENTION" in errors[0].msg
