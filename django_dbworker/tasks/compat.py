"""Django's Tasks framework where it lives: ``django.tasks`` (6.0+) or the backport.

On Django 5.2 the framework is the ``django-tasks`` package (the
``django-dbworker[tasks]`` extra). Everything else in this package imports
the framework's names from here, never from either place directly.
"""

from __future__ import annotations

try:
    from django.tasks import TaskContext, TaskResult, TaskResultStatus, task_backends
    from django.tasks.backends.base import BaseTaskBackend
    from django.tasks.base import (
        DEFAULT_TASK_BACKEND_ALIAS,
        DEFAULT_TASK_PRIORITY,
        DEFAULT_TASK_QUEUE_NAME,
        Task,
        TaskError,
    )
    from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist
    from django.tasks.signals import task_enqueued, task_finished, task_started
    from django.utils.json import normalize_json
except ImportError:  # Django 5.2
    try:
        from django_tasks import (  # type: ignore[assignment,no-redef,unused-ignore]
            TaskContext,
            TaskResult,
            TaskResultStatus,
            task_backends,
        )
        from django_tasks.backends.base import BaseTaskBackend  # type: ignore[assignment,no-redef,unused-ignore]
        from django_tasks.base import (  # type: ignore[assignment,no-redef,unused-ignore]
            DEFAULT_TASK_BACKEND_ALIAS,
            DEFAULT_TASK_PRIORITY,
            DEFAULT_TASK_QUEUE_NAME,
            Task,
            TaskError,
        )
        from django_tasks.exceptions import (  # type: ignore[assignment,no-redef,unused-ignore]
            InvalidTaskError as InvalidTask,
        )
        from django_tasks.exceptions import (  # type: ignore[assignment,no-redef,unused-ignore]
            TaskResultDoesNotExist,
        )
        from django_tasks.signals import (  # type: ignore[assignment,no-redef,unused-ignore]
            task_enqueued,
            task_finished,
            task_started,
        )
        from django_tasks.utils import normalize_json  # type: ignore[no-redef,unused-ignore]
    except ImportError as exc:
        raise ImportError(
            "django_dbworker.tasks needs Django's Tasks framework: Django 6.0 or later, "
            "or on Django 5.2 the backport (pip install 'django-dbworker[tasks]', and "
            "add 'django_tasks' to INSTALLED_APPS)."
        ) from exc

__all__ = [
    "DEFAULT_TASK_BACKEND_ALIAS",
    "DEFAULT_TASK_PRIORITY",
    "DEFAULT_TASK_QUEUE_NAME",
    "BaseTaskBackend",
    "InvalidTask",
    "Task",
    "TaskContext",
    "TaskError",
    "TaskResult",
    "TaskResultDoesNotExist",
    "TaskResultStatus",
    "normalize_json",
    "task_backends",
    "task_enqueued",
    "task_finished",
    "task_started",
]
