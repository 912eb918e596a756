from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured

from django_dbworker import Handler, WorkItemHandler, registry


@pytest.fixture
def cleanup() -> Iterator[list[str]]:
    names: list[str] = []
    yield names
    for name in names:
        registry.unregister(name)


def test_concrete_subclass_registers_itself(cleanup: list[str]) -> None:
    class Mine(WorkItemHandler):
        name = "unit-mine"

    cleanup.append("unit-mine")
    assert registry["unit-mine"] is Mine


def test_abstract_base_is_not_registered_but_its_children_are(cleanup: list[str]) -> None:
    class Base(WorkItemHandler):
        abstract = True
        name = "unit-base"
        queue = "emails"

    class Child(Base):
        name = "unit-child"

    cleanup.append("unit-child")
    assert "unit-base" not in registry
    assert registry["unit-child"] is Child
    assert Child.queue == "emails"


def test_duplicate_names_are_refused(cleanup: list[str]) -> None:
    class First(WorkItemHandler):
        name = "unit-dup"

    cleanup.append("unit-dup")
    with pytest.raises(ImproperlyConfigured, match="Two handlers are named 'unit-dup'"):

        class Second(WorkItemHandler):
            name = "unit-dup"


def test_missing_name_is_refused() -> None:
    with pytest.raises(ImproperlyConfigured, match="needs a non-empty `name`"):

        class Nameless(Handler[Any]):
            pass


def test_test_app_handlers_were_autodiscovered() -> None:
    assert {"noop", "flaky", "invoice-mailer"} <= set(registry)


def test_max_attempts_defaults_to_the_setting(cleanup: list[str]) -> None:
    class Plain(WorkItemHandler):
        name = "unit-plain"

    cleanup.append("unit-plain")
    assert Plain.get_max_attempts() == 3


def test_public_enqueue_is_the_function_even_after_its_module_is_imported() -> None:
    import importlib

    import django_dbworker

    importlib.import_module("django_dbworker.enqueuing")
    importlib.import_module("django_dbworker.management.commands.run_workers")
    assert callable(django_dbworker.enqueue)
    assert django_dbworker.enqueue.__module__ == "django_dbworker.enqueuing"
    from django_dbworker import enqueue

    assert enqueue is django_dbworker.enqueue
