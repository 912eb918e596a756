"""Django admin for work items: what is stuck, what failed, why, and fix it.

Pages: all work items (``workitems``), claimed ones (``claimed``), failed
ones (``failed``), a queue summary (``queue_summary``), the schedules of
periodic handlers (``schedules``), the queues with Pause/Resume
(``queues``), the batches (``batches``), the live workers (``workers``) and the
fair keys' weights (``fair_keys``); what
they share is in ``base`` and ``columns``, a row's batch and dependencies in
``relations``. This module only registers them.
Detail pages are read-only (a form save would race the workers); state
changes happen only through the actions, which need the change permission.
List pages defer payload, result and traceback columns, count with an
estimating paginator and filter on indexed columns, so they stay fast on
tables with millions of rows.
"""

from __future__ import annotations

from django.contrib import admin

from django_dbworker.admin.base import BaseWorkItemAdmin, _LightChangeList, _OneStatusAdmin
from django_dbworker.admin.batches import BatchAdmin
from django_dbworker.admin.claimed import ClaimedWorkItemAdmin
from django_dbworker.admin.failed import FailedWorkItemAdmin
from django_dbworker.admin.fair_keys import FairKeyAdmin
from django_dbworker.admin.queue_summary import QueueSummaryAdmin
from django_dbworker.admin.queues import QueueAdmin
from django_dbworker.admin.schedules import ScheduleAdmin
from django_dbworker.admin.workers import WorkersAdmin
from django_dbworker.admin.workitems import WorkItemAdmin
from django_dbworker.batches.models import Batch
from django_dbworker.fleet.models import LiveWorker
from django_dbworker.flow.models import FairKey, QueueState
from django_dbworker.models import (
    ClaimedWorkItem,
    FailedWorkItem,
    PeriodicSchedule,
    QueueSummary,
    WorkItem,
)

__all__ = [
    "BaseWorkItemAdmin",
    "BatchAdmin",
    "ClaimedWorkItemAdmin",
    "FailedWorkItemAdmin",
    "QueueAdmin",
    "QueueSummaryAdmin",
    "ScheduleAdmin",
    "WorkItemAdmin",
    "WorkersAdmin",
    "_LightChangeList",
    "_OneStatusAdmin",
]

admin.site.register(WorkItem, WorkItemAdmin)
admin.site.register(ClaimedWorkItem, ClaimedWorkItemAdmin)
admin.site.register(FailedWorkItem, FailedWorkItemAdmin)
admin.site.register(QueueSummary, QueueSummaryAdmin)
admin.site.register(PeriodicSchedule, ScheduleAdmin)
admin.site.register(QueueState, QueueAdmin)
admin.site.register(Batch, BatchAdmin)
admin.site.register(LiveWorker, WorkersAdmin)
admin.site.register(FairKey, FairKeyAdmin)
