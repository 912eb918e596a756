"""A paginator that never counts a big table row by row.

Django's changelist counts its queryset for the paginator. On a table of
millions of rows that COUNT(*) is the slowest query of the page. This
paginator counts at most ``CAP + 1`` rows (an index-ordered, LIMITed
subquery) and, past the cap, asks PostgreSQL's planner for an estimate
(``EXPLAIN``), as the admin only needs "how many pages, roughly".
"""

from __future__ import annotations

import json
from functools import cached_property
from typing import Any

from django.core.paginator import Paginator
from django.db import connections

#: Exact counts up to this many rows; estimates beyond.
CAP = 10_000


def planner_estimate(queryset: Any) -> int | None:
    """PostgreSQL's estimated row count for ``queryset``, or None elsewhere."""
    if connections[queryset.db].vendor != "postgresql":
        return None
    plan = json.loads(queryset.order_by().explain(format="JSON"))
    return int(plan[0]["Plan"]["Plan Rows"])


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
        estimate = planner_estimate(qs)
        return max(estimate or 0, CAP + 1)
