"""The queue database guide (docs/topics/queue-database.md), run in a project of its own.

The page is the project ``queuedb`` (tests/docs/pages.py): the reader's
settings from the guides plus the page's second database and
``QueueRouter``, its handler, its shell blocks and its pytest module. What
the page says is checked from the databases themselves: ``migrate`` puts
the work tables on ``queue`` only, the enqueues and the worker's outcomes
are there, and ``default`` has not a single django-dbworker table.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.db import connection

from tests.docs.pages import DOCS, GUIDE, Block, markdown_blocks, project_blocks
from tests.docs.scratch import Project, _pg_admin, scratch_project

PAGE = DOCS / "topics" / "queue-database.md"

PYTEST_INI = """\
[pytest]
DJANGO_SETTINGS_MODULE = mysite.settings
"""

TABLES = (
    "import json\n"
    "from django.db import connections\n"
    "print(json.dumps({alias: sorted(connections[alias].introspection.table_names())\n"
    "    for alias in ('default', 'queue')}))"
)


def page_blocks() -> list[Block]:
    return markdown_blocks(PAGE)


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Project]:
    settings = [b for b in project_blocks(GUIDE) if b.kind == "settings"]
    with scratch_project(
        tmp_path_factory.mktemp("queuedb"),
        settings + page_blocks(),
        files={"pytest.ini": PYTEST_INI},
        settings_tail='\n# The scaffolding\nINSTALLED_APPS += ["myapp"]\n',
    ) as project:
        # The page's "createdb mysite_queue", next to the project's own database.
        queue_db = f"{project.env['PGDATABASE']}_queue" if "PGDATABASE" in project.env else None
        if queue_db is not None:
            _pg_admin(connection.settings_dict, "CREATE DATABASE {}", queue_db)
        try:
            yield project
        finally:
            if queue_db is not None:
                _pg_admin(
                    connection.settings_dict, "DROP DATABASE IF EXISTS {} WITH (FORCE)", queue_db
                )


def test_the_page_is_its_own_project_and_is_run_whole() -> None:
    blocks = page_blocks()
    assert {b.project for b in blocks} == {"queuedb"}
    kinds = [b.kind for b in blocks]
    assert kinds.count("shell") == 2 and kinds.count("test") == 1, kinds
    assert "illustrative" not in kinds, kinds


# The page's settings block for the leg's server is what makes the queue database:
# on every database's leg (tests/conftest.py, NEUTRAL_FOLDERS).
@pytest.mark.every_database
def test_the_recipe_puts_the_work_on_the_queue_database(project: Project) -> None:
    project.manage("migrate", "--database", "queue", "-v", "0")
    tables = project.query(TABLES)
    assert "django_dbworker_workitem" in tables["queue"], tables
    assert not [t for t in tables["default"] if t.startswith("django_dbworker_")], tables
    # Only the work tables (and Django's record of migrations) on the queue database.
    assert {t for t in tables["queue"] if not t.startswith("django_dbworker_")} == {
        "django_migrations"
    }, tables
    out = project.manage("check").stdout + project.manage("check").stderr
    assert "django_dbworker.W006" not in out, out  # silenced, as the page says

    for block in page_blocks():
        if block.kind == "shell":
            project.shell(block.code)
    worker = project.manage("run_workers", "--burst")
    assert "alias=queue" in worker.stdout + worker.stderr, worker.stderr
    rows = project.query(
        "import json\n"
        "from django_dbworker.models import WorkItem\n"
        "print(json.dumps(list(WorkItem.objects.using('queue').order_by('pk')\n"
        "    .values_list('payload', 'status', 'result'))))"
    )
    assert rows == [
        [{"user_id": 1}, "succeeded", {"sent_to": 1}],  # the on_commit example's user
        [{"user_id": 1}, "succeeded", {"sent_to": 1}],
        [{"user_id": 2}, "succeeded", {"sent_to": 2}],
    ], rows


def test_without_the_silencing_the_check_says_w006(project: Project) -> None:
    module = project.dir / "mysite" / "settings_unsilenced.py"
    module.write_text(
        "from mysite.settings import *  # noqa: F403\n\n"
        "SILENCED_SYSTEM_CHECKS = [c for c in SILENCED_SYSTEM_CHECKS "
        "if c != 'django_dbworker.W006']\n"
    )
    proc = project.manage("check", "--settings", "mysite.settings_unsilenced")
    out = proc.stdout + proc.stderr
    assert "django_dbworker.W006" in out and "not 'default'" in out, out


def test_the_pytest_example_passes_under_pytest(project: Project) -> None:
    (test_file,) = {b.path for b in page_blocks() if b.kind == "test"}
    assert test_file is not None
    proc = project.run("-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 passed" in proc.stdout, proc.stdout
