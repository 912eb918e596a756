"""A Django ``@task`` beside the handlers: the same worker runs both.

``django_dbworker.tasks.task`` is Django's ``@task`` plus the worker's
options; ``django.tasks.task`` (Django 6) works unchanged too.
"""

from __future__ import annotations

import random
import time

from django_dbworker.tasks import task


@task(queue_name="emails", max_attempts=3)
def notify_followers(user: str) -> dict[str, object]:
    """Tells a user's followers about something; the push service is flaky."""
    time.sleep(random.uniform(0.05, 0.3))
    if random.random() < 0.15:
        raise ConnectionError("push service timed out")
    return {"user": user, "notified": random.randint(1, 40)}
