"""PostgreSQL's read-only estimates for the admin and the stats: planner counts, run times.

What the admin's big-table pages and ``stats`` read without counting rows:
the planner's row estimate of a query, ``pg_class``/``pg_stats`` for the
table, percentiles of recent run times. Apart from the claim and write
paths of ``postgresql.py`` (which inherits this class) so that each module
holds one concern; every text is a statement of ``postgresql_sql.py``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from django.db.models import QuerySet

from django_dbworker.db.base import VendorOperations
from django_dbworker.db.postgresql_sql import (
    DISTINCT_QUEUES,
    ESTIMATE_COUNT,
    RUN_TIMES,
    TABLE_ESTIMATE,
)
from django_dbworker.db.postgresql_text import parse_text_array
from django_dbworker.db.types import ColumnStats, RunTimes, TableEstimate


class PostgresEstimates(VendorOperations):
    """The estimates half of ``PostgresOperations``."""

    def distinct_queues(self) -> list[str]:
        return [name for (name,) in self._fetch(DISTINCT_QUEUES.sql)]

    def estimate_count(self, queryset: QuerySet[Any]) -> int | None:
        sql, params = queryset.order_by().query.get_compiler(using=self.using).as_sql()
        ((plan,),) = self._fetch(ESTIMATE_COUNT.render(query=sql), params)
        # Django's psycopg setup loads json as text on some versions, as objects on others.
        if isinstance(plan, str):
            plan = json.loads(plan)
        return int(plan[0]["Plan"]["Plan Rows"])

    def run_times(self, since: timedelta, sample: int) -> list[RunTimes]:
        # All the rows of the window: the database sorts them, nothing is sampled.
        rows = self._fetch(RUN_TIMES.sql, {"seconds": since.total_seconds()})
        return [
            RunTimes(handler, count, max(0.0, p50), max(0.0, p95))
            for handler, count, (p50, p95) in rows
        ]

    def table_estimate(self, columns: Sequence[str]) -> TableEstimate | None:
        rows = self._fetch(TABLE_ESTIMATE.sql, {"columns": list(columns)})
        # reltuples is -1 (or 0) before the first ANALYZE: nothing to estimate from.
        if not rows or rows[0][0] is None or rows[0][0] <= 0:
            return None
        reltuples = float(rows[0][0])
        stats: dict[str, ColumnStats] = {}
        for _, name, values, freqs, n_distinct in rows:
            if name is None:
                continue
            parsed = parse_text_array(values) if values else []
            distinct = float(n_distinct or 0)
            if distinct < 0:  # a negative n_distinct is a fraction of the rows
                distinct = -distinct * reltuples
            stats[name] = ColumnStats(dict(zip(parsed, freqs or [], strict=False)), distinct)
        if set(stats) != set(columns):
            return None
        return TableEstimate(reltuples, stats)
