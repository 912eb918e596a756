"""JSON as bounded pretty text: what a change page can show of a value of any size or depth.

``json.dumps(indent=2)`` recurses once per level (a value nested 900 deep
is a RecursionError) and indents every line by its depth (a 96 kB value
nested a few hundred deep is tens of megabytes of spaces). ``bounded_json``
writes the same text without recursion, stops after a number of
characters and writes levels past a depth on one line.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

#: Characters of pretty JSON shown on a change page; the rest is cut, with a
#: note and a link to the raw value. Escaped, the text may grow up to six
#: times (``"`` is ``&quot;``), so payload and result stay well under 2 MB.
PRETTY_MAX_CHARS = 100_000
#: Levels indented one per line; deeper ones are written on one line. The
#: indentation of each line grows with its depth, so unbounded it turns a
#: small, deeply nested value into megabytes of spaces.
PRETTY_MAX_DEPTH = 20

_END = object()


class _Open:
    """A container being written: its entries left, its depth, how many were written."""

    __slots__ = ("closer", "depth", "entries", "is_dict", "written")

    def __init__(self, value: Any, depth: int) -> None:
        self.is_dict = isinstance(value, dict)
        self.entries: Iterator[Any] = (
            iter(sorted(value.items(), key=lambda kv: str(kv[0]))) if self.is_dict else iter(value)
        )
        self.closer = "}" if self.is_dict else "]"
        self.depth = depth
        self.written = 0


def bounded_json(
    value: Any, max_chars: int = PRETTY_MAX_CHARS, max_depth: int = PRETTY_MAX_DEPTH
) -> tuple[str, bool]:
    """``value`` as pretty JSON text, at most ``max_chars`` long; True if it was cut.

    The text is ``json.dumps(value, indent=2, sort_keys=True,
    ensure_ascii=False, default=str)``'s, except that containers nested
    deeper than ``max_depth`` are written on one line. It is produced
    without recursion (a value nested thousands deep is no RecursionError)
    and stops as soon as ``max_chars`` are written, so neither time nor
    memory depends on how large the value is beyond that.
    """
    stack: list[_Open] = []

    def start(item: Any, depth: int) -> str:
        if isinstance(item, dict | list | tuple):
            stack.append(_Open(item, depth))
            return "{" if isinstance(item, dict) else "["
        return json.dumps(item, ensure_ascii=False, default=str)

    out = [start(value, 0)]
    size = len(out[0])
    while stack and size <= max_chars:
        top = stack[-1]
        entry: Any = next(top.entries, _END)
        pretty = top.depth < max_depth
        if entry is _END:
            stack.pop()
            indent = "\n" + "  " * top.depth if pretty and top.written else ""
            chunk = indent + top.closer
        else:
            if pretty:
                chunk = ("," if top.written else "") + "\n" + "  " * (top.depth + 1)
            else:
                chunk = ", " if top.written else ""
            top.written += 1
            if top.is_dict:
                key, entry = entry
                chunk += json.dumps(str(key), ensure_ascii=False) + ": "
            chunk += start(entry, top.depth + 1)
        out.append(chunk)
        size += len(chunk)
    if not stack and size <= max_chars:
        return "".join(out), False
    return "".join(out)[:max_chars], True
