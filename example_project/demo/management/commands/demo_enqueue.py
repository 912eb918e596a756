from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand

from example_project.demo.enqueue_demo import enqueue_demo_work


class Command(BaseCommand):
    help = "Enqueue the demo's batch of work items."

    def handle(self, *args: Any, **options: Any) -> None:
        count = enqueue_demo_work()
        self.stdout.write(f"Enqueued {count} demo work items (2 scheduled 30-60 s from now).")
