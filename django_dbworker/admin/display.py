"""How work item values are shown: badges, human durations, pretty JSON."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString

from django_dbworker.admin.jsontext import PRETTY_MAX_CHARS, bounded_json
from django_dbworker.models import ERROR_HISTORY_LIMIT, Status, WorkItem
from django_dbworker.registry import registry

STATUS_COLOURS: dict[str, str] = {
    Status.PENDING.value: "#2f6fad",
    Status.CLAIMED.value: "#b7791f",
    Status.SUCCEEDED.value: "#2f855a",
    Status.FAILED.value: "#c53030",
    Status.CANCELLED.value: "#718096",
}
#: For a status this version does not know (a newer version's, or set by hand).
UNKNOWN_STATUS_COLOUR = "#444"


def badge(status: str) -> SafeString:
    """A coloured status label; any string renders, known status or not."""
    colour = STATUS_COLOURS.get(status, UNKNOWN_STATUS_COLOUR)
    return format_html(
        '<span class="dbw-status dbw-{}" style="color:#fff;background:{};padding:1px 7px;'
        'border-radius:8px;white-space:nowrap">{}</span>',
        status,
        colour,
        status,
    )


def cancel_requested_badge() -> SafeString:
    """The mark of a claimed row whose cancellation was requested (its handler is told)."""
    return format_html(
        '<span class="dbw-cancel-requested" title="{}" style="color:#fff;background:{};'
        'padding:1px 7px;border-radius:8px;white-space:nowrap">{}</span>',
        "Cancellation requested: the handler sees cancel_requested and may stop.",
        STATUS_COLOURS[Status.CANCELLED.value],
        "cancel requested",
    )


def waiting_badge() -> SafeString:
    """The mark of a pending row waiting for its parents (``after=``): no worker claims it yet."""
    return format_html(
        '<span class="dbw-waiting" title="{}" style="color:{};border:1px solid {};'
        'padding:0 6px;border-radius:8px;white-space:nowrap">{}</span>',
        "Waiting for its parents (after=): claimed once every one has succeeded.",
        STATUS_COLOURS[Status.PENDING.value],
        STATUS_COLOURS[Status.PENDING.value],
        "waiting",
    )


def db_now(item: WorkItem) -> datetime | None:
    """The database clock at query time (annotated by the admin's querysets)."""
    return getattr(item, "db_now", None)


def duration(seconds: float) -> str:
    """A short human duration: ``4s``, ``3m 20s``, ``2h 5m``, ``3d 4h``."""
    whole = round(abs(seconds))
    for size, unit, sub_size, sub_unit in (
        (86400, "d", 3600, "h"),
        (3600, "h", 60, "m"),
        (60, "m", 1, "s"),
    ):
        if whole >= size:
            rest = (whole % size) // sub_size
            return f"{whole // size}{unit}" + (f" {rest}{sub_unit}" if rest else "")
    return f"{whole}s"


def run_time(seconds: float) -> str:
    """A run time: ``350 ms``, ``2.4 s``, then ``3m 20s`` as ``duration`` says it."""
    if seconds < 1:
        return f"{round(seconds * 1000)} ms"
    if seconds < 60:
        return f"{seconds:.1f} s"
    return duration(seconds)


def age(when: datetime | None, now: datetime | None) -> str:
    """``5s ago`` or ``in 2m 10s``, relative to the database clock ``now``."""
    if when is None or now is None:
        return "-"
    delta = (when - now).total_seconds()
    return f"in {duration(delta)}" if delta > 0 else f"{duration(delta)} ago"


def timestamp(when: datetime | None) -> SafeString | str:
    """A time to the second in the current time zone; the exact value on hover.

    Django's default format stops at minutes, and work that ran at 19:03
    is not told apart from work that ran a minute of retries later.
    """
    if when is None:
        return "-"
    local = timezone.localtime(when)
    return format_html(
        '<span title="{}" style="white-space:nowrap">{}</span>',
        local.isoformat(),
        local.strftime("%Y-%m-%d %H:%M:%S"),
    )


def relative_time(when: datetime | None, now: datetime | None) -> SafeString | str:
    """``3m 20s ago`` (or ``in 5s``) by the database clock ``now``; the exact time on hover.

    For list columns: a whole date and time is cut at 1,280 px beside
    Django's navigation sidebar, and "how long ago" is what a list is read
    for; the hover tells which second. Without ``now``, the exact time.
    """
    if when is None:
        return "-"
    if now is None:
        return timestamp(when)
    return format_html(
        '<span class="dbw-when" title="{}">{}</span>',
        timezone.localtime(when).strftime("%Y-%m-%d %H:%M:%S %Z").strip(),
        age(when, now),
    )


def short_timestamp(when: datetime | None) -> SafeString | str:
    """``timestamp`` for a narrow column: the time alone today, the date alone before.

    The whole value is on hover, as ``timestamp``'s.
    """
    if when is None:
        return "-"
    local = timezone.localtime(when)
    shown = local.strftime("%H:%M:%S" if local.date() == timezone.localdate() else "%Y-%m-%d")
    return format_html(
        '<span title="{}" style="white-space:nowrap">{}</span>',
        local.strftime("%Y-%m-%d %H:%M:%S %Z").strip(),
        shown,
    )


def worker(claimed_by: str) -> SafeString | str:
    """``host:pid`` of a claim, with the thread only where it says something.

    ``claimed_by`` is ``host:pid:thread`` of the claiming thread; in
    ``run_workers`` that is always the main thread, which tells nothing.
    """
    if not claimed_by:
        return "-"
    host_pid, sep, thread = claimed_by.rpartition(":")
    if not sep or ":" not in host_pid:
        shown = claimed_by
    elif thread == "MainThread":
        shown = host_pid
    else:
        shown = f"{host_pid} ({thread})"
    return format_html('<span title="{}">{}</span>', claimed_by, shown)


def redaction(item: WorkItem, value: str = "payload") -> str | None:
    """Why ``item``'s ``value`` (``payload`` or ``result``) must not be shown, or None.

    ``sensitive`` covers both: what a handler returns often echoes what it
    was given (a token, an address). Fails closed: a handler that is not
    registered in this process (its ``workers`` module is only deployed with
    the workers, or it was renamed) might be sensitive, so its values are
    hidden too.
    """
    cls = registry.get(item.handler)
    if cls is None:
        return (
            f"(redacted: handler {item.handler} is not registered in this process, "
            f"so it cannot be told whether its {value} is sensitive)"
        )
    if getattr(cls, "sensitive", False):
        return "(redacted: this handler is marked sensitive)"
    return None


def handlers_with_shown_payloads() -> list[str]:
    """The handler names whose payloads ``redaction`` lets the admin show.

    Registered in this process and not ``sensitive``: the payload search
    looks only at their rows, so no search answers yes or no about a value
    that a change page would redact.
    """
    return sorted(name for name, cls in registry.items() if not getattr(cls, "sensitive", False))


def payload_redaction(item: WorkItem) -> str | None:
    """Why ``item``'s payload must not be shown, or None when it may be (see ``redaction``)."""
    return redaction(item, "payload")


def pretty_json(value: Any, raw_url: str | None = None) -> SafeString:
    """``value`` pretty-printed in a ``<pre>``, bounded (see ``bounded_json``).

    When it had to be cut, a note says so and, given ``raw_url``, links to
    the whole value as a download.
    """
    text, truncated = bounded_json(value)
    pre = format_html('<pre style="white-space:pre-wrap">{}</pre>', text)
    if not truncated:
        return pre
    note = f"(truncated: the first {PRETTY_MAX_CHARS:,} characters are shown"
    if raw_url is None:
        return format_html("{}<p>{})</p>", pre, note)
    return format_html('{}<p>{}; <a href="{}">download the raw JSON</a>)</p>', pre, note, raw_url)


def first_line(text: str | None, limit: int = 160) -> str:
    line = (text or "").split("\n", 1)[0]
    return line if len(line) <= limit else line[: limit - 1] + "…"


def one_line(text: str, width: str = "26em") -> SafeString:
    """Text kept on one line (at most ``width`` wide) in a list column, whole in its tooltip."""
    return format_html(
        '<span class="dbw-cut" title="{}" style="display:inline-block;max-width:{};overflow:hidden;'
        'text-overflow:ellipsis;white-space:nowrap;vertical-align:bottom">{}</span>',
        text,
        width,
        text,
    )


def is_stale(heartbeat_at: datetime | None, now: datetime | None, stale_after: float) -> bool:
    """Whether a claim's heartbeat is older than ``stale_after`` seconds by the database clock."""
    if heartbeat_at is None or now is None:
        return False
    return (now - heartbeat_at).total_seconds() > stale_after


def trace_id(trace_context: Any) -> str | None:
    """The trace id of a W3C ``traceparent`` (``00-<trace id>-<span id>-<flags>``)."""
    if not isinstance(trace_context, dict):
        return None
    parts = str(trace_context.get("traceparent", "")).split("-")
    return parts[1] if len(parts) == 4 and len(parts[1]) == 32 else None


#: Failed attempts listed on a change page, and characters of each error
#: shown: what the workers write (``ERROR_HISTORY_LIMIT`` entries of at most
#: 10 kB), so only a value edited by hand is ever cut.
HISTORY_ROWS_SHOWN = ERROR_HISTORY_LIMIT
HISTORY_ERROR_CHARS = 10_000


def error_text(error: str) -> SafeString:
    """An error in a ``<pre>``, cut at ``HISTORY_ERROR_CHARS`` (workers write at most 10 kB)."""
    if len(error) > HISTORY_ERROR_CHARS:
        error = error[:HISTORY_ERROR_CHARS] + f"\n(truncated at {HISTORY_ERROR_CHARS:,} characters)"
    return format_html('<pre style="white-space:pre-wrap">{}</pre>', error)


def error_history(history: Any) -> SafeString | str:
    """The attempts that ended without success, newest first: one line each, the rest folded.

    Tolerates hand-edited values: anything that is not a list of objects
    shows as nothing rather than breaking the page. Bounded like
    ``pretty_json``: the newest ``HISTORY_ROWS_SHOWN`` entries, each error
    cut at ``HISTORY_ERROR_CHARS``.
    """
    if not isinstance(history, list):
        return "-"
    rows = []
    entries = [entry for entry in reversed(history) if isinstance(entry, dict)]
    for entry in entries[:HISTORY_ROWS_SHOWN]:
        error = str(entry.get("error") or "")
        rows.append(
            format_html(
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td>"
                "<td><details><summary>{}</summary>{}</details></td></tr>",
                str(entry.get("attempt", "?"))[:20],
                worker(str(entry.get("worker") or "")[:300]),
                str(entry.get("finished_at") or "-")[:19].replace("T", " "),
                str(entry.get("exception_class_path") or "-")[:300],
                first_line(error) or "-",
                error_text(error),
            )
        )
    if not rows:
        return "-"
    head = format_html(
        "<tr><th>{}</th><th>{}</th><th>{}</th><th>{}</th><th>{}</th></tr>",
        "attempt",
        "worker",
        "ended (UTC)",
        "exception",
        "error",
    )
    table = format_html("<table>{}{}</table>", head, SafeString("".join(str(row) for row in rows)))
    left_out = len(entries) - len(rows)
    if left_out > 0:
        return format_html("{}<p>({} older attempts not shown)</p>", table, left_out)
    return table
