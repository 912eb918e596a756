"""A gentle, steady stream of demo work until stopped, so the admin always shows movement."""

from __future__ import annotations

import random
import signal
import threading
from datetime import timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandParser
from django.db import transaction

from example_project.demo.tasks import notify_followers
from example_project.demo.workers import GenerateReport, ResizeImage, SendWelcomeEmail


class Command(BaseCommand):
    help = (
        "Enqueue a few demo items every second until stopped (Ctrl-C or SIGTERM): emails "
        "and images (some fail and retry), now and then a report, a scheduled item or one "
        "that fails for good."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--interval", type=float, default=1.0, help="seconds between batches (default 1)"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        interval = options["interval"]
        if not interval > 0:
            self.stderr.write("--interval must be a positive number of seconds.")
            raise SystemExit(2)
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        count = 0
        while not stop.wait(interval):
            count += enqueue_a_few(count)
        self.stdout.write(f"Demo stream stopped after {count} items.")


def enqueue_a_few(sequence: int) -> int:
    """Two or three items like a busy site's: mostly emails and images."""
    with transaction.atomic():
        n = 0
        for _ in range(random.randint(1, 2)):
            SendWelcomeEmail.enqueue({"email": f"stream{sequence + n}@example.com"})
            n += 1
        if random.random() < 0.6:
            ResizeImage.enqueue({"image": f"upload-{sequence + n}.jpg"})
            n += 1
        if random.random() < 0.3:
            notify_followers.enqueue(f"stream{sequence + n}")
            n += 1
        roll = random.random()
        if roll < 0.05:
            GenerateReport.enqueue({"report": f"export-{sequence}", "broken": True})
            n += 1
        elif roll < 0.15:
            GenerateReport.enqueue({"report": f"hourly-{sequence}"}, priority=10)
            n += 1
        elif roll < 0.22:
            SendWelcomeEmail.enqueue(
                {"email": f"reminder{sequence}@example.com"},
                run_after=timedelta(seconds=random.randint(20, 60)),
            )
            n += 1
    return n
