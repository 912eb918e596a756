"""The Fair keys page: each fair key's weight, which an operator edits, and its pass.

A row is made by a key's first enqueue (or ``set_fair_weight``); its weight is checked
by the model field's validator (a positive number, at most a million), so the admin
refuses what ``set_fair_weight`` refuses. The pass is the rotation's state: read-only.
A key's row is deleted only once its items ended (``has_delete_permission``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.contrib import admin
from django.http import HttpRequest

from django_dbworker.flow.models import FairKey
from django_dbworker.models import ACTIVE_STATUSES, WorkItem

if TYPE_CHECKING:
    _ModelAdmin = admin.ModelAdmin[FairKey]
else:  # ModelAdmin is generic only in django-stubs
    _ModelAdmin = admin.ModelAdmin


class FairKeyAdmin(_ModelAdmin):
    list_display = ["name", "weight", "served"]
    list_editable = ["weight"]
    search_fields = ["=key"]
    ordering = ["key"]
    fields = ["key", "weight", "served"]
    readonly_fields = ["served"]

    @admin.display(description="fair key", ordering="key")
    def name(self, obj: FairKey) -> str:
        return str(obj)

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # Without its row a key gets no turns: its waiting items would run only in what a
        # flooding key's turns leave. Deletable once they ended (a key gone for good).
        if (
            obj is not None
            and obj.key
            and WorkItem.objects.using(obj._state.db)
            .filter(fair_key=obj.key, status__in=ACTIVE_STATUSES)
            .exists()
        ):
            return False
        return super().has_delete_permission(request, obj)

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        # A key is what its items carry: renaming the row would orphan them.
        return ["key", "served"] if obj is not None else ["served"]
