"""The register of live worker processes: one ``LiveWorker`` row per ``run_workers`` process.

Kept beside ``models.py`` (which imports it, so Django registers it with the
app). For operators only: the admin's Workers page and ``dbworker_stats``
read it; no claim, heartbeat of items or recovery does, so a row that is
late, missing or stale changes nothing a worker does.
"""

from __future__ import annotations

from django.db import models
from django.db.models.functions import Now


class LiveWorker(models.Model):
    """One worker process: what it runs, and when its heartbeat thread last wrote.

    ``name`` is ``host:pid``, the prefix of its items' ``WorkItem.claimed_by``
    (``host:pid:thread``), so its claimed rows are found from it. Written by
    the process's heartbeat thread (``presence.Presence``): inserted (or
    overwritten, when a restarted process has the same host and pid) at
    start, ``heartbeat_at`` refreshed on every heartbeat (database clock),
    deleted at a clean stop; a process that died leaves its row behind
    until another worker's stale-recovery pass deletes rows older than
    ``STALE_AFTER``. Readers count a row only while its heartbeat is younger
    than that, so a dead process never shows, even before its row goes.
    """

    name = models.CharField(max_length=255, primary_key=True)
    #: The queues it claims from; NULL: every queue.
    queues = models.JSONField(null=True, blank=True)
    #: The names of the handlers it runs.
    handlers = models.JSONField(default=list, blank=True)
    concurrency = models.PositiveIntegerField(default=0)
    #: The django-dbworker version it runs.
    version = models.CharField(max_length=50, blank=True, default="")
    started_at = models.DateTimeField(db_default=Now())
    heartbeat_at = models.DateTimeField(db_default=Now())

    objects: models.Manager[LiveWorker] = models.Manager()

    class Meta:
        app_label = "django_dbworker"
        verbose_name = "worker"
        verbose_name_plural = "workers"

    def __str__(self) -> str:
        return self.name

    @property
    def host(self) -> str:
        return self.name.rpartition(":")[0]

    @property
    def pid(self) -> int | None:
        pid = self.name.rpartition(":")[2]
        return int(pid) if pid.isdigit() else None
