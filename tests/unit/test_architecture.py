"""The shape the worker runtime keeps: one place settles an attempt's ending.

Read from the source with ``ast``, not by importing: a second caller of
the hook, the task metrics or the fenced log line anywhere in the package
fails here, before it can account an ending twice or not at all.
"""

from __future__ import annotations

import ast
from pathlib import Path

import django_dbworker

PACKAGE = Path(django_dbworker.__file__).parent
SETTLE = PACKAGE / "worker" / "settle.py"
FENCED_LOG = "Discarded the outcome of work item"


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "migrations" not in p.parts)


def _calls_of(attribute: str) -> dict[Path, int]:
    found: dict[Path, int] = {}
    for path in _modules():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == attribute
            ):
                found[path] = found.get(path, 0) + 1
    return found


def _strings_containing(text: str) -> set[Path]:
    found = set()
    for path in _modules():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and text in node.value
            ):
                found.add(path)
    return found


def test_only_the_settle_module_calls_the_attempt_recorded_hook() -> None:
    assert set(_calls_of("attempt_recorded")) == {SETTLE}


def test_only_the_settle_module_observes_finished_tasks() -> None:
    """Of WorkItem attempts: the own-table loop observes its own items (``Handler[T]``).

    Those have no claim token, ledger or hook of ours: the user's ``process``
    records their outcome itself, and the loop only counts it.
    """
    own_table = PACKAGE / "worker" / "handler_loop.py"
    assert set(_calls_of("task_done")) == {SETTLE, own_table}
    assert _calls_of("task_done")[SETTLE] == 1


def test_only_the_settle_module_logs_a_fenced_outcome() -> None:
    assert _strings_containing(FENCED_LOG) == {SETTLE}


def test_the_runtime_module_only_wires() -> None:
    """runtime.py builds and connects the parts; the concerns live in modules of their own."""
    assert len((PACKAGE / "worker" / "runtime.py").read_text().splitlines()) < 360
