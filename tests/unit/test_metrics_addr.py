"""The worker's ``/metrics`` server warns when it answers beyond this host."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from django_dbworker import metrics


@pytest.mark.parametrize(
    ("addr", "beyond"),
    [
        ("127.0.0.1", False),
        ("127.0.0.53", False),
        ("::1", False),
        ("[::1]", False),
        ("localhost", False),
        ("::ffff:127.0.0.1", False),
        ("0.0.0.0", True),
        ("::", True),
        ("", True),
        ("10.1.2.3", True),
        ("192.0.2.7", True),
        ("2001:db8::1", True),
    ],
)
def test_which_addresses_answer_beyond_loopback(addr: str, beyond: bool) -> None:
    assert metrics.binds_beyond_loopback(addr) is beyond


def _serve(addr: str) -> Any:
    server = metrics.serve(0, addr)  # port 0: any free port
    assert server is not None
    return server


def _stop(server: Any) -> None:
    httpd, thread = server
    httpd.shutdown()
    httpd.server_close()
    thread.join(10)


def test_serving_on_every_interface_warns(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="django_dbworker")
    server = _serve("0.0.0.0")
    try:
        (record,) = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert record.name == "django_dbworker.metrics"
        assert "0.0.0.0" in record.getMessage() and "loopback" in record.getMessage()
    finally:
        _stop(server)


def test_serving_on_loopback_does_not_warn(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="django_dbworker")
    server = _serve("127.0.0.1")
    try:
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    finally:
        _stop(server)
