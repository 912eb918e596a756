"""The confirmation page of an action on every row that matches a list's filter.

Django's "Select all N" hands an action the list's whole filtered queryset.
Before ``actions`` changes those rows (in batches), this page says which
filter, how many rows match and how many of them the action would change,
counted as the lists count (exactly up to ``pagination.CAP``, then "at
least"), and asks to confirm, as Django's delete confirmation does. A run
that stopped for time shows this page again, with what it changed so far
and a button that goes on where it stopped. It changes nothing itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.contrib.admin import helpers
from django.db.models import QuerySet
from django.http import HttpRequest
from django.template.response import TemplateResponse

from django_dbworker.admin.pagination import CAP

if TYPE_CHECKING:
    from django_dbworker.admin.actions import BatchRun, Verb

#: Query parameters that change how a list looks, not which rows it holds.
_NOT_FILTERS = {"o", "p", "all", "_changelist_filters", "_to_field", "_popup"}
#: How the filter parameters read on the page.
_NAMES = {"q": "search", "status__exact": "status"}


def capped_count(queryset: QuerySet[Any]) -> tuple[int, bool]:
    """``(n, capped)``: the rows of ``queryset``, counted up to ``CAP`` as the lists count them."""
    # Ordered by the primary key so the LIMITed subquery walks an index.
    n = int(queryset.order_by("-pk")[: CAP + 1].count())
    return (CAP, True) if n > CAP else (n, False)


def describe(count: tuple[int, bool]) -> str:
    n, capped = count
    return f"at least {n:,}" if capped else f"{n:,}"


def filters(request: HttpRequest) -> list[tuple[str, str]]:
    """The list's filter (and search) as ``(name, value)`` pairs, for the page to show."""
    return [
        (_NAMES.get(key, key), value)
        for key, values in request.GET.lists()
        if key not in _NOT_FILTERS
        for value in values
    ]


def progress(request: HttpRequest) -> tuple[int | None, int, int]:
    """``(before, changed, read)`` carried by a page that goes on with a stopped run."""

    def number(name: str) -> int | None:
        value = request.POST.get(name, "")
        return int(value) if value.isascii() and value.isdigit() and len(value) < 19 else None

    return number("dbw_before"), number("dbw_changed") or 0, number("dbw_read") or 0


def confirmation_page(
    modeladmin: Any,
    request: HttpRequest,
    verb: Verb,
    queryset: QuerySet[Any],
    done: BatchRun | None = None,
) -> TemplateResponse:
    """The page that asks to apply ``verb`` to the rows of ``queryset`` (what is left of them)."""
    rows = queryset if done is None or done.before is None else queryset.filter(pk__lt=done.before)
    matching = capped_count(rows)
    eligible = capped_count(rows.filter(status__in=verb.statuses))
    opts = modeladmin.model._meta
    context = {
        **modeladmin.admin_site.each_context(request),
        "title": f"{verb.button}: every matching work item",
        "opts": opts,
        "verb": verb,
        "filters": filters(request),
        "matching": describe(matching),
        "eligible": describe(eligible),
        "eligible_count": eligible[0],
        "states": ", ".join(str(s) for s in verb.statuses),
        "done": done,
        "selected": request.POST.getlist(helpers.ACTION_CHECKBOX_NAME),
        "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
        "back": request.get_full_path(),
        "media": modeladmin.media,
    }
    return TemplateResponse(request, "admin/django_dbworker/action_confirmation.html", context)
