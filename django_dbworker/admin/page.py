"""A model's admin that is one page of its own, not Django's change list.

The Queues, Schedules and Workers pages each show a few rows of a model the
workers write, laid out for operators: no list, no add, change or delete
form (a row's change URL leads back to the page), no parameters
(``refuse_parameters``). A page with buttons posts to itself: ``post``
handles the form (the change permission is checked first) and the page is
shown again; a page without them answers a POST with 405.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, HttpResponseNotAllowed
from django.shortcuts import redirect
from django.template.response import TemplateResponse

from django_dbworker.admin.base import refuse_parameters

if TYPE_CHECKING:
    _ModelAdmin = admin.ModelAdmin[Any]
else:  # ModelAdmin is generic only in django-stubs
    _ModelAdmin = admin.ModelAdmin


class PageAdmin(_ModelAdmin):
    """One page in place of the change list: ``template``, ``title`` and ``page_context``."""

    template: str
    title: str
    #: Whether the page has buttons, whose form ``post`` handles.
    has_form = False

    def page_context(self, request: HttpRequest) -> dict[str, Any]:
        raise NotImplementedError

    def post(self, request: HttpRequest) -> None:
        """Do what the page's form asks (the change permission is checked already)."""
        raise NotImplementedError

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_module_permission(self, request: HttpRequest) -> bool:
        return self.has_view_permission(request)

    def change_view(self, request: HttpRequest, object_id: str, *args: Any, **kwargs: Any) -> Any:
        opts = self.model._meta
        return redirect(f"admin:{opts.app_label}_{opts.model_name}_changelist")

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        allowed = ["GET", "HEAD", *(["POST"] if self.has_form else [])]
        if request.method not in allowed:
            return HttpResponseNotAllowed(allowed)
        refuse_parameters(request)
        if request.method == "POST":
            if not self.has_change_permission(request):
                raise PermissionDenied
            self.post(request)
            return redirect(request.path)
        context = {
            **self.admin_site.each_context(request),
            **self.page_context(request),
            "title": self.title,
            "opts": self.model._meta,
        }
        return TemplateResponse(request, self.template, context)
