"""The demo's batch of work, shared by the command and the home page."""

from __future__ import annotations

from datetime import timedelta

from django.db import transaction

from django_dbworker import batch
from example_project.demo.tasks import notify_followers
from example_project.demo.workers import (
    GenerateReport,
    ImagesResized,
    ResizeImage,
    SendWelcomeEmail,
)


def enqueue_demo_work() -> int:
    with transaction.atomic():  # all of it, or none of it
        emails = SendWelcomeEmail.enqueue_many(
            [{"email": f"user{n}@example.com"} for n in range(12)]
        )
        # One batch (the admin's Batches page): ImagesResized runs once all ten have ended.
        with batch(on_complete=ImagesResized, payload={"album": "holidays"}):
            images = ResizeImage.enqueue_many([{"image": f"photo-{n}.jpg"} for n in range(10)])
        later = [
            SendWelcomeEmail.enqueue(
                {"email": "later@example.com"}, run_after=timedelta(seconds=30)
            ),
            GenerateReport.enqueue({"report": "weekly"}, run_after=timedelta(seconds=60)),
        ]
        reports = [
            GenerateReport.enqueue({"report": "sales"}, priority=10),
            GenerateReport.enqueue({"report": "broken-export", "broken": True}),
        ]
        tasks = [notify_followers.enqueue(f"user{n}") for n in range(3)]  # Django's Tasks API
    return len(emails) + len(images) + len(later) + len(reports) + len(tasks)
