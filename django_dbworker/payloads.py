"""A payload as the JSON text enqueue stores, or an ``EnqueueError`` saying why not.

What the encoding would lose or no database would store is refused here,
before anything is written: not JSON, too big, a NUL or a lone surrogate,
a dict key that is not a string (JSON would turn it into one). Tuples are
accepted: they are JSON arrays and arrive as lists. The common payload
pays one ``json.dumps`` and a few searches of its text; the payload is
walked only when a search finds a suspect. Messages name what and where,
never a value: payloads may be sensitive. No database access.
"""

from __future__ import annotations

import json
import re
from typing import Any

from django_dbworker.conf import dbworker_settings
from django_dbworker.errors import EnqueueError
from django_dbworker.validation import LONE_SURROGATE, NUL_CHARACTER, unstorable_text

#: What ``json.dumps`` (ASCII output) writes for the characters no database
#: stores as text: a NUL, and the escapes of surrogates (``\\ud800``-``\\udfff``).
#: Characters beyond U+FFFF are written as surrogate pairs, and a literal
#: backslash before such letters matches too; the walk then finds nothing.
_UNSTORABLE_ESCAPE = re.compile(r"\\u(?:0000|d[89a-f])")
#: Why each is refused, as the payload's error says it.
_WHY_REFUSED = {
    NUL_CHARACTER: "PostgreSQL cannot store it in JSON",
    LONE_SURROGATE: "it is not text that UTF-8 can encode",
}


def _unstorable_place(payload: Any) -> tuple[str, str] | None:
    """What no database stores, and where it sits in ``payload`` ("a dict key"), or None.

    Iterative, so it never recurses deeper than ``json.dumps`` just did.
    """
    stack = [payload]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            problem = unstorable_text(value)
            if problem is not None:
                return problem, "a string"
        elif isinstance(value, dict):
            for key, inner in value.items():
                if isinstance(key, str):
                    problem = unstorable_text(key)
                    if problem is not None:
                        return problem, "a dict key"
                stack.append(inner)
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
    return None


#: What ``json.dumps`` (default separators) writes for a dict key that is not
#: a string, an int, a float, True/False or None, turned into its JSON text:
#: ``{"12": `` or ``, "-2.5e+20": ``, ``{"true": ``... String keys that read
#: the same (``"12"``) match too; the walk tells them apart. Matched in the
#: reversed text, where the pattern starts with a literal (`` :"``, the end of
#: every key), which the regex engine scans for quickly: 2 us on 1 kB, where a
#: pattern that starts with ``"`` or a character class takes 5-10 us.
_CONVERTED_KEY_REVERSED = re.compile(r' :"(?:[-+.e0-9]*[0-9]-?|eurt|eslaf|llun)"[{ ]')


def _has_non_str_key(payload: Any) -> bool:
    """Whether a dict anywhere in ``payload`` has a key that is not a str (no paths built)."""
    stack = [payload]
    while stack:
        value = stack.pop()
        kind = type(value)
        if kind is dict or isinstance(value, dict):
            for key in value:
                if type(key) is not str and not isinstance(key, str):
                    return True
            stack.extend(value.values())
        elif kind is list or kind is tuple or isinstance(value, (list, tuple)):
            stack.extend(value)
    return False


def _non_str_key_path(payload: Any) -> tuple[str, Any] | None:
    """The path (``payload['a'][0][1]``) and the key of the first dict key that is not a str."""
    stack: list[tuple[Any, str]] = [(payload, "payload")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, dict):
            for key, inner in value.items():
                if not isinstance(key, str):
                    return f"{path}[{key!r}]", key
                stack.append((inner, f"{path}[{key!r}]"))
        elif isinstance(value, (list, tuple)):
            stack.extend((inner, f"{path}[{i}]") for i, inner in enumerate(value))
    return None


def _as_json_key(key: Any) -> str:
    """The string ``json.dumps`` makes of a non-string key (True: ``'true'``)."""
    return str(next(iter(json.loads(json.dumps({key: 0})))))


def _key_kind(key: Any) -> str:
    if key is None:
        return "None"
    name = type(key).__name__
    return f"{'an' if name[:1] in 'aeiou' else 'a'} {name}"


def encode_payload(payload: Any, *, max_depth: int | None = None) -> str:
    """The payload as JSON text; raises EnqueueError if it cannot arrive as it was sent.

    ``max_depth``: the nesting the database stores at most (MariaDB: 32 levels; its JSON
    CHECK constraint refuses deeper documents with an IntegrityError that says nothing of
    why), None for no limit."""
    try:
        encoded = json.dumps(payload, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise EnqueueError(f"Payload is not JSON-serialisable: {exc}.") from None
    except RecursionError:
        raise EnqueueError("Payload is nested too deeply to encode as JSON.") from None
    # The walk runs only when such an escape shows up in the text, so
    # ordinary payloads pay one search of the encoded text. The message
    # names what and where, never the text: payloads may be sensitive.
    if _UNSTORABLE_ESCAPE.search(encoded):
        found = _unstorable_place(payload)
        if found is not None:
            problem, place = found
            raise EnqueueError(
                f"Payload contains {problem} in {place}; {_WHY_REFUSED[problem]}, "
                "so it is refused on every database."
            )
    # JSON object keys are strings: json.dumps writes {1: "a"} as {"1": "a"},
    # and the handler's payload[1] would fail. Tuples stay accepted: they are
    # JSON arrays, and arrive as lists (Django Tasks' args are tuples). Like
    # the escapes above, one search of the text; the walk only on a match.
    if _CONVERTED_KEY_REVERSED.search(encoded[::-1]) and _has_non_str_key(payload):
        bad = _non_str_key_path(payload)
        if bad is not None:
            path, key = bad
            raise EnqueueError(
                f"Payload has a dict key that is not a string at {path} ({_key_kind(key)}): "
                f"JSON object keys are strings, so it would arrive as {_as_json_key(key)!r}. "
                "Use string keys."
            )
    # Only a text with that many brackets can nest that deep: one count for the others.
    if max_depth is not None and encoded.count("[") + encoded.count("{") > max_depth:
        depth = _depth(payload)
        if depth > max_depth:
            raise EnqueueError(
                f"Payload nests {depth} levels of lists and dicts; this database stores JSON "
                f"nested at most {max_depth} levels deep."
            )
    limit = int(dbworker_settings.MAX_PAYLOAD_BYTES)
    # json.dumps escapes every non-ASCII character: one character, one byte.
    size = len(encoded)
    if size > limit:
        raise EnqueueError(
            f"Payload is {size} bytes of JSON, more than MAX_PAYLOAD_BYTES ({limit})."
        )
    return encoded


def _depth(value: Any) -> int:
    """Levels of JSON arrays and objects in ``value`` (0 for a scalar)."""
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, (list, tuple)):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0
