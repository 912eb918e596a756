"""Error text: log summaries are one inert line, stored text keeps only its newlines and tabs."""

from __future__ import annotations

import pytest

from django_dbworker.errortext import (
    MAX_ERROR_BYTES,
    REDACTED,
    clean_error_text,
    error_summary,
    format_error,
)

#: Characters an exception message could use to forge or hide log lines, or
#: to drive the terminal that shows them (ANSI escapes start with ESC or CSI).
CONTROLS = [
    "\r",
    "\x1b[31m",
    "\x1b]8;;http://evil\x07",
    "\x0b",
    "\x0c",
    "\x1c",
    "\x7f",
    "\x85",  # NEL
    "\x9b",  # CSI
    "\u2028",  # LINE SEPARATOR
    "\u2029",  # PARAGRAPH SEPARATOR
    "\x00",
    "\x08",
]

#: What a reader or a terminal takes as the end of a line.
LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"


def _raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:
        return caught


def _has_control(text: str, allowed: str = "") -> bool:
    return any(
        (ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F or c in "\u2028\u2029") and c not in allowed
        for c in text
    )


@pytest.mark.parametrize("control", CONTROLS, ids=[repr(c) for c in CONTROLS])
def test_a_failure_summary_is_one_line_without_control_characters(control: str) -> None:
    exc = _raised(ValueError(f"first{control}INFO forged line\tafter a tab\nsecond line"))
    summary = error_summary(exc)
    assert len(summary.splitlines()) == 1, summary
    assert not any(c in summary for c in LINE_BREAKS)
    assert not _has_control(summary), repr(summary)
    # Still readable: the characters are shown as escapes, the words stay.
    assert summary.startswith("ValueError: first")
    assert "INFO forged line" in summary and "second line" in summary


def test_a_summary_escapes_what_it_replaces() -> None:
    summary = error_summary(_raised(ValueError("a\rb\x1b[2Jc\u2028d\x85e")))
    assert summary == "ValueError: a\\rb\\x1b[2Jc\\u2028d\\x85e"


def test_a_multi_line_message_stays_one_line_of_words() -> None:
    assert error_summary(_raised(ValueError("one\ntwo\tthree"))) == "ValueError: one two three"


def test_a_sensitive_summary_is_one_line_even_for_a_hostile_class_name() -> None:
    hostile = type("Bad\r\x1b[31mClass\u2028", (Exception,), {})
    summary = error_summary(_raised(hostile("secret")), sensitive=True)
    assert len(summary.splitlines()) == 1 and not _has_control(summary), repr(summary)
    assert summary.endswith(f": {REDACTED}") and "secret" not in summary
    assert len(error_summary(_raised(hostile("x"))).splitlines()) == 1


@pytest.mark.parametrize("sensitive", [False, True])
def test_stored_error_text_keeps_newlines_and_tabs_only(sensitive: bool) -> None:
    message = "bad\r\n\x1b[31mred\x1b[0m\tcol\u2028sep\x85nel\x00nul"
    text = format_error(_raised(ValueError(message)), sensitive=sensitive)
    assert "\nTraceback (most recent call last):\n" in text  # the traceback's lines stay
    assert not _has_control(text, allowed="\n\t"), repr(text)
    assert text.splitlines() == text.split("\n")  # no line break but \n
    if not sensitive:
        assert "bad\\r\n\\x1b[31mred\\x1b[0m\tcol\\u2028sep\\x85nel\\x00nul" in text


def test_clean_error_text_escapes_controls_and_stays_within_its_cap() -> None:
    assert clean_error_text("a\x1bb\nc\td\x00") == "a\\x1bb\nc\td\\x00"
    assert len(clean_error_text("\x1b" * 20_000).encode("utf-8")) <= MAX_ERROR_BYTES
