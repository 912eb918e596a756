"""The registry of handler classes, keyed by their ``name``.

Handlers register themselves when their class body is executed (see
``Handler.__init_subclass__``); ``autodiscover`` imports the ``workers``
module of every installed app so that names are known in every process,
web as well as worker.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from django.core.exceptions import ImproperlyConfigured

if TYPE_CHECKING:
    from django_dbworker.handlers import Handler

logger = logging.getLogger("django_dbworker.registry")


class Registry(Mapping[str, "type[Handler[Any]]"]):
    """Name -> handler class. Read-only to users; handlers add themselves."""

    def __init__(self) -> None:
        self._handlers: dict[str, type[Handler[Any]]] = {}

    def register(self, cls: type[Handler[Any]]) -> None:
        name = getattr(cls, "name", None)
        if not isinstance(name, str) or not name.strip():
            raise ImproperlyConfigured(
                f"{cls.__module__}.{cls.__qualname__} needs a non-empty `name` "
                "(or `abstract = True` if it is a base class)."
            )
        if len(name) > 200:
            raise ImproperlyConfigured(f"Handler name {name!r} is longer than 200 characters.")
        existing = self._handlers.get(name)
        if existing is not None and _qualified(existing) != _qualified(cls):
            raise ImproperlyConfigured(
                f"Two handlers are named {name!r}: {_qualified(existing)} and {_qualified(cls)}."
            )
        # The same class imported again (autoreload, importlib.reload) replaces itself.
        self._handlers[name] = cls

    def unregister(self, name: str) -> None:
        """Remove a handler; meant for tests that define throwaway handlers."""
        self._handlers.pop(name, None)

    def __getitem__(self, name: str) -> type[Handler[Any]]:
        return self._handlers[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._handlers)

    def __len__(self) -> int:
        return len(self._handlers)

    def __repr__(self) -> str:
        return f"<Registry {sorted(self._handlers)}>"


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


registry = Registry()


def autodiscover() -> None:
    """Import ``<app>.workers`` for every installed app that has one.

    With a ``DBWorkerBackend`` in ``TASKS``, ``<app>.tasks`` too: ``@task``
    functions become handlers when their module is imported, and a worker
    claims only the handlers it knows.
    """
    from django.utils.module_loading import autodiscover_modules

    autodiscover_modules("workers")
    if uses_task_backend():
        _import_tasks_modules()


def _import_tasks_modules() -> None:
    """Import ``<app>.tasks`` of every installed app, surviving the ones that fail.

    Unlike ``workers`` (a name this app gave its modules), ``tasks`` is a
    name other queues use too: a third-party app's ``tasks.py`` written for
    Celery may not import here. One such module must not stop every
    process of the project at start; it is logged, and its rows are
    reported as unknown handlers like any other.
    """
    from importlib import import_module

    from django.apps import apps
    from django.utils.module_loading import module_has_submodule

    for app_config in apps.get_app_configs():
        if not module_has_submodule(app_config.module, "tasks"):
            continue
        name = f"{app_config.name}.tasks"
        try:
            import_module(name)
        except Exception:
            logger.error(
                "Could not import %s: its @task functions will not run in this process.",
                name,
                exc_info=True,
            )


def import_by_path(names: Iterable[str]) -> list[str]:
    """Import the unregistered ``names`` that are import paths of the project; return
    those now registered.

    A Django ``@task`` registers its handler, named by its import path,
    when its module is imported; Django lets tasks live in any module, and
    the database backend it replaces imports a task by its path when it
    runs it. So a worker imports the paths of the rows it finds pending,
    but only names still unknown, and only modules of the project's own
    packages (those of its installed apps and of its settings): a row is
    no reason to import anything else (``this``, say, prints on import).
    A module that is not there is skipped quietly; one that fails while
    importing (a dependency missing on this host) is logged.
    """
    from importlib import import_module

    found = []
    roots = _project_roots()
    for name in names:
        module_path = name.rpartition(".")[0]
        if (
            name in registry
            or not module_path
            or not all(part.isidentifier() for part in name.split("."))
            or name.split(".", 1)[0] not in roots
        ):
            continue
        try:
            import_module(module_path)
        except ModuleNotFoundError as exc:
            if exc.name is not None and (module_path + ".").startswith(exc.name + "."):
                continue  # no such module (a renamed task, another deployment's handler)
            logger.error("Could not import %s (for %s).", module_path, name, exc_info=True)
            continue
        except Exception:
            logger.error("Could not import %s (for %s).", module_path, name, exc_info=True)
            continue
        if name in registry:
            found.append(name)
    return found


def _project_roots() -> set[str]:
    """Top-level packages of the installed apps, the settings module and the URLconf."""
    from django.apps import apps
    from django.conf import settings

    roots = {config.name.split(".", 1)[0] for config in apps.get_app_configs()}
    for module in (
        getattr(settings, "SETTINGS_MODULE", None),
        getattr(settings, "ROOT_URLCONF", None),
    ):
        if isinstance(module, str) and module:
            roots.add(module.split(".", 1)[0])
    # Not Django's own, nor this package's: nothing of theirs is a task.
    return roots - {"django", "django_dbworker"}


def uses_task_backend() -> bool:
    """Whether ``settings.TASKS`` names a ``DBWorkerBackend`` (or a subclass of it).

    A backend that cannot be imported is Django's check to report, not ours.
    """
    from django.conf import settings
    from django.utils.module_loading import import_string

    tasks = getattr(settings, "TASKS", None)
    if not isinstance(tasks, dict):
        return False
    for params in tasks.values():
        path = params.get("BACKEND") if isinstance(params, dict) else None
        if not isinstance(path, str):
            continue
        try:
            backend = import_string(path)
        except ImportError:
            continue
        if getattr(backend, "is_dbworker_backend", False):
            return True
    return False
