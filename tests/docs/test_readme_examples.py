"""The README's Guide examples, run in a scratch project as a reader would run them.

The project is made with ``django-admin startproject mysite`` and
``manage.py startapp myapp``; the Guide's blocks go where their first line
says (tests/docs/readme.py has the convention): settings blocks into
``mysite/settings.py``, file blocks into their files (``myapp/workers.py``,
``mysite/routers.py``, ``tests/test_signup.py``), the rest into
``manage.py shell --no-imports``. Every command is a subprocess, so a
missing import or an unset setting fails here as it would for the reader.

What the reader's project has that the Guide does not show is the
scaffolding below: ``myapp`` in INSTALLED_APPS, the ``Invoice`` model the
own-table example claims from, a ``/signup/`` view that enqueues like
*Enqueue*, pytest-django's ``pytest.ini``, the console e-mail backend, and,
on the PostgreSQL leg, a database of its own on the suite's server.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from django.db import connection

from tests.docs.readme import Block, guide_blocks

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 180.0

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


@dataclass
class Project:
    """A scratch Django project; every command runs in a subprocess."""

    dir: Path
    env: dict[str, str]

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        try:
            proc = subprocess.run(
                [sys.executable, *args],
                cwd=self.dir,
                env=self.env,
                capture_output=True,
                text=True,
                timeout=TIMEOUT,
            )
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"{args} did not finish within {TIMEOUT}s:\n{exc.stdout}\n{exc.stderr}")
        if check and proc.returncode != 0:
            pytest.fail(
                f"{' '.join(args)} exited {proc.returncode} in {self.dir}:\n"
                f"{proc.stdout}\n{proc.stderr}"
            )
        return proc

    def manage(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.run("manage.py", *args, check=check)

    def shell(self, code: str) -> str:
        return self.manage("shell", "--no-imports", "-c", code).stdout

    def query(self, code: str) -> Any:
        """Run ``code`` in the shell; it prints one JSON value, returned decoded."""
        return json.loads(self.shell(code).strip().splitlines()[-1])


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
    base = tmp_path_factory.mktemp("readme")
    # The package as installed, and nothing else of this repository (not tests/).
    site = base / "site"
    site.mkdir()
    (site / "django_dbworker").symlink_to(ROOT / "django_dbworker")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"DJANGO_SETTINGS_MODULE", "DATABASE_URL", "PYTHONPATH"}
        and not k.startswith("DBWORKER_")
    }
    env["PYTHONPATH"] = str(site)
    project = Project(base / "mysite", env)
    project.dir.mkdir()
    project.run("-m", "django", "startproject", "mysite", str(project.dir))
    project.manage("startapp", "myapp")

    (project.dir / "myapp" / "models.py").write_text(MODELS)
    (project.dir / "myapp" / "views.py").write_text(VIEWS)
    (project.dir / "mysite" / "urls.py").write_text(URLS)
    (project.dir / "pytest.ini").write_text(PYTEST_INI)

    settings = project.dir / "mysite" / "settings.py"
    text = settings.read_text()
    for block in blocks_of("settings"):
        text += f"\n# {block.where}\n{block.settings_code()}"
    text += '\n# The scaffolding\nINSTALLED_APPS += ["myapp"]\n'
    text += 'EMAIL_BACKEND = "django.core.mail.backends.console.EmailBackend"\n'

    pg_name = my_name = None
    if connection.vendor == "mysql":
        params = connection.settings_dict
        my_name = f"readme_{uuid.uuid4().hex[:12]}"
        _mysql_admin(params, f"CREATE DATABASE `{my_name}` CHARACTER SET utf8mb4")
        db = {
            "ENGINE": "django.db.backends.mysql",
            "NAME": my_name,
            "USER": params["USER"],
            "PASSWORD": params["PASSWORD"],
            "HOST": params["HOST"],
            "PORT": str(params["PORT"]),
            "OPTIONS": {"charset": "utf8mb4"},
        }
        text += f"DATABASES = {{'default': {db!r}}}\n"
        # Known on MySQL, see tests/settings.py (no partial or expression indexes).
        text += 'SILENCED_SYSTEM_CHECKS = ["models.W036", "models.W037", "models.W043"]\n'
    elif connection.vendor == "postgresql":
        params = connection.settings_dict
        pg_name = f"readme_{uuid.uuid4().hex[:12]}"
        _pg_admin(params, "CREATE DATABASE {}", pg_name)
        db = {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": pg_name,
            "USER": params["USER"],
            "PASSWORD": params["PASSWORD"],
            "HOST": params["HOST"],
            "PORT": str(params["PORT"]),
        }
        text += f"DATABASES = {{'default': {db!r}}}\n"
    settings.write_text(text)

    files: dict[str, str] = {}
    for block in blocks_of("file") + blocks_of("test"):
        assert block.path is not None
        files[block.path] = files.get(block.path, "") + f"# {block.where}\n{block.code}\n"
    for path, code in files.items():
        target = project.dir / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(code)

    try:
        project.manage("makemigrations", "myapp", "-v", "0")
        project.manage("migrate", "-v", "0")
        yield project
    finally:
        if pg_name is not None:
            _pg_admin(connection.settings_dict, "DROP DATABASE IF EXISTS {} WITH (FORCE)", pg_name)
        if my_name is not None:
            _mysql_admin(connection.settings_dict, f"DROP DATABASE IF EXISTS `{my_name}`")


def _mysql_admin(params: dict[str, Any], statement: str) -> None:
    import MySQLdb

    conn = MySQLdb.connect(
        user=params["USER"],
        password=params["PASSWORD"] or "",
        host=params["HOST"],
        port=int(params["PORT"]),
    )
    try:
        conn.cursor().execute(statement)
    finally:
        conn.close()


def _pg_admin(params: dict[str, Any], statement: str, name: str) -> None:
    import psycopg
    from psycopg import sql

    with psycopg.connect(
        dbname=params["NAME"],
        user=params["USER"],
        password=params["PASSWORD"] or None,
        host=params["HOST"],
        port=params["PORT"],
        autocommit=True,
    ) as conn:
        conn.execute(sql.SQL(statement).format(sql.Identifier(name)))


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
    assert after["invoices"] == ["sent", "sent"], after


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
    assert "1 passed" in proc.stdout, proc.stdout


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
