"""The registry of handler classes, keyed by their ``name``.

Handlers register themselves when their class body is executed (see
``Handler.__init_subclass__``); ``discovery.autodiscover`` imports the
``workers`` module of every installed app so that names are known in every
process, web as well as worker.
"""

from __future__ import annotations

import logging
from collections.abc import ItemsView, Iterator, Mapping
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
        # A snapshot: handlers register from any thread (a job that imports a
        # module of @task functions) while the worker's watchers iterate.
        return iter(tuple(self._handlers))

    def items(self) -> ItemsView[str, type[Handler[Any]]]:
        return self._handlers.copy().items()

    def __len__(self) -> int:
        return len(self._handlers)

    def __repr__(self) -> str:
        return f"<Registry {sorted(self._handlers)}>"


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


registry = Registry()
