"""Demo handlers: some succeed, some fail and retry, one always fails."""

from __future__ import annotations

import random
import time
from datetime import datetime, timedelta
from typing import Any

from django.core.management import call_command

from django_dbworker import PeriodicHandler, WorkItemHandler


class SendWelcomeEmail(WorkItemHandler):
    name = "send_welcome_email"
    queue = "emails"

    def handle(self, payload: Any) -> dict[str, Any]:
        time.sleep(random.uniform(0.2, 1.0))  # pretend to talk to an SMTP server
        return {"sent_to": payload["email"]}


class ResizeImage(WorkItemHandler):
    """Fails now and then; the retries show up in the admin."""

    name = "resize_image"
    queue = "images"
    max_attempts = 4

    def handle(self, payload: Any) -> dict[str, Any]:
        time.sleep(random.uniform(0.1, 0.5))
        if random.random() < 0.4:
            raise OSError(f"image server busy while resizing {payload['image']}")
        return {"thumbnail": payload["image"].replace(".jpg", "-thumb.jpg")}


class ImagesResized(WorkItemHandler):
    """The callback of the demo's batch of images: runs once, when every resize has ended."""

    name = "images_resized"
    queue = "images"

    def handle(self, payload: Any) -> str:
        # {"album": ..., "batch": 1, "succeeded": 9, "failed": 1, "cancelled": 0}
        return (
            f"album {payload['album']}: {payload['succeeded']} resized, "
            f"{payload['failed']} failed, {payload['cancelled']} cancelled"
        )


class GenerateReport(WorkItemHandler):
    """Fails for broken input until its attempts are used up: see Failed work items."""

    name = "generate_report"
    max_attempts = 2

    def handle(self, payload: Any) -> str:
        if payload.get("broken"):
            raise ValueError(f"report {payload['report']!r} references a missing column")
        time.sleep(0.5)
        return f"report {payload['report']} ready"


class ClearExpiredSessions(PeriodicHandler):
    """Django's ``clearsessions`` once a minute (hourly would do in production)."""

    name = "clear_expired_sessions"
    every = 60

    def run(self) -> None:
        call_command("clearsessions")


class NightlyDigest(PeriodicHandler):
    """03:00 Paris time: the digest of the day before the slot (not of "today")."""

    name = "nightly_digest"
    cron = "0 3 * * *"
    timezone = "Europe/Paris"
    queue = "reports"

    def run(self, slot: datetime) -> dict[str, str]:
        day = (slot - timedelta(days=1)).date()
        return {"digest_for": day.isoformat()}
