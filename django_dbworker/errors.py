"""Exceptions that are part of the public API."""

from __future__ import annotations


class EnqueueError(ValueError):
    """Raised by enqueue when its input is invalid; nothing has been written."""


class NoTask(Exception):
    """Raised by ``Handler.claim`` when there is nothing to work on."""
