"""Flag validation of run_workers, without a database or a worker."""

from __future__ import annotations

import pytest
from django.core.management import CommandError, call_command


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--concurrency", "0"], "must be at least 1"),
        (["--concurrency", "x"], "is not an integer"),
        (["--interval", "0"], "must be greater than 0"),
        (["--interval", "-1"], "must be greater than 0"),
        (["--shutdown-timeout", "nan"], "must be 0 or more"),
        (["--metrics-port", "70000"], "is not a port number"),
        (["--queue", "bad queue!"], "is not a valid queue name"),
        # A thread cannot wait that long (threading.TIMEOUT_MAX): the idle
        # worker's first wait raised OverflowError.
        (["--interval", "inf"], "must be a finite number of seconds"),
        (["--interval", "1e10"], "TIMEOUT_MAX"),
        (["--shutdown-timeout", "inf"], "must be a finite number of seconds"),
        # A burst run ends by itself; a reloading one runs until stopped.
        (["--burst", "--reload"], "argument --reload: not allowed with argument --burst"),
    ],
)
def test_bad_flags_are_refused_with_a_message(args: list[str], message: str) -> None:
    with pytest.raises(CommandError, match=message):
        call_command("run_workers", *args)


# From Django 6.1 run_workers' system checks look at every alias (on SQLite: a query).
@pytest.mark.django_db(databases=["default", "work"])
def test_unknown_handler_name_lists_the_registered_ones() -> None:
    with pytest.raises(CommandError) as info:
        call_command("run_workers", "no-such-handler")
    assert info.value.returncode == 2
    assert "no-such-handler" in str(info.value)
    assert "noop" in str(info.value)


@pytest.mark.django_db(databases=["default", "work"])
def test_a_setting_the_checks_refuse_is_a_usage_error() -> None:
    """Exit status 2, like a bad flag: the recipes do not restart a worker for it, since a
    restart cannot fix a setting."""
    from django.core.management.base import SystemCheckError
    from django.test import override_settings

    with (
        override_settings(DBWORKER={"POLL_INTERVAL": "soon"}),
        pytest.raises(SystemCheckError) as info,
    ):
        call_command("run_workers", "--burst")
    assert info.value.returncode == 2
    assert "POLL_INTERVAL" in str(info.value)
