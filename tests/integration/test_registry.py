"""Discovery of handler modules: ``workers`` always, ``tasks`` with a DBWorkerBackend."""

from __future__ import annotations

import logging

import pytest
from django.test import override_settings

from django_dbworker.discovery import autodiscover, import_by_path
from django_dbworker.registry import registry


def test_a_tasks_module_that_cannot_be_imported_is_logged_not_fatal(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from django.conf import settings as django_settings

    apps = [*django_settings.INSTALLED_APPS, "tests.brokentasks"]
    with override_settings(INSTALLED_APPS=apps), caplog.at_level(logging.ERROR):
        autodiscover()  # must not raise
    assert "Could not import tests.brokentasks.tasks" in caplog.text
    assert "tests.testapp.tasks.add" in registry  # the other apps' tasks are still known


def test_import_by_path_imports_only_what_names_a_handler() -> None:
    assert import_by_path(["tests.testapp.tasks.add"]) == []  # known already
    assert import_by_path(["no.such.module.task", "not a path", "os.path", "x..y"]) == []
