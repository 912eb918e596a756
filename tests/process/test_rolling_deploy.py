"""Old and new workers side by side across the newest migration, as a rolling deploy runs
them: the database migrated first, workers of the code before that migration still
claiming beside the new ones. No item lost, none run twice, no error in either log.

The old code is main as it was before the commit (or merge) that last changed the
migrations, taken from this clone's history (``git archive``) and run with its own
tests' settings and handlers.
The database is as that code's ``migrate`` and then the new one's leave it: the new
migrations applied, and the old ones' names recorded too (what the old ``migrate``
recorded; the schema is the same when the change was the squash of 0.1, which
tests/integration/test_migrations.py proves).
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import tarfile
import tempfile
from collections import Counter
from pathlib import Path

import pytest
from django.db import connection
from django.db.migrations.recorder import MigrationRecorder
from django.db.models import Count

from django_dbworker.models import Status, WorkItem
from tests.conftest import ROOT, WorkerProcess, wait_until
from tests.testapp.models import Execution
from tests.testapp.workers import Record

# PostgreSQL, the production database: one server is enough to roll across a migration.
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres_only]

ITEMS = 4_000


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()


@pytest.fixture(scope="module")
def old_code() -> Path:
    """This clone's code before the newest migration (extracted once per run)."""
    folder = ROOT / "django_dbworker" / "migrations"
    try:
        # Along the first parents: main's own commits, so a migration merged from
        # a branch gives main as it was before the merge, not a commit of the branch.
        changed = _git("log", "--first-parent", "--format=%H", "-1", "--", str(folder))
        old = _git("rev-parse", f"{changed}^1")
    except (subprocess.CalledProcessError, FileNotFoundError) as exc:
        pytest.skip(f"no git history to take the previous code from ({exc})")
    if _git("status", "--porcelain", "--", str(folder)):
        pytest.skip("the migrations have uncommitted changes: no previous code to run")
    target = Path(tempfile.gettempdir()) / f"dbworker-rolling-{old[:12]}"
    if not (target / "manage.py").exists():
        archive = subprocess.run(
            ["git", "archive", "--format=tar", old], cwd=ROOT, capture_output=True, check=True
        ).stdout
        staging = Path(tempfile.mkdtemp(prefix="dbworker-rolling-"))
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(staging, filter="data")
        staging.rename(target)
    return target


def test_old_and_new_workers_side_by_side_run_every_item_once(
    worker_env: dict[str, str], start_worker, old_code: Path, tmp_path: Path
) -> None:
    recorder = MigrationRecorder(connection)
    old_names = {path.stem for path in (old_code / "django_dbworker" / "migrations").glob("0*.py")}
    recorded = set(
        recorder.migration_qs.filter(app="django_dbworker").values_list("name", flat=True)
    )
    added = sorted(old_names - recorded)
    for name in added:
        recorder.record_applied("django_dbworker", name)
    try:
        _side_by_side(worker_env, start_worker, old_code, tmp_path)
    finally:
        for name in added:
            recorder.record_unapplied("django_dbworker", name)


def _side_by_side(worker_env: dict[str, str], start_worker, old_code: Path, tmp_path: Path) -> None:
    Record.enqueue_many([{"key": f"r{n}"} for n in range(ITEMS)])
    old_env = {**worker_env, "PYTHONPATH": str(old_code) + os.pathsep + str(ROOT)}
    old = [
        WorkerProcess(["record"], old_env, tmp_path / f"old-{n}.log", cwd=old_code)
        for n in range(2)
    ]
    new = [start_worker("record") for _ in range(2)]
    try:
        rows = WorkItem.objects.filter(handler="record")
        wait_until(
            lambda: rows.filter(status=Status.SUCCEEDED).count() == ITEMS,
            timeout=240,
            what=f"all {ITEMS} items to succeed",
        )
    finally:
        for worker in old + new:
            worker.signal(signal.SIGTERM)
        codes = [worker.wait(60) for worker in old + new]
    logs = {worker.log_path.name: worker.log() for worker in old + new}
    assert codes == [0] * 4, logs
    for name, text in logs.items():
        assert "ERROR" not in text and "Traceback" not in text, (name, text[-3000:])
    runs = Counter(Execution.objects.filter(kind="run").values_list("key", flat=True))
    assert len(runs) == ITEMS and set(runs.values()) == {1}, runs.most_common(3)
    assert set(rows.values_list("attempts", flat=True)) == {1}
    # Both kinds claimed.
    by_pid = dict(Execution.objects.values_list("pid").annotate(n=Count("id")))
    assert {w.pid for w in old} & set(by_pid), "no old worker ran an item"
    assert {w.pid for w in new} & set(by_pid), "no new worker ran an item"
