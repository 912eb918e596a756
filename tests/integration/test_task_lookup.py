"""Which modules ``get_result`` may import to find a row's task: the project's only.

A row's ``handler`` column names the task by its import path, and anyone
who can write to the table can write any path there. The backend's lookup
imports what the worker would (``discovery.import_by_path``): modules of
the project's own packages, never another module a row names.
"""

from __future__ import annotations

import builtins
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import tests
from django_dbworker.models import WorkItem
from django_dbworker.registry import registry
from django_dbworker.tasks.compat import TaskResultDoesNotExist, task_backends

pytestmark = pytest.mark.django_db

#: Set by the probe modules when they are imported.
FLAG = "_dbworker_task_lookup_probe_imported"

PROBE = f"""
import builtins

from django_dbworker.tasks import task

setattr(builtins, {FLAG!r}, __name__)


@task()
def probe() -> str:
    return "ran"
"""


@pytest.fixture
def probe_flag() -> Iterator[None]:
    yield
    if hasattr(builtins, FLAG):
        delattr(builtins, FLAG)


def _row(handler: str) -> str:
    return str(
        WorkItem.objects.create(handler=handler, queue="default", payload={}, max_attempts=1).pk
    )


@pytest.mark.usefixtures("probe_flag")
def test_get_result_does_not_import_a_module_outside_the_project(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "dbworker_outside_probe.py").write_text(PROBE)
    monkeypatch.syspath_prepend(str(tmp_path))
    result_id = _row("dbworker_outside_probe.probe")
    with pytest.raises(TaskResultDoesNotExist):
        task_backends["default"].get_result(result_id)
    assert "dbworker_outside_probe" not in sys.modules
    assert not hasattr(builtins, FLAG)


@pytest.mark.parametrize("name", ["this.probe", "os.system", "os.path.join"])
def test_get_result_does_not_import_stdlib_modules_a_row_names(name: str) -> None:
    module = name.rpartition(".")[0]
    was_imported = module in sys.modules
    with pytest.raises(TaskResultDoesNotExist):
        task_backends["default"].get_result(_row(name))
    assert (module in sys.modules) == was_imported


@pytest.mark.usefixtures("probe_flag")
def test_get_result_still_imports_a_task_module_of_the_project(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A module of the project's own ``tests`` package, not imported yet.
    package = tmp_path / "lookup"
    package.mkdir()
    (package / "dbworker_inside_probe.py").write_text(PROBE)
    monkeypatch.setattr(tests, "__path__", [*tests.__path__, str(package)])
    name = "tests.dbworker_inside_probe.probe"
    try:
        result = task_backends["default"].get_result(_row(name))
        assert getattr(builtins, FLAG) == "tests.dbworker_inside_probe"
        assert result.task.module_path == name
    finally:
        registry.unregister(name)
        sys.modules.pop("tests.dbworker_inside_probe", None)
