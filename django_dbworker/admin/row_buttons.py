"""A row's change page: Retry / Cancel / Run now buttons, and claim fields only while claimed.

``RowButtons`` is mixed into ``BaseWorkItemAdmin``. Each button is a small
form that POSTs (with the CSRF token) to a view under the page's own URLs
(``<id>/action/<name>/``); the view runs the list's action on that one row,
through ``actions.run_selected``, so it changes and reports exactly as the
list does, and redirects back to the row's page with that message. A
button shows only to users with the change permission, only for the
actions the page's list offers, and only where the row's state allows it
(``Verb.statuses``); the view checks all of it again, since a page may be
old by the time its button is pressed.

The claim fields (claimed by, claimed at, heartbeat at, claim token) are
left out of the page of a row that is not claimed: a retried row keeps the
values of its last claim, which read as if a worker held it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.contrib.admin.utils import quote, unquote
from django.core.exceptions import PermissionDenied
from django.http import (
    Http404,
    HttpRequest,
    HttpResponse,
    HttpResponseNotAllowed,
    HttpResponseRedirect,
)
from django.urls import URLPattern, path, reverse

from django_dbworker.admin import actions
from django_dbworker.models import Status, WorkItem

if TYPE_CHECKING:
    from django.contrib import admin

    _Base = admin.ModelAdmin[WorkItem]
else:
    _Base = object

#: The fieldset of the claim's fields, hidden on rows that are not claimed.
CLAIM_FIELDSET = "Claim"


class RowButtons(_Base):
    change_form_template = "admin/django_dbworker/change_form.html"

    def get_fieldsets(self, request: HttpRequest, obj: Any = None) -> Any:
        fieldsets = super().get_fieldsets(request, obj)
        if obj is None or obj.status == Status.CLAIMED:
            return fieldsets
        return [(name, options) for name, options in fieldsets if name != CLAIM_FIELDSET]

    def get_urls(self) -> list[URLPattern]:
        opts = self.model._meta
        row_action = path(
            "<path:object_id>/action/<str:name>/",
            self.admin_site.admin_view(self.row_action_view),
            name=f"{opts.app_label}_{opts.model_name}_row_action",
        )
        return [row_action, *super().get_urls()]

    def row_verbs(self, request: HttpRequest, obj: WorkItem) -> list[actions.Verb]:
        """The actions whose button ``obj``'s page shows to this user."""
        if not self.has_change_permission(request):
            return []
        offered = self.get_actions(request)
        return [
            verb
            for name, verb in actions.VERBS.items()
            if name in offered
            and obj.status in verb.statuses
            # A waiting row is due when its parents say so, not on request.
            and not (name == actions.RUN_NOW.name and obj.waiting)
        ]

    def render_change_form(
        self,
        request: HttpRequest,
        context: dict[str, Any],
        add: bool = False,
        change: bool = False,
        form_url: str = "",
        obj: Any = None,
    ) -> HttpResponse:
        if obj is not None:
            opts = self.model._meta
            name = f"{self.admin_site.name}:{opts.app_label}_{opts.model_name}_row_action"
            context["dbw_row_buttons"] = [
                {
                    "name": verb.name,
                    "label": verb.button,
                    "url": reverse(name, args=[quote(obj.pk), verb.name]),
                }
                for verb in self.row_verbs(request, obj)
            ]
        return super().render_change_form(request, context, add, change, form_url, obj)

    def row_action_view(self, request: HttpRequest, object_id: str, name: str) -> HttpResponse:
        """POST: run the action ``name`` on this one row, then back to its page with the report."""
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        verb = actions.VERBS.get(name)
        if verb is None or name not in self.get_actions(request):
            if not self.has_change_permission(request):
                raise PermissionDenied
            raise Http404(f"No action {name!r} on this page.")
        if not self.has_change_permission(request):
            raise PermissionDenied
        obj = self.get_object(request, unquote(object_id))
        if obj is None:
            raise Http404("No such work item on this page.")
        actions.run_selected(self, request, verb, WorkItem.objects.filter(pk=obj.pk))
        return HttpResponseRedirect(self.row_page(request, obj.pk))

    def row_page(self, request: HttpRequest, pk: int) -> str:
        """The row's page here, or on the Work items page if the action moved it off this one."""
        opts = self.model._meta
        if self.get_queryset(request).filter(pk=pk).exists():
            page = f"{opts.app_label}_{opts.model_name}"
        else:
            page = f"{opts.app_label}_workitem"
        return reverse(f"{self.admin_site.name}:{page}_change", args=[quote(pk)])
