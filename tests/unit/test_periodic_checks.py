"""Every bad periodic declaration is a system check error with its own id."""

from __future__ import annotations

from typing import Any

import pytest
from django.core.checks import run_checks

from django_dbworker import PeriodicHandler
from django_dbworker.checks import check_periodic_handlers, periodic_errors
from django_dbworker.registry import registry

#: The checks without a database, as on Django 5.2: from Django 6.1, ``run_checks()``
#: runs the model checks against every alias (on SQLite: a query).
NO_DATABASES: list[str] = []


def declare(**attrs: Any) -> type[PeriodicHandler]:
    """A periodic handler class kept out of the registry (``abstract``)."""
    body = {"name": "bad", "abstract": True, "run": lambda self: None, **attrs}
    return type("Bad", (PeriodicHandler,), body)


def test_the_suites_periodic_handlers_are_clean() -> None:
    assert check_periodic_handlers() == []


@pytest.mark.parametrize(
    ("attrs", "check_id", "words"),
    [
        ({"every": 60, "cron": "0 3 * * *"}, "E010", "sets both `every` and `cron`"),
        ({}, "E010", "sets neither `every` nor `cron`"),
        ({"cron": "0 3 * * * *"}, "E011", "has 6 field(s); it needs 5"),
        ({"cron": "0 24 * * *"}, "E011", "the hour field '24' is invalid"),
        ({"cron": "0 3 * JUNE *"}, "E011", "the month field 'JUNE' is invalid"),
        ({"cron": "0 3 * * 1-9"}, "E011", "the day-of-week field '1-9' is invalid"),
        ({"cron": 3}, "E011", "`cron` must be a string"),
        ({"every": 0.5}, "E012", "`every` is 0.5 seconds; the shortest is 1"),
        ({"every": 0}, "E012", "the shortest is 1"),
        ({"every": "hourly"}, "E012", "`every` must be a number of seconds"),
        ({"cron": "0 3 * * *", "timezone": "Europe/Pariss"}, "E013", "'Europe/Pariss' is not"),
        ({"cron": "0 3 * * *", "timezone": None}, "E013", "timezone must be an IANA name"),
        ({"every": 60, "jitter": -1}, "E014", "`jitter` must be a non-negative number"),
    ],
)
def test_bad_declaration_is_an_error_naming_the_problem(
    attrs: dict[str, Any], check_id: str, words: str
) -> None:
    (error,) = periodic_errors([declare(**attrs)])
    assert error.id == f"django_dbworker.{check_id}"
    assert error.msg.startswith("Periodic handler 'bad' (")
    assert words in error.msg
    assert error.hint


def test_several_problems_are_all_reported() -> None:
    errors = periodic_errors([declare(every=0, jitter="x")])
    assert [e.id for e in errors] == ["django_dbworker.E012", "django_dbworker.E014"]


def test_manage_py_check_reports_a_registered_bad_handler() -> None:
    class Broken(PeriodicHandler):
        name = "broken_periodic"
        cron = "0 3 * *"

    try:
        ids = [m.id for m in run_checks(databases=NO_DATABASES)]
        assert "django_dbworker.E011" in ids
    finally:
        registry.unregister("broken_periodic")
    assert "django_dbworker.E011" not in [m.id for m in run_checks(databases=NO_DATABASES)]
