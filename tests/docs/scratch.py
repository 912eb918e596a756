"""Scratch Django projects for the docs' examples, built as a reader would build them.

A project is made with ``django-admin startproject mysite`` and
``manage.py startapp myapp``; the blocks go where their first line says
(tests/docs/pages.py has the convention): settings blocks into
``mysite/settings.py``, file blocks into their files, the rest is run in
``manage.py shell --no-imports`` by the tests. Every command is a
subprocess, so a missing import or an unset setting fails as it would for
the reader. The package is importable as installed (a symlink on
PYTHONPATH), and nothing else of this repository is (not tests/).

On the PostgreSQL and MariaDB legs each project gets a database of its own
on the leg's server: through the environment variables its
``# settings.py (PostgreSQL)`` / ``(MySQL)`` block reads when it has one
(so that block is what connects), through a ``DATABASES`` override
otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from django.db import connection

from tests.docs.pages import Block

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 180.0


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


@contextmanager
def scratch_project(
    base: Path,
    blocks: Sequence[Block],
    *,
    files: dict[str, str] | None = None,
    settings_tail: str = "",
) -> Iterator[Project]:
    """A migrated project of ``blocks`` in ``base``; its server database dropped after.

    ``files`` are scaffolding files (path: contents) written before the
    blocks' files; ``settings_tail`` is scaffolding appended to the settings.
    """
    site = base / "site"
    site.mkdir()
    (site / "django_dbworker").symlink_to(ROOT / "django_dbworker")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"DJANGO_SETTINGS_MODULE", "DATABASE_URL", "PYTHONPATH"}
        and not k.startswith(("DBWORKER_", "PG", "MYSQL_"))
    }
    env["PYTHONPATH"] = str(site)
    project = Project(base / "mysite", env)
    project.dir.mkdir()
    project.run("-m", "django", "startproject", "mysite", str(project.dir))
    project.manage("startapp", "myapp")
    for path, code in (files or {}).items():
        (project.dir / path).write_text(code)

    vendor = connection.vendor
    settings = project.dir / "mysite" / "settings.py"
    text = settings.read_text()
    own_db_block = False
    for block in blocks:
        if block.kind == "settings" and block.applies_to(vendor):
            text += f"\n# {block.where}\n{block.settings_code()}"
            own_db_block = own_db_block or block.variant is not None
    text += settings_tail

    params = connection.settings_dict
    server_db: str | None = None
    if vendor in {"postgresql", "mysql"}:
        server_db = f"docs_{uuid.uuid4().hex[:12]}"
        if vendor == "mysql":
            _mysql_admin(params, f"CREATE DATABASE `{server_db}` CHARACTER SET utf8mb4")
        else:
            _pg_admin(params, "CREATE DATABASE {}", server_db)
        if own_db_block:
            prefix = "PG" if vendor == "postgresql" else "MYSQL_"
            names = ["HOST", "PORT", "USER", "PASSWORD"]
            for name in names:
                env[f"{prefix}{name}"] = str(params[name] or "")
            env[f"{prefix}DATABASE"] = server_db
        else:
            text += _database_override(vendor, params, server_db)
    settings.write_text(text)

    contents: dict[str, str] = {}
    for block in blocks:
        if block.kind in {"file", "test"}:
            assert block.path is not None
            contents[block.path] = contents.get(block.path, "") + f"# {block.where}\n{block.code}\n"
    for path, code in contents.items():
        target = project.dir / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(code)

    try:
        project.manage("makemigrations", "myapp", "-v", "0")
        project.manage("migrate", "-v", "0")
        yield project
    finally:
        if server_db is not None and vendor == "postgresql":
            _pg_admin(params, "DROP DATABASE IF EXISTS {} WITH (FORCE)", server_db)
        elif server_db is not None:
            _mysql_admin(params, f"DROP DATABASE IF EXISTS `{server_db}`")


def _database_override(vendor: str, params: dict[str, Any], name: str) -> str:
    db: dict[str, Any] = {
        "ENGINE": f"django.db.backends.{vendor}",
        "NAME": name,
        "USER": params["USER"],
        "PASSWORD": params["PASSWORD"],
        "HOST": params["HOST"],
        "PORT": str(params["PORT"]),
    }
    text = ""
    if vendor == "mysql":
        db["OPTIONS"] = {"charset": "utf8mb4"}
        # Known on MySQL, see tests/settings.py (no partial or expression indexes).
        text = 'SILENCED_SYSTEM_CHECKS = ["models.W036", "models.W037", "models.W043"]\n'
    return f"DATABASES = {{'default': {db!r}}}\n" + text


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
