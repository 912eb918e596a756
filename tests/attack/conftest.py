"""Fixtures of the attack tests: the integration tests' in-process workers."""

from tests.integration.conftest import background_worker, gate

__all__ = ["background_worker", "gate"]
