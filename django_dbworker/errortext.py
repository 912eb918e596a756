"""Error text: what an exception becomes in ``last_error``, log lines and spans.

Turns exceptions into the text the rest of the package stores and shows:
the full record of ``last_error`` (type, message, traceback, cut to 10 kB),
the one-line summary of a log line, the class path of ``error_history``,
with messages replaced for ``sensitive`` handlers. Also the JSON encoding
of values the worker stores (``ensure_json``). Pure text: a declaration
that imports nothing from the package, reads no settings and never touches
the database, so every layer (state changes, tracing, the Tasks backend)
can use it.
"""

from __future__ import annotations

import json
import re
import traceback
from typing import Any

#: ``last_error`` is cut to this many bytes of UTF-8 (SPEC: 10 kB).
MAX_ERROR_BYTES = 10_000
#: What replaces exception messages of sensitive handlers.
REDACTED = "[redacted]"

#: Characters that end, forge or hide a line, or drive the terminal showing
#: it: C0 controls, DEL, C1 controls (NEL U+0085, CSI U+009B among them),
#: and Unicode's line and paragraph separators. Stored text keeps ``\n`` and
#: ``\t`` (a traceback's lines and indents); a log line keeps neither.
_STORED_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029]")
_LINE_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
#: A log line's words stay apart where the message broke its lines.
_SPACED = str.maketrans("\n\t", "  ")

_TRUNCATED = "\n... (truncated) ...\n"
# The interpreter's own words between chained exceptions.
_CAUSE = "\nThe above exception was the direct cause of the following exception:\n\n"
_CONTEXT = "\nDuring handling of the above exception, another exception occurred:\n\n"


def exception_class_path(exc: BaseException) -> str:
    """``module.QualName`` of the exception's class, importable (``builtins.`` kept)."""
    cls = type(exc)
    return f"{getattr(cls, '__module__', 'builtins')}.{getattr(cls, '__qualname__', cls.__name__)}"


def format_error(
    exc: BaseException, *, include_traceback: bool = True, sensitive: bool = False
) -> str:
    """Exception type, message and traceback as ``last_error`` stores them.

    Never raises: formatting runs user code (``__str__``), and a failure that
    cannot be formatted must still be recorded. For ``sensitive`` handlers
    every message in the chain is replaced by ``[redacted]`` (a message may
    quote the payload); types and frames stay, since they are what a reader
    needs. NUL characters, which PostgreSQL's text columns refuse, are
    escaped; the text is cut to ``MAX_ERROR_BYTES`` bytes of UTF-8.
    """
    try:
        text = _redacted(exc, include_traceback) if sensitive else _plain(exc, include_traceback)
        return clean_error_text(text)
    except Exception:
        return clean_error_text(f"{_type_name(exc)}: (the exception could not be formatted)")


def clean_error_text(text: str) -> str:
    """``text`` as every database stores it: valid UTF-8, controls escaped, at most 10 kB.

    Messages quote file names and bytes: a lone surrogate (undecodable bytes
    read with ``surrogateescape``) cannot be encoded, so it is written as a
    backslash escape instead of making the failure unrecordable. Control
    characters but ``\n`` and ``\t`` are written as escapes too (``\x00``,
    which PostgreSQL's text columns refuse, ``\r``, ``\x1b``, ``\u2028``):
    the admin, a terminal or a log shipper reading ``last_error`` sees the
    text the exception held, never a line it forged or colours it set.
    """
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return cap_text(_escape_controls(text, _STORED_CONTROL), MAX_ERROR_BYTES)


def error_summary(exc: BaseException, *, sensitive: bool = False, limit: int = 500) -> str:
    """One short line for logs: ``Type: message``, never raising, secrets redacted.

    One line whatever the message holds: newlines and tabs become spaces,
    every other control character (``\r``, ANSI escapes, NEL, U+2028...) an
    escape, so an exception cannot forge log lines or drive a terminal.
    """
    if sensitive:
        line = clean_error_text(f"{_type_name(exc)}: {REDACTED}")
    else:
        line = format_error(exc, include_traceback=False)
    line = _escape_controls(line.translate(_SPACED), _LINE_CONTROL)
    return line if len(line) <= limit else line[: limit - 3] + "..."


