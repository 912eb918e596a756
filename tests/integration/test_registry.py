"""Discovery of handler modules: ``workers`` always, ``tasks`` with a DBWorkerBackend.

Also ``import_by_path``, which imports the module of a task named by a row.
"""

from __future__ import annotations

import logging
from typing import Any

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


def test_a_task_module_that_fails_to_import_is_not_skipped_silently(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``import_by_path`` says "an import that fails is logged"; an ImportError is not.

    A task module whose own import fails with ImportError (a dependency
    missing on the worker hosts: ``import stripe``) is swallowed like a
    name that is no import path at all: nothing is logged, the task's rows
    stay READY forever, and the worker's only word is the generic orphan
    warning ("no handler registered"), which points away from the cause.
    Only a missing *named* module should be skipped quietly
    (``ModuleNotFoundError.name`` tells them apart).
    """
    from django.conf import settings

    package = tmp_path / "billing_app"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "charges.py").write_text(
        "import dependency_not_installed  # noqa: F401\n"
        "from django_dbworker.tasks import task\n\n\n"
        "@task\n"
        "def charge(amount):\n"
        "    return amount\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))

    # An installed app of the project (only the project's modules are imported).
    apps = [*settings.INSTALLED_APPS, "billing_app"]
    with override_settings(INSTALLED_APPS=apps), caplog.at_level("DEBUG"):
        found = import_by_path(["billing_app.charges.charge"])
    assert found == []
    said = [r.getMessage() for r in caplog.records if r.levelno >= 30]
    assert any("billing_app" in line for line in said), said
