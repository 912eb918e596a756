"""PostgreSQL text formats: fields of COPY text, and text arrays as the server prints them.

Pure text, for ``postgresql.py`` (its COPY path and its planner estimates);
imports nothing and runs no SQL.
"""

from __future__ import annotations

import csv


def copy_text(value: str) -> str:
    """``value`` as a field of COPY's text format (backslash escapes)."""
    return (
        value.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")
    )


def copy_nullable(value: str | int | None) -> str:
    """A text or integer value as a COPY field; None is SQL NULL."""
    return "\\N" if value is None else copy_text(str(value))


def copy_payload(payload_json: str | None) -> str:
    """A payload's JSON text as a COPY field; None (a JSON null payload) is SQL NULL."""
    # JSON from json.dumps holds no raw control characters, only backslashes
    # need doubling; copy_text escapes all four anyway, so any text stays exact.
    if payload_json is None:
        return "\\N"
    return copy_text(payload_json)


def parse_text_array(text: str) -> list[str]:
    """Parse PostgreSQL's text form of a one-dimensional text array."""
    inner = text[1:-1] if text.startswith("{") and text.endswith("}") else text
    if not inner:
        return []
    reader = csv.reader([inner], delimiter=",", quotechar='"', escapechar="\\")
    return next(reader)
