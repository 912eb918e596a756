"""A paginator that never counts a big table row by row.

Django's changelist counts its queryset for the paginator. On a table of
millions of rows that COUNT(*) is the slowest query of the page. This
paginator counts at most ``CAP + 1`` rows (an index-ordered, LIMITed
subquery) and, past the cap, asks the database's planner for an estimate
(``estimate_count``; PostgreSQL has one), as the admin only needs "how many
pages, roughly".
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

from django.core.paginator import Paginator

from django_dbworker.db import operations

#: Exact counts up to this many rows; estimates beyond.
CAP = 10_000


class EstimatedCountPaginator(Paginator):  # type: ignore[type-arg]
    #: True when ``count`` is an estimate (the template says "about").
    estimated = False

    @cached_property
    def count(self) -> int:
        qs: Any = self.object_list
        if not hasattr(qs, "explain"):  # a list, not a queryset
            return len(qs)
        # Ordered by the primary key so the LIMITed subquery walks an index.
        exact = int(qs.order_by("-pk")[: CAP + 1].count())
        if exact <= CAP:
            return exact
        self.estimated = True
        estimate = operations(qs.db).estimate_count(qs)
        return max(estimate or 0, CAP + 1)

    @property
    def count_label(self) -> str:
        """The count as the lists say it: exact, or "at least 10,000" past the cap."""
        count = self.count  # sets ``estimated``
        return f"at least {CAP:,}" if self.estimated else f"{count:,}"
