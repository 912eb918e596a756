"""The batches guide's examples (docs/topics/batches.md), run in a project of their own.

The page is the project ``batches`` (tests/docs/pages.py): its handlers,
its shell blocks and its pytest module, on top of the reader's settings
from the guides (Installation, the settings reference, and on the server
legs the Databases page's block). A project of its own, because its
blocks enqueue work that the guide project's tests would count. What the
page says happens is checked here from the rows: one callback with the
counts, a chain and a fan-in in order, a failed parent's child cancelled
without running.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.docs.pages import DOCS, GUIDE, Block, markdown_blocks, project_blocks
from tests.docs.scratch import Project, scratch_project

PAGE = DOCS / "topics" / "batches.md"

PYTEST_INI = """\
[pytest]
DJANGO_SETTINGS_MODULE = mysite.settings
"""


def page_blocks() -> list[Block]:
    return markdown_blocks(PAGE)


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Project]:
    settings = [b for b in project_blocks(GUIDE) if b.kind == "settings"]
    with scratch_project(
        tmp_path_factory.mktemp("batches"),
        settings + page_blocks(),
        files={"pytest.ini": PYTEST_INI},
        settings_tail='\n# The scaffolding\nINSTALLED_APPS += ["myapp"]\n',
    ) as project:
        yield project


def test_the_page_is_its_own_project_and_is_run_whole() -> None:
    blocks = page_blocks()
    assert {b.project for b in blocks} == {"batches"}
    kinds = [b.kind for b in blocks]
    assert kinds.count("shell") == 3 and kinds.count("test") == 1, kinds
    assert "illustrative" not in kinds and "settings" not in kinds, kinds


def test_batch_and_after_examples_run_in_run_workers(project: Project) -> None:
    out = project.manage("check", "--fail-level", "WARNING").stdout
    assert "System check identified no issues" in out, out
    for block in page_blocks():
        if block.kind == "shell":
            project.shell(block.code)
    worker = project.manage("run_workers", "--burst")
    rows = project.query(
        "import json\n"
        "from django_dbworker.batches.models import Batch\n"
        "from django_dbworker.models import WorkItem\n"
        "items = WorkItem.objects.order_by('pk')\n"
        "print(json.dumps({'items': [{'id': i.pk, 'handler': i.handler, 'status': i.status,\n"
        "    'payload': i.payload, 'result': i.result, 'last_error': i.last_error,\n"
        "    'batch': i.batch_id, 'claimed_at': i.claimed_at and i.claimed_at.isoformat(),\n"
        "    'finished_at': i.finished_at and i.finished_at.isoformat()} for i in items],\n"
        "    'batches': list(Batch.objects.values('id', 'total', 'succeeded', 'failed',\n"
        "        'cancelled', 'callback_id'))}))"
    )
    items = rows["items"]
    log = worker.stdout + worker.stderr
    by_handler: dict[str, list[dict[str, object]]] = {}
    for item in items:
        by_handler.setdefault(str(item["handler"]), []).append(item)

    # The batch: three rows, one callback with the counts, run by the worker.
    ((done,),) = [by_handler["import_finished"]]
    (b,) = rows["batches"]
    assert (b["total"], b["succeeded"], b["failed"], b["cancelled"]) == (3, 2, 1, 0), rows
    assert b["callback_id"] == done["id"]
    assert done["payload"] == {
        "import_id": 7,
        "batch": b["id"],
        "succeeded": 2,
        "failed": 1,
        "cancelled": 0,
    }
    assert done["status"] == "succeeded", log
    assert done["result"] == {"report": "import 7: 2 imported, 1 failed, 0 cancelled"}
    in_batch = [i for i in items if i["batch"] == b["id"]]
    assert len(in_batch) == 3
    assert all(str(done["claimed_at"]) >= str(i["finished_at"]) for i in in_batch)

    # The chain and the fan-in, in order (the database's clock).
    a, other = by_handler["extract"]
    (t,) = by_handler["transform"]
    load_ok, report = by_handler["load"]
    assert {a["status"], other["status"], t["status"], load_ok["status"]} == {"succeeded"}, log
    assert str(t["claimed_at"]) >= str(a["finished_at"])
    assert str(load_ok["claimed_at"]) >= max(str(t["finished_at"]), str(other["finished_at"]))
    assert load_ok["result"] == {"loaded": ["orders", "refunds"]}

    # A failed parent: its child cancelled, never run, naming the parent.
    bad = by_handler["import_row"][-1]
    assert bad["status"] == "failed" and bad["batch"] is None
    assert report["status"] == "cancelled" and report["claimed_at"] is None
    assert report["last_error"] == (
        f"Cancelled without running: it runs after work item #{bad['id']}, which ended failed."
    )
    # The page shows that line with another id.
    assert "Cancelled without running: it runs after work item #41, which ended failed." in (
        PAGE.read_text()
    )


def test_the_pytest_example_passes_under_pytest(project: Project) -> None:
    (test_file,) = {b.path for b in page_blocks() if b.kind == "test"}
    assert test_file is not None
    proc = project.run("-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 passed" in proc.stdout, proc.stdout
