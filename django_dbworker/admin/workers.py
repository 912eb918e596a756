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
from typing import Any

from django.http import HttpRequest

from django_dbworker.admin.base import may
from django_dbworker.admin.page import PageAdmin
from django_dbworker.conf import dbworker_settings
from django_dbworker.fleet.models import LiveWorker
from django_dbworker.fleet.register import live_workers

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


class WorkersAdmin(PageAdmin):
    """One read-only page: the live workers."""

    template = "admin/django_dbworker/workers.html"
    title = "Workers"

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        opts = LiveWorker._meta
        own = request.user.has_perm(f"{opts.app_label}.view_{opts.model_name}")
        return own or may(request, "view") or may(request, "change")

    # Rows are written by the workers alone.
    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def page_context(self, request: HttpRequest) -> dict[str, Any]:
        return workers_context()
