"""The topic guides' examples (once the README's Guide), run in a scratch project.

The blocks of every docs page of the project ``guide`` (tests/docs/pages.py:
the topic guides, installation and reference pages) go into one project,
as one reader's project grows page by page (tests/docs/scratch.py builds
it). What the reader's project has that the guides do not show is the
scaffolding below: ``myapp`` in INSTALLED_APPS, the ``Invoice`` model the
own-table example claims from, a ``/signup/`` view that enqueues like
*Enqueue and transactions*, pytest-django's ``pytest.ini``, the console
e-mail backend, and, on the server legs, a database of its own.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest
from django.db import connection

from tests.docs.pages import GUIDE, Block, project_blocks
from tests.docs.scratch import Project, scratch_project

MODELS = """\
from django.db import models


class Invoice(models.Model):
    status = models.CharField(max_length=20, default="pending")
"""

VIEWS = """\
from django.contrib.auth.models import User
from django.db import transaction
from django.http import HttpResponse

from myapp.workers import SendWelcomeEmail


def signup(request):
    with transaction.atomic():
        user = User.objects.create(
            username=request.POST["username"], email=request.POST["email"]
        )
        SendWelcomeEmail.enqueue({"user_id": user.pk})
    return HttpResponse(status=201)
"""

URLS = """\
from django.contrib import admin
from django.urls import path

from myapp.views import signup

