"""The worker runtime: claim loop, thread pool, execution, heartbeats, recovery.

``Worker`` (runtime.py) is driven by ``manage.py run_workers`` and by tests
in-process; the other modules each hold one concern of it.
"""

from __future__ import annotations

from django_dbworker.worker.runtime import Worker

__all__ = ["Worker"]