def cap_text(text: str, max_bytes: int) -> str:
    """``text`` cut in the middle to at most ``max_bytes`` bytes of UTF-8.

    The head (type and message) and the tail (the innermost frames) are what
    a reader needs; the middle of a long traceback is not.
    """
    data = text.encode("utf-8")
    if len(data) <= max_bytes:
        return text
    room = max_bytes - len(_TRUNCATED.encode("utf-8"))
    head = data[: room // 2].decode("utf-8", "ignore")
    tail = data[len(data) - (room - room // 2) :].decode("utf-8", "ignore")
    return head + _TRUNCATED + tail


class Unencodable:
    """A return value that its handler already found JSON cannot hold, and why.

    The Tasks backend's handler returns one when Django's ``normalize_json``
    refuses a task's value: ``ensure_json`` then raises Django's own error
    ("Unsupported type: ..."), as Django's backends report it, instead of
    the encoder's words.
    """

    __slots__ = ("error",)

    def __init__(self, error: TypeError | ValueError) -> None:
        self.error = error


def ensure_json(value: Any, what: str) -> str:
    """JSON-encode ``value`` or raise ``TypeError`` naming ``what``."""
    if isinstance(value, Unencodable):
        if isinstance(value.error, TypeError):
            raise value.error
        # A TypeError for the callers that catch one, with the same words.
        raise TypeError(str(value.error)) from value.error
    try:
        return json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{what} is not JSON-serialisable: {exc}") from None


def traceback_text(stored: str) -> str:
    """The traceback in a ``format_error`` text, as ``traceback.format_exception`` gives it.

    ``format_error`` writes the summary line first (the admin shows it),
    then a blank line, then the traceback, which ends with that summary
    again: the traceback is what follows the first blank line whose text
    before it ends the text. Text of another shape (a worker's own words:
    "result could not be stored: ...", a lost worker) is returned whole,
    with the final newline a traceback has.
    """
    start = 0
    while (cut := stored.find("\n\n", start)) >= 0:
        summary, rest = stored[:cut], stored[cut + 2 :]
        if rest.endswith(summary) or rest.startswith("Traceback (most recent call last):\n"):
            return rest + "\n"
        start = cut + 1
    return stored if stored.endswith("\n") else stored + "\n"


def _escape_controls(text: str, controls: re.Pattern[str]) -> str:
    """``text`` with each of ``controls`` written as its Python escape (``\\x1b``)."""
    if text.isprintable():  # the common case: nothing to look for
        return text
    return controls.sub(_escape, text)


def _escape(match: re.Match[str]) -> str:
    return repr(match.group())[1:-1]


def _type_name(exc: BaseException) -> str:
    cls = type(exc)
    module = getattr(cls, "__module__", "")
    name = getattr(cls, "__qualname__", cls.__name__)
    return name if module in ("builtins", "__main__", "") else f"{module}.{name}"


def _plain(exc: BaseException, include_traceback: bool) -> str:
    # The summary line comes first so that the admin's "first line" is useful.
    text = "".join(traceback.format_exception_only(exc)).strip()
    if include_traceback:
        text += "\n\n" + "".join(traceback.format_exception(exc)).strip()
    return text


def _redacted(exc: BaseException, include_traceback: bool) -> str:
    summary = f"{_type_name(exc)}: {REDACTED}"
    if not include_traceback:
        return summary
    # The chain as the interpreter prints it, oldest first, messages replaced.
    chain: list[tuple[BaseException, str]] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    link = ""
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        chain.append((current, link))
        if current.__cause__ is not None:
            current, link = current.__cause__, _CAUSE
        elif current.__context__ is not None and not current.__suppress_context__:
            current, link = current.__context__, _CONTEXT
        else:
            current = None
    parts = []
    for index, (item, _) in enumerate(reversed(chain)):
        if index:
            parts.append(chain[len(chain) - index][1])
        if item.__traceback__ is not None:
            parts.append("Traceback (most recent call last):\n")
            parts.extend(traceback.format_tb(item.__traceback__))
        parts.append(f"{_type_name(item)}: {REDACTED}\n")
    return summary + "\n\n" + "".join(parts).strip()
