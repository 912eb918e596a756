"""Vendor SQL that the ORM's updates embed: expressions, not statements.

The worker's fenced UPDATEs are written with the ORM (``transitions.py``);
where one of them needs a function the ORM does not have, the function is
here, spelled once per vendor.
"""

from __future__ import annotations

import string
from typing import Any

from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import Func, JSONField
from django.db.models.expressions import Combinable
from django.db.models.sql.compiler import SQLCompiler

#: A JSON array with one entry appended, dropping the oldest entry when it
#: already holds ``limit``. NULL, and anything that is not an array (a value
#: edited by hand), counts as empty: the write that records an outcome must
#: not fail on it. ``{a}`` is the array, ``{e}`` the entry (a JSON object),
#: ``{n}`` the limit (an integer literal).
_APPEND_CAPPED = {
    "postgresql": (
        "(CASE WHEN jsonb_typeof({a}) IS DISTINCT FROM 'array' THEN '[]'::jsonb "
        "WHEN jsonb_array_length({a}) >= {n} THEN {a} - 0 ELSE {a} END) "
        "|| jsonb_build_array({e})"
    ),
    "sqlite": (
        "json_insert(CASE WHEN {a} IS NULL OR NOT json_valid({a}) "
        "OR json_type({a}) != 'array' THEN '[]' "
        "WHEN json_array_length({a}) >= {n} THEN json_remove({a}, '$[0]') ELSE {a} END, "
        "'$[#]', json({e}))"
    ),
    "mysql": (
        "JSON_ARRAY_APPEND(CASE WHEN {a} IS NULL OR JSON_TYPE({a}) != 'ARRAY' "
        "THEN JSON_ARRAY() WHEN JSON_LENGTH({a}) >= {n} THEN JSON_REMOVE({a}, '$[0]') "
        "ELSE {a} END, '$', {e})"
    ),
}


class AppendCapped(Func):
    """``array`` (a JSON column) with ``entry`` appended, keeping the newest ``limit``.

    One expression in the same fenced UPDATE that records the outcome, so
    the history and the outcome are written together or not at all, and
    no read-modify-write races another writer of the row.
    """

    output_field = JSONField()

    def __init__(self, array: Combinable, entry: Combinable, *, limit: int) -> None:
        if limit < 1:
            raise ValueError("limit must be at least 1")
        super().__init__(array, entry)
        self.limit = int(limit)

    def as_sql(  # type: ignore[override]
        self,
        compiler: SQLCompiler,
        connection: BaseDatabaseWrapper,
        **extra: Any,
    ) -> tuple[str, list[Any]]:
        template = _APPEND_CAPPED.get(connection.vendor)
        if template is None:
            raise NotImplementedError(f"AppendCapped has no SQL for {connection.vendor!r}")
        array, entry = self.get_source_expressions()
        array_sql, array_params = compiler.compile(array)
        entry_sql, entry_params = compiler.compile(entry)
        # Each placeholder's parameters in the order they appear in the text.
        params: list[Any] = []
        pieces = {"a": (array_sql, array_params), "e": (entry_sql, entry_params)}
        for _, name, _, _ in string.Formatter().parse(template):
            if name in pieces:
                params.extend(pieces[name][1])
        sql = template.format(a=array_sql, e=entry_sql, n=self.limit)
        return sql, params
