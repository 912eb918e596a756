"""The payload search of the work item lists: what a search term asks of payloads.

Two forms, both exact: ``payload.user.id=5`` (one key path, dots between
the keys, and a value) and ``{"user": {"id": 5}, "kind": "refund"}`` (a
JSON object: every key path it gives, each with its value). A value is
JSON when it reads as JSON (``5``, ``true``, ``null``, ``"5"``), else the
text as typed (``payload.email=ann@example.com``). Only scalars are
searched: an array or an empty object would mean one thing on PostgreSQL
(``@>`` containment) and another elsewhere.

This module only reads the term into ``(path, value)`` leaves, or says why
it cannot; the query is the database's (``VendorOperations.payload_matches``)
and the rows it may look at are the admin's (``display.handlers_with_shown_payloads``).
Plain words are not payload searches: they stay the indexed exact matches.
"""

from __future__ import annotations

import json
import math
from typing import Any

from django_dbworker.db.expressions import JsonScalar

#: What starts the path form; a term starting with ``{`` is the object form.
PREFIX = "payload."
#: Keys in one path, and leaves in one search: bounds on the SQL a term makes
#: (SQLite refuses expressions nested past 1,000; MariaDB JSON past 32 levels).
MAX_DEPTH = 16
MAX_LEAVES = 20
#: Integers beyond 2**53 are not exact as doubles, which SQLite and MariaDB
#: compare JSON numbers as (RFC 8259, section 6).
MAX_EXACT_INTEGER = 2**53

Leaf = tuple[tuple[str, ...], JsonScalar]


class SearchTermError(ValueError):
    """A term in a payload form that cannot be searched; the message says why, for the user."""


def payload_leaves(term: str) -> list[Leaf] | None:
    """The ``(path, value)`` leaves ``term`` asks payloads to hold; None: no payload search.

    Raises ``SearchTermError`` for a term in a payload form that is not valid.
    """
    if term.startswith("{"):
        return _object_leaves(term)
    if term.startswith(PREFIX):
        return [_path_leaf(term)]
    return None


def _path_leaf(term: str) -> Leaf:
    keys, equals, text = term[len(PREFIX) :].partition("=")
    if not equals:
        raise SearchTermError(f"{term} has no value: write {PREFIX}KEY=VALUE.")
    path = tuple(key.strip() for key in keys.split("."))
    for key in path:
        _check_key(key)
    if len(path) > MAX_DEPTH:
        raise SearchTermError(f"A payload path has at most {MAX_DEPTH} keys.")
    return path, _value(text.strip(), f"{PREFIX}{keys.strip()}")


def _value(text: str, where: str) -> JsonScalar:
    """``text`` as JSON when it reads as a JSON scalar, else the text itself."""
    try:
        value: Any = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        if text.startswith('"'):
            raise SearchTermError(
                f"The value of {where} starts with a quote but is no JSON string: "
                'close the quote, and escape a quote inside as \\".'
            ) from None
        value = text
    if isinstance(value, list | dict):
        raise SearchTermError(
            f"The value of {where} is an array or an object: only text, numbers, "
            "true, false and null can be searched."
        )
    return _checked(value, where)


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")  # NaN, Infinity: searched as text


def _object_leaves(term: str) -> list[Leaf]:
    try:
        document = json.loads(term, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        raise SearchTermError(
            f"{_short(term)} is not a JSON object; "
            'write it as JSON, e.g. {"user": 5} (keys and text in double quotes).'
        ) from None
    if not isinstance(document, dict):
        raise SearchTermError(f"{_short(term)} is not a JSON object.")
    leaves: list[Leaf] = []
    _flatten(document, (), leaves)
    if len(leaves) > MAX_LEAVES:
        raise SearchTermError(f"A payload search compares at most {MAX_LEAVES} values.")
    return leaves


def _flatten(node: dict[str, Any], path: tuple[str, ...], leaves: list[Leaf]) -> None:
    where = PREFIX + ".".join(path) if path else "the object"
    if not node:
        raise SearchTermError(f"{where} is an empty object, which every object would match.")
    if len(path) >= MAX_DEPTH:
        raise SearchTermError(f"A payload path has at most {MAX_DEPTH} keys.")
    for key, value in node.items():
        _check_key(key)
        if isinstance(value, dict):
            _flatten(value, (*path, key), leaves)
        elif isinstance(value, list):
            raise SearchTermError(
                f"{PREFIX}{'.'.join((*path, key))} is an array: only text, numbers, "
                "true, false and null can be searched."
            )
        else:
            leaves.append(((*path, key), _checked(value, PREFIX + ".".join((*path, key)))))


def _check_key(key: str) -> None:
    if not key:
        raise SearchTermError("A payload key is empty (two dots in a row, or one at an end).")
    if '"' in key or "\\" in key:
        raise SearchTermError(f"The payload key {_short(key)} has a quote or a backslash.")
    if key.startswith("-"):
        # MariaDB 10.11 reads no quoted path key that starts with "-" ($."-1", $."-a").
        raise SearchTermError(
            f"The payload key {_short(key)} starts with '-', which MariaDB cannot look up."
        )
    _check_text(key, f"The payload key {_short(key)}")


def _checked(value: Any, where: str) -> JsonScalar:
    if isinstance(value, str):
        _check_text(value, f"The value of {where}")
    elif isinstance(value, float) and not math.isfinite(value):
        raise SearchTermError(f"The value of {where} is too large a number.")
    elif (
        isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_EXACT_INTEGER
    ) or (
        # A float there stands for several integers (2**53 + 1 reads as 2**53).
        isinstance(value, float) and abs(value) >= MAX_EXACT_INTEGER
    ):
        raise SearchTermError(
            f"The value of {where} is beyond ±2**53, where numbers are not compared exactly."
        )
    return value  # type: ignore[no-any-return]


def _check_text(text: str, what: str) -> None:
    # PostgreSQL's jsonb holds no NUL character; a lone surrogate is no UTF-8.
    if "\x00" in text:
        raise SearchTermError(f"{what} holds a NUL character.")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise SearchTermError(f"{what} is not valid Unicode.") from None


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"
