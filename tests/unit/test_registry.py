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


def test_own_table_handlers_must_implement_claim_and_process(cleanup: list[str]) -> None:
    from django_dbworker.handlers import unimplemented

    class NoClaim(Handler[int]):
        name = "unit-no-claim"

        def process(self, item: int) -> None:
            pass

    class Nothing(Handler[int]):
        name = "unit-nothing"

    class Jobs(WorkItemHandler):
        name = "unit-jobs"

    cleanup.extend(["unit-no-claim", "unit-nothing", "unit-jobs"])
    assert unimplemented(NoClaim) == ["claim"]
    assert unimplemented(Nothing) == ["claim", "process"]
    assert unimplemented(Jobs) == []  # run by the shared claim loop
    with pytest.raises(NotImplementedError, match="NoClaim must implement claim"):
        NoClaim().claim()


def test_a_work_item_handler_is_not_driven_on_its_own(cleanup: list[str]) -> None:
    class Jobs(WorkItemHandler):
        name = "unit-jobs"

    cleanup.append("unit-jobs")
    with pytest.raises(TypeError, match="shared claim loop"):
        Jobs().claim()


def test_the_registry_can_be_read_while_another_thread_registers() -> None:
    """Handlers register from any thread (a job that imports a module of ``@task``
    functions), while the worker's watchers iterate the registry (task discovery, the
    periodic schedules): reading it must never fail with "dictionary changed size during
    iteration", which would kill the watcher and so stop the worker. The race is
    amplified with a tiny switch interval and a registry of a few hundred handlers."""
    import sys
    import threading

    ballast = [f"ballast_{n}" for n in range(500)]
    names = [f"churn_{n}" for n in range(20)]
    done = threading.Event()
    errors: list[BaseException] = []

    def read() -> None:
        try:
            while not done.is_set():
                list(registry)
                dict(registry.items())
        except BaseException as exc:  # the finding
            errors.append(exc)

    old_interval = sys.getswitchinterval()
    reader = threading.Thread(target=read, daemon=True)
    try:
        for name in ballast:
            type(name, (WorkItemHandler,), {"name": name, "__module__": __name__})
        reader.start()
        sys.setswitchinterval(1e-6)
        for _ in range(2_000):
            if errors:
                break
            for name in names:
                type(name, (WorkItemHandler,), {"name": name, "__module__": __name__})
            for name in names:
                registry.unregister(name)
    finally:
        sys.setswitchinterval(old_interval)
        done.set()
        reader.join(10)
        for name in names + ballast:
            registry.unregister(name)
    assert not errors, errors
