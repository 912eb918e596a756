"""The Queue summary page's admin: the dashboard in place of a change list.

The figures and their shaping are ``summary``'s; this module only serves
them, to users who may view work items (the permissions of ``WorkItem``,
not of the ``QueueSummary`` proxy). It takes no query parameters.
"""

from __future__ import annotations

from typing import Any

from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse

from django_dbworker.admin.base import BaseWorkItemAdmin, refuse_parameters
from django_dbworker.admin.summary import summary_context


class QueueSummaryAdmin(BaseWorkItemAdmin):
    """One page: counts per queue and status, queue lag, rows of stale workers."""

    def changelist_view(  # the summary page replaces the list
        self, request: HttpRequest, extra_context: Any = None
    ) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        refuse_parameters(request)
        context = {
            **self.admin_site.each_context(request),
            **summary_context(),
            "title": "Queue summary",
            "opts": self.model._meta,
        }
        return TemplateResponse(request, "admin/django_dbworker/summary.html", context)
