"""``python -m tests.process.run_workers_with_task_signals ARGS``: ``run_workers ARGS``
that records each Django ``task_started`` / ``task_finished`` it sends as an Execution
row (key ``task:<id>``, kinds "started" and "finished"), so that a process test sees
which task signals the worker sent.
"""

from __future__ import annotations

import sys
from typing import Any


def main() -> None:
    import django

    django.setup()
    from django.core.management import execute_from_command_line

    from django_dbworker.tasks.compat import task_finished, task_started
    from tests.testapp.tasks import _record

    def on_started(sender: Any, task_result: Any, **kwargs: Any) -> None:
        _record(f"task:{task_result.id}", "started")

    def on_finished(sender: Any, task_result: Any, **kwargs: Any) -> None:
        _record(f"task:{task_result.id}", "finished")

    task_started.connect(on_started, weak=False)
    task_finished.connect(on_finished, weak=False)
    execute_from_command_line(["manage.py", "run_workers", *sys.argv[1:]])


if __name__ == "__main__":
    main()