urlpatterns = [path("admin/", admin.site.urls), path("signup/", signup)]
"""

PYTEST_INI = """\
[pytest]
DJANGO_SETTINGS_MODULE = mysite.settings
"""


def guide_blocks() -> list[Block]:
    return project_blocks(GUIDE)


def blocks_of(kind: str) -> list[Block]:
    return [b for b in guide_blocks() if b.kind == kind]


def test_guide_blocks_follow_the_convention() -> None:
    blocks = guide_blocks()
    kinds = Counter(b.kind for b in blocks)
    # A parser that found nothing would let every other test here pass vacuously.
    assert kinds["settings"] >= 3, kinds
    assert kinds["file"] >= 3, kinds
    assert kinds["shell"] >= 1, kinds
    assert kinds["test"] >= 1, kinds
    assert kinds["illustrative"] <= 2, [b.where for b in blocks_of("illustrative")]
    for block in blocks:
        compile(block.code, block.where, "exec")
        if block.kind == "settings":
            block.settings_code()


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Project]:
    with scratch_project(
        tmp_path_factory.mktemp("guide"),
        guide_blocks(),
        files={
            "myapp/models.py": MODELS,
            "myapp/views.py": VIEWS,
            "mysite/urls.py": URLS,
            "pytest.ini": PYTEST_INI,
        },
        settings_tail='\n# The scaffolding\nINSTALLED_APPS += ["myapp"]\n'
        # Django 6.1's new project prints e-mails already (MAILERS) and refuses
        # EMAIL_BACKEND beside it.
        'if "MAILERS" not in globals():\n'
        '    EMAIL_BACKEND = "django.core.mail.backends.console.EmailBackend"\n',
    ) as project:
        yield project


# The databases page's and the tutorial's settings blocks for the leg's server are
# what connects: on every database's leg (tests/conftest.py, NEUTRAL_FOLDERS).
@pytest.mark.every_database
def test_settings_blocks_pass_the_system_checks(project: Project) -> None:
    # --fail-level WARNING: on SQLite, the Install section's options are what
    # silence django_dbworker.W001-W003; the DBWORKER reference must be valid.
    out = project.manage("check", "--fail-level", "WARNING").stdout
    assert "System check identified no issues" in out, out
    installed = project.query(
        "import json; from django.conf import settings; from django.db import connection; "
        "print(json.dumps([settings.INSTALLED_APPS, settings.USE_TZ, sorted(settings.DBWORKER), "
        "connection.vendor]))"
    )
    apps, use_tz, dbworker_keys, vendor = installed
    assert vendor == connection.vendor  # the examples run on this leg's database
    assert apps[:6] == [
        "django.contrib.admin",
        "django.contrib.auth",
        "django.contrib.contenttypes",
        "django.contrib.sessions",
        "django.contrib.messages",
        "django.contrib.staticfiles",
    ], apps
    assert "django_dbworker" in apps
    assert use_tz is True
    assert "CONCURRENCY" in dbworker_keys


def test_handlers_and_enqueue_examples_run_in_run_workers(project: Project) -> None:
    for block in blocks_of("shell"):
        project.shell(block.code)
    project.shell(
        "from myapp.models import Invoice\nInvoice.objects.bulk_create([Invoice(), Invoice()])\n"
    )
    before = project.query(
        "import json\n"
        "from django_dbworker.models import WorkItem\n"
        "print(json.dumps(list(WorkItem.objects.values_list('handler', 'queue', 'status'))))"
    )
    # Enqueue's block: one in the transaction, one delayed, two in bulk, one by
    # name; the Tasks block's task ran already (its asserts ran in the shell).
    assert Counter(map(tuple, before)) == {
        ("send_welcome_email", "emails", "pending"): 5,
        ("myapp.tasks.resize_avatar", "default", "succeeded"): 1,
        ("count_words", "default", "succeeded"): 1,  # the async-code block ran it
        # Async handlers: three run by run_until_empty, the async view's one waits.
        ("fetch_feed", "default", "succeeded"): 3,
        ("fetch_feed", "default", "pending"): 1,
        ("count_invoices", "default", "succeeded"): 1,
        ("build_report", "default", "pending"): 101,  # flow control's fair-share block
    }

    worker = project.manage("run_workers", "--burst")
    assert worker.stdout.count("Subject: Welcome!") == 4, worker.stdout + worker.stderr

    after = project.query(
        "import json\n"
        "from django_dbworker.models import WorkItem\n"
        "from myapp.models import Invoice\n"
        "print(json.dumps({'items': [[i.status, i.result, i.priority] for i in "
        "WorkItem.objects.order_by('id')], "
        "'invoices': list(Invoice.objects.values_list('status', flat=True))}))"
    )
    sent = [[status, result] for status, result, _ in after["items"]]
    assert sent.count(["succeeded", {"sent_to": "ada@example.com"}]) == 4, after
    # The one with run_after=timedelta(minutes=5) and priority=10 waits.
    assert [i for i in after["items"] if i[0] == "pending"] == [["pending", None, 10]], after
    # The async view's fetch ran on run_workers' event loop; its invoice was mailed too.
    fetched = [i for i in after["items"] if isinstance(i[1], dict) and i[1].get("status") == 200]
    assert len(fetched) == 4 and {i[0] for i in fetched} == {"succeeded"}, after
    assert after["invoices"] == ["sent", "sent", "sent"], after


def test_router_example_routes_the_work_table(project: Project) -> None:
    routes = project.query(
        "import json\n"
        "from django.contrib.auth.models import User\n"
        "from django_dbworker.models import WorkItem\n"
        "from mysite.routers import WorkRouter\n"
        "r = WorkRouter()\n"
        "print(json.dumps([r.db_for_read(WorkItem), r.db_for_write(WorkItem), "
        "r.db_for_read(User), r.db_for_write(User)]))"
    )
    assert routes == ["work", "work", None, None]


def test_pytest_example_passes_under_pytest(project: Project) -> None:
    (test_file,) = {b.path for b in blocks_of("test")}
    assert test_file is not None
    proc = project.run("-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 passed" in proc.stdout, proc.stdout


def test_alternative_settings_pass_the_system_checks(project: Project) -> None:
    alternatives = [b for b in blocks_of("settings") if b.variant == "alternative"]
    assert alternatives  # RETENTION's, in Operations
    for i, block in enumerate(alternatives):
        module = f"settings_alternative_{i}"
        (project.dir / "mysite" / f"{module}.py").write_text(
            f"from mysite.settings import *  # noqa: F403\n\n# {block.where}\n"
            f"{block.settings_code()}"
        )
        out = project.manage(
            "check", "--fail-level", "WARNING", "--settings", f"mysite.{module}"
        ).stdout
        assert "System check identified no issues" in out, (block.where, out)


def test_periodic_and_retry_examples_run_their_handlers(project: Project) -> None:
    # After the tests above (they count rows): a manual run of each periodic
    # example (enqueue() without a slot runs with now as its slot), and the
    # retry example's handler, through the worker's own path.
    outcome = project.query(
        "import json\n"
        "from django_dbworker.testing import run_until_empty\n"
        "from django_dbworker.models import WorkItem\n"
        "from myapp.workers import CallPartnerApi, ClearExpiredSessions, NightlyDigest\n"
        "items = [NightlyDigest.enqueue(), ClearExpiredSessions.enqueue(),\n"
        "         CallPartnerApi.enqueue({'url': 'https://partner.example/'})]\n"
        "counts = run_until_empty(['nightly_digest', 'clear_expired_sessions', "
        "'call_partner_api'])\n"
        "rows = WorkItem.objects.filter(pk__in=[i.pk for i in items]).order_by('pk')\n"
        "print(json.dumps([counts, [[r.handler, r.status, r.result] for r in rows]]))"
    )
    counts, rows = outcome
    assert counts == {"succeeded": 3}, outcome
    assert rows[0][:2] == ["nightly_digest", "succeeded"]
    assert set(rows[0][2]) == {"digest_for"}, rows[0]
    assert rows[1][:2] == ["clear_expired_sessions", "succeeded"]
    assert rows[2] == ["call_partner_api", "succeeded", {"called": "https://partner.example/"}]


def test_cancel_and_snooze_examples_run_in_run_workers(project: Project) -> None:
    """*Cancelling running work* and *Snooze*: their handlers, run by ``run_workers``."""
    project.shell(
        "from django.contrib.auth.models import User\n"
        "from myapp.workers import ExportUsers, NudgeNewUser\n"
        "grace = User.objects.create(username='grace', email='grace@example.com')\n"
        "ExportUsers.enqueue({})\n"
        "NudgeNewUser.enqueue({'user_id': grace.pk})\n"
    )
    worker = project.manage("run_workers", "--burst", "export_users", "nudge_new_user")
    assert "1 snoozed" in worker.stdout + worker.stderr, worker.stdout + worker.stderr
    rows = project.query(
        "import json\n"
        "from django.contrib.auth.models import User\n"
        "from django_dbworker.models import WorkItem\n"
        "items = WorkItem.objects.filter(handler__in=['export_users', 'nudge_new_user'])\n"
        "print(json.dumps({'users': User.objects.count(), 'items': {i.handler: "
        "[i.status, i.result, i.attempts, i.snoozes] for i in items}}))"
    )
    assert rows["items"]["export_users"] == ["succeeded", {"rows": rows["users"]}, 1, 0]
    # Grace never logged in: looked at again tomorrow, no attempt used.
    assert rows["items"]["nudge_new_user"] == ["pending", None, 0, 1]
