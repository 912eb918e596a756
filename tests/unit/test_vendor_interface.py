"""The vendor interface: what a new database's operations class must say and implement."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from django_dbworker.db import operations
from django_dbworker.db.base import CAPABILITIES, VendorOperations


class _Complete(VendorOperations):
    """Every abstract method, and no capability stated."""

    def check_version(self) -> None:
        return None

    def claim(
        self, *, limit: int, handlers: Sequence[str], queues: Sequence[str] | None, worker: str
    ) -> list[Any]:
        return []

    def succeed_rows(self, outcomes: Sequence[Any]) -> list[Any]:
        return []

    def distinct_queues(self) -> list[str]:
        return []


def test_a_vendor_that_does_not_state_its_capabilities_is_refused() -> None:
    with pytest.raises(TypeError, match="vendor, supports_notify"):
        _Complete("default")


def test_a_vendor_without_a_claim_cannot_be_made() -> None:
    class NoClaim(VendorOperations):
        vendor = "x"
        supports_notify = supports_skip_locked = poll_adaptively = False

    with pytest.raises(TypeError, match="abstract"):
        NoClaim("default")  # type: ignore[abstract]


def test_the_configured_vendor_states_every_capability() -> None:
    ops = operations()
    assert all(hasattr(ops, name) for name in CAPABILITIES)
    assert ops.vendor
