"""Vendor SQL that the ORM's updates and queries embed: expressions, not statements.

The worker's fenced UPDATEs are written with the ORM (``transitions.py``);
where one of them, or a query of the admin, needs a function the ORM does
not have, the function is here, spelled once per vendor.
"""

from __future__ import annotations

import json
import string
from collections.abc import Sequence
from typing import Any

from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import BooleanField, F, Func, JSONField
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


#: A JSON scalar, as a payload search compares it.
JsonScalar = str | int | float | bool | None

#: ``{c}`` (a JSON column) holds at the path ``%s`` a value of the same JSON
#: type as the one searched, equal to it. Django's key lookups compare
#: extracted values without their types on SQLite and MariaDB (there, ``5``
#: finds ``"5"``, ``true`` finds ``"true"``, ``null`` finds ``"null"``, and
#: on MariaDB ``5`` misses ``5.0``), so each kind has its own test: the type
#: first, then the value. Numbers compare as numbers (5 equals 5.0, as on
#: PostgreSQL), strings exactly (case and accents count).
_JSON_EQUALS = {
    "sqlite": {
        "string": "(json_type({c}, %s) = 'text' AND json_extract({c}, %s) = %s)",
        "number": "(json_type({c}, %s) IN ('integer', 'real') AND json_extract({c}, %s) = %s)",
        "true": "json_type({c}, %s) = 'true'",
        "false": "json_type({c}, %s) = 'false'",
        "null": "json_type({c}, %s) = 'null'",
    },
    "mysql": {
        "string": (
            "(JSON_TYPE(JSON_EXTRACT({c}, %s)) = 'STRING' "
            "AND JSON_UNQUOTE(JSON_EXTRACT({c}, %s)) = CAST(%s AS CHAR) COLLATE {nopad_bin})"
        ),
        "number": (
            "(JSON_TYPE(JSON_EXTRACT({c}, %s)) IN ('INTEGER', 'UNSIGNED INTEGER', 'DOUBLE', "
            "'DECIMAL') AND JSON_EXTRACT({c}, %s) = %s)"
        ),
        "true": (
            "(JSON_TYPE(JSON_EXTRACT({c}, %s)) = 'BOOLEAN' "
            "AND JSON_UNQUOTE(JSON_EXTRACT({c}, %s)) = 'true')"
        ),
        "false": (
            "(JSON_TYPE(JSON_EXTRACT({c}, %s)) = 'BOOLEAN' "
            "AND JSON_UNQUOTE(JSON_EXTRACT({c}, %s)) = 'false')"
        ),
        "null": "JSON_TYPE(JSON_EXTRACT({c}, %s)) = 'NULL'",
    },
}


def json_kind(value: JsonScalar) -> str:
    """The name of ``value``'s JSON type as ``_JSON_EQUALS`` spells it."""
    if value is None:
        return "null"
    if isinstance(value, bool):  # before int: True is an int too
        return "true" if value else "false"
    return "string" if isinstance(value, str) else "number"


class JsonEquals(Func):
    """Whether the JSON ``column`` holds ``value`` at ``path`` (object keys, outermost first).

    A missing key, a value of another JSON type and a document that is not
    an object all answer false. Keys are quoted in the path, so ``"5"`` is
    the key "5", never an array index. PostgreSQL does not need this
    (``@>`` containment answers the same question and can use an index).
    """

    output_field = BooleanField()

    def __init__(self, column: str, path: Sequence[str], value: JsonScalar) -> None:
        if not path:
            raise ValueError("JsonEquals needs at least one key")
        super().__init__(F(column))
        self.path = "$" + "".join("." + json.dumps(key) for key in path)
        self.value = value

    def as_sql(  # type: ignore[override]
        self,
        compiler: SQLCompiler,
        connection: BaseDatabaseWrapper,
        **extra: Any,
    ) -> tuple[str, list[Any]]:
        templates = _JSON_EQUALS.get(connection.vendor)
        if templates is None:
            raise NotImplementedError(f"JsonEquals has no SQL for {connection.vendor!r}")
        kind = json_kind(self.value)
        column_sql, column_params = compiler.compile(self.get_source_expressions()[0])
        template = templates[kind]
        params: list[Any] = []
        for literal, name, _, _ in string.Formatter().parse(template):
            params.extend([self.path] * literal.count("%s"))
            if name == "c":
                params.extend(column_params)
        if kind in ("string", "number"):
            params[-1] = self.value  # the last placeholder is the value's
        # Byte for byte and NO PAD, as the key columns are (0001_initial): a binary PAD
        # SPACE collation (utf8mb4_bin) would find "alice" for "alice ".
        nopad_bin = (
            "utf8mb4_nopad_bin"
            if getattr(connection, "mysql_is_mariadb", False)
            else ("utf8mb4_0900_bin")
        )
        return template.format(c=column_sql, nopad_bin=nopad_bin), params
