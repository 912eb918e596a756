"""List filters whose choices cost no scan of the table.

Django's default filter for a plain CharField runs ``SELECT DISTINCT`` over
the whole table to find its choices. Handler names come from the registry
instead, and queue names from the handlers plus a loose index scan of the
queue index (one probe per queue).
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest

from django_dbworker.db import operations
from django_dbworker.models import Status, handler_match
from django_dbworker.registry import registry


class HandlerFilter(admin.SimpleListFilter):
    title = "handler"
    parameter_name = "handler"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        from django_dbworker.handlers import WorkItemHandler

        names = [n for n, cls in registry.items() if issubclass(cls, WorkItemHandler)]
        return [(name, name) for name in sorted(names)]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        return queryset.filter(handler_match(value)) if value else queryset


class QueueFilter(admin.SimpleListFilter):
    title = "queue"
    parameter_name = "queue"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        from django_dbworker.handlers import WorkItemHandler

        queues = {cls.queue for cls in registry.values() if issubclass(cls, WorkItemHandler)}
        queues.update(operations(model_admin.model.objects.db).distinct_queues())
        return [(q, q) for q in sorted(queues)]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        return queryset.filter(queue=value) if value else queryset


class CancelRequestedFilter(admin.SimpleListFilter):
    """Claimed rows whose cancellation was requested (the Cancel action on running work)."""

    title = "cancel requested"
    parameter_name = "cancel_requested"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("yes", "Yes (running, asked to stop)")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        if self.value() == "yes":
            return queryset.filter(status=Status.CLAIMED, cancel_requested_at__isnull=False)
        return queryset


class BatchFilter(admin.SimpleListFilter):
    """The items of one batch (``?batch=<id>``), linked from the Batches page.

    Offers no choices of its own (batches can be many): it shows, with its
    one choice, once a link has set it. Served by ``dbworker_batch_idx``.
    """

    title = "batch"
    parameter_name = "batch"

    def _batch_id(self) -> int | None:
        value = self.value()
        if value and value.isascii() and value.isdigit() and len(value) < 19:
            return int(value)
        return None

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        value = self.value()
        return [(value, f"#{value}")] if value else []

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        if not self.value():
            return queryset
        batch_id = self._batch_id()
        return queryset.none() if batch_id is None else queryset.filter(batch_id=batch_id)


class WaitingFilter(admin.SimpleListFilter):
    """Pending rows waiting for their parents (``after=``): ``dbworker_waiting_idx``."""

    title = "waiting for parents"
    parameter_name = "waiting"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("yes", "Yes (pending, waiting for their parents)")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        if self.value() == "yes":
            return queryset.filter(status=Status.PENDING, waiting=True)
        return queryset


class WorkerFilter(admin.SimpleListFilter):
    """The rows one worker process holds (``?worker=host:pid``), linked from the Workers page.

    Offers no choices of its own (the Workers page lists the workers): it
    shows, with its one choice, once a link has set it. Matches ``claimed_by``
    (``host:pid:thread``) by its prefix, on the claimed rows only.
    """

    title = "worker"
    parameter_name = "worker"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        value = self.value()
        return [(value, value)] if value else []

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        if not value:
            return queryset
        return queryset.filter(status=Status.CLAIMED, claimed_by__startswith=f"{value}:")


class FairKeyFilter(admin.SimpleListFilter):
    """A fair key's rows: the keys with the most ready work to choose from (any key by
    ``?fair_key=``), ``(no key)`` for the rows without one."""

    title = "fair key"
    parameter_name = "fair_key"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        from django_dbworker.stats import busiest_fair_keys

        keys = busiest_fair_keys(using=model_admin.model.objects.db)
        return [(k["key"] or NO_KEY_PARAM, k["key"] or "(no key)") for k in keys]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        if not value:
            return queryset
        if value == NO_KEY_PARAM:
            return queryset.filter(fair_key__isnull=True)
        return queryset.filter(fair_key=value)


#: ``?fair_key=`` of the rows without a fair key (a key is at least one character).
NO_KEY_PARAM = "-"
