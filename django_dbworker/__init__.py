"""django-dbworker: background work stored in the database.

This module only re-exports the public API. Names that touch models are
loaded lazily so that ``import django_dbworker`` works before the app
registry is ready (in settings files, for instance).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django_dbworker.errors import Cancelled, DatabaseNotReady, EnqueueError, NoTask, Snooze
from django_dbworker.registry import registry
from django_dbworker.version import __version__ as __version__

if TYPE_CHECKING:
    from django_dbworker.batches.block import batch
    from django_dbworker.claiming import claim_next
    from django_dbworker.enqueuing import aenqueue, enqueue, enqueue_many
    from django_dbworker.flow.fair import set_fair_weight
    from django_dbworker.flow.queues import UnknownQueue, pause_queue, resume_queue
    from django_dbworker.handlers import Handler, WorkItemHandler
    from django_dbworker.periodic.handler import PeriodicHandler

__all__ = [
    "Cancelled",
    "DatabaseNotReady",
    "EnqueueError",
    "Handler",
    "NoTask",
    "PeriodicHandler",
    "Snooze",
    "UnknownQueue",
    "WorkItemHandler",
    "aenqueue",
    "batch",
    "claim_next",
    "enqueue",
    "enqueue_many",
    "pause_queue",
    "registry",
    "resume_queue",
    "set_fair_weight",
]


_LAZY = {
    "Handler": "django_dbworker.handlers",
    "WorkItemHandler": "django_dbworker.handlers",
    "PeriodicHandler": "django_dbworker.periodic.handler",
    "batch": "django_dbworker.batches.block",
    "claim_next": "django_dbworker.claiming",
    "aenqueue": "django_dbworker.enqueuing",
    "enqueue": "django_dbworker.enqueuing",
    "enqueue_many": "django_dbworker.enqueuing",
    "pause_queue": "django_dbworker.flow.queues",
    "resume_queue": "django_dbworker.flow.queues",
    "UnknownQueue": "django_dbworker.flow.queues",
    "set_fair_weight": "django_dbworker.flow.fair",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'django_dbworker' has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(module), name)
    globals()[name] = value
    return value
