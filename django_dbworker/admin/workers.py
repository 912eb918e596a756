"""The Workers page: the live ``run_workers`` processes, what they run, and what they hold.

``WorkersAdmin`` serves the page in place of a change list for ``LiveWorker``;
the figures come from ``fleet.register.live_workers`` (the rows whose heartbeat
is younger than STALE_AFTER, and one grouped count of the claimed rows), and
each worker's claimed count links to the Claimed work items page filtered to
it (``?worker=host:pid``). Read-only: no add, change or delete anywhere, and
the page takes no parameters and no POST. Seeing it needs the view permission
on workers (``django_dbworker.view_liveworker``) or the view (or change)
permission on work items.
"""

from __future__ import annotations

from datetime import UTC
from typing import TYPE_CHECKING, Any

from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, HttpResponseNotAllowed
from django.shortcuts import redirect
from django.template.response import TemplateResponse

from django_dbworker.admin.base import may, refuse_parameters
from django_dbworker.conf import dbworker_settings
from django_dbworker.fleet.models import LiveWorker
from django_dbworker.fleet.register import live_workers

if TYPE_CHECKING:
    _WorkerModelAdmin = admin.ModelAdmin[LiveWorker]
else:  # ModelAdmin is generic only in django-stubs
    _WorkerModelAdmin = admin.ModelAdmin

#: Up to this many handler names are listed; more are counted (all of them on hover).
HANDLERS_LISTED = 4


def workers_context() -> dict[str, Any]:
    rows = []
    for w in live_workers():
        listed = ", ".join(w.handlers)
        rows.append(
            {
                "name": w.name,
                "host": w.host,
                "pid": w.pid if w.pid is not None else "-",
                "queues": ", ".join(w.queues) if w.queues else "all",
                "handlers": listed if len(w.handlers) <= HANDLERS_LISTED else "",
                "handler_count": len(w.handlers),
                "handlers_title": listed,
                "concurrency": w.concurrency,
                "claimed": w.claimed,
                "heartbeat_age": f"{w.heartbeat_age:.1f}s ago",
                "started_at": f"{w.started_at.astimezone(UTC):%Y-%m-%d %H:%M:%S} UTC",
                "version": w.version or "-",
            }
        )
    return {"rows": rows, "stale_after": f"{float(dbworker_settings.STALE_AFTER):g}"}


class WorkersAdmin(_WorkerModelAdmin):
    """One read-only page: the live workers."""

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        opts = LiveWorker._meta
        own = request.user.has_perm(f"{opts.app_label}.view_{opts.model_name}")
        return own or may(request, "view") or may(request, "change")

    # Rows are written by the workers alone.
    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_module_permission(self, request: HttpRequest) -> bool:
        return self.has_view_permission(request)

    def change_view(self, request: HttpRequest, object_id: str, *args: Any, **kwargs: Any) -> Any:
        return redirect("admin:django_dbworker_liveworker_changelist")

    def changelist_view(  # the workers page replaces the list
        self, request: HttpRequest, extra_context: Any = None
    ) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        if request.method != "GET":
            return HttpResponseNotAllowed(["GET"])
        refuse_parameters(request)
        context = {
            **self.admin_site.each_context(request),
            **workers_context(),
            "title": "Workers",
            "opts": self.model._meta,
        }
        return TemplateResponse(request, "admin/django_dbworker/workers.html", context)
