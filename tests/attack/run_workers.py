"""``python -m tests.attack.run_workers ARGS``: ``manage.py run_workers ARGS`` with the
attack tests' handlers and task imported, and receivers of Django's task signals that
record each ``task_started`` / ``task_finished`` as Execution rows (kinds "started",
"finished"), so a process test can see what the worker sent.
"""

from __future__ import annotations

import sys
from typing import Any


def main() -> None:
    import django

    django.setup()
    import tests.attack.tasks
    import tests.attack.workers  # registers the handlers

    try:
        from django.tasks.signals import task_finished, task_started
    except ImportError:  # Django 5.2: the backport
        from django_tasks.signals import task_finished, task_started  # type: ignore[no-redef]

    from tests.attack.workers import record

    def on_started(sender: Any, task_result: Any, **kwargs: Any) -> None:
        record(f"task:{task_result.id}", "started")

    def on_finished(sender: Any, task_result: Any, **kwargs: Any) -> None:
        record(f"task:{task_result.id}", "finished")

    task_started.connect(on_started, weak=False)
    task_finished.connect(on_finished, weak=False)
    assert tests.attack.workers and tests.attack.tasks  # imported for their handlers

    from django.core.management import execute_from_command_line

    execute_from_command_line(["manage.py", "run_workers", *sys.argv[1:]])


if __name__ == "__main__":
    main()
