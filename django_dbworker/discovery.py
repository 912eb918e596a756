"""Finding the handlers a process runs: ``workers`` modules, ``@task`` functions, new names.

Handler classes register themselves when their module is imported
(``registry.py``); this module decides which modules get imported: every
installed app's ``workers`` module, its ``tasks`` modules when a
``DBWorkerBackend`` is configured (Django lets ``@task`` functions live in
any module), and the project modules that the handler names of pending
rows point to, at start and for rows enqueued later (``new_pending_handlers``,
read by the worker's task-discovery watcher). Every import a row can cause
goes through ``import_by_path``, restricted to the project's own packages.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from django_dbworker.handlers import WorkItemHandler
from django_dbworker.models import WorkItem
from django_dbworker.registry import registry
from django_dbworker.routing import work_db_for_read

logger = logging.getLogger("django_dbworker.registry")


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


#: How far behind the newest id a look for new handler names starts: rows of
#: transactions that committed after later ids were seen are still found.
NEW_ROWS_LOOKBACK = 10_000


def new_pending_handlers(after_id: int | None, using: str | None = None) -> tuple[list[str], int]:
    """Handler names of pending rows added since ``after_id`` that nothing here registers.

    Returns them (at most 100) and the newest id now, for the next look. A
    primary-key range scan: its cost is the rows added since, not the
    table. ``None`` starts from the newest row.
    """
    db = work_db_for_read(using)
    newest = WorkItem.objects.using(db).order_by("-pk").values_list("pk", flat=True).first() or 0
    if after_id is None:
        return [], newest
    known = [name for name, cls in registry.items() if issubclass(cls, WorkItemHandler)]
    names = list(
        WorkItem.objects.using(db)
        .filter(pk__gt=max(0, after_id - NEW_ROWS_LOOKBACK), status="pending")
        .exclude(handler__in=known)
        .order_by()
        .values_list("handler", flat=True)
        .distinct()[:100]
    )
    return names, newest
