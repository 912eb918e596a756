#!/usr/bin/env python3
"""Checks the built sdist and wheel (stdlib only): what a user would install.

    python -m build --outdir .tmp/dist . && scripts/check_dist.py .tmp/dist

`twine check` validates the metadata's rendering; this checks the contents:
every module of the package that git tracks, its migrations, templates and
``py.typed`` are in the wheel, nothing else is (no tests, no bytecode), the
sdist holds the package, README, LICENSE and pyproject.toml, the metadata
names the distribution, Django and the extras the README installs, and the
wheel file name the README spells out is the one the build produced.
Then the wheel is installed into a clean virtual environment (pip fetches
Django from the index or its cache), and a one-file project there runs
``manage.py check``, ``migrate`` and a ``run_workers --burst`` of one item:
what a first install does, away from the checkout.
Exits 1 with one line per problem.
"""

from __future__ import annotations

import email
import subprocess
import sys
import tarfile
import tempfile
import venv
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "django_dbworker"
# Data files that must ship; a wheel missing them installs, then fails at run time.
REQUIRED = [
    f"{PACKAGE}/py.typed",
    f"{PACKAGE}/migrations/__init__.py",
    f"{PACKAGE}/migrations/0001_initial.py",
    f"{PACKAGE}/templates/admin/{PACKAGE}/summary.html",
]
EXTRAS = ["postgres", "prometheus", "otel"]


def tracked_package_files() -> set[str]:
    out = subprocess.run(
        ["git", "ls-files", PACKAGE], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout
    return {line for line in out.splitlines() if line}


def _version() -> str:
    text = (ROOT / PACKAGE / "version.py").read_text()
    return text.split('__version__ = "', 1)[1].split('"', 1)[0]


def main(dist: Path) -> list[str]:
    problems: list[str] = []
    # The one place the version is written (pyproject.toml reads it from there).
    version = _version()
    wheels = sorted(dist.glob("*.whl"))
    sdists = sorted(dist.glob("*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        return [f"expected one wheel and one sdist in {dist}, found {wheels + sdists}"]
    wheel, sdist = wheels[0], sdists[0]

    expected_wheel = f"{PACKAGE}-{version}-py3-none-any.whl"
    if wheel.name != expected_wheel:
        problems.append(f"wheel is named {wheel.name}, expected {expected_wheel}")
    if expected_wheel not in (ROOT / "README.md").read_text():
        problems.append(f"README.md does not name the wheel {expected_wheel} (version bumped?)")

    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        metadata = email.message_from_bytes(zf.read(f"{PACKAGE}-{version}.dist-info/METADATA"))
    package_files = {n for n in names if not n.startswith(f"{PACKAGE}-{version}.dist-info/")}
    for missing in sorted((tracked_package_files() | set(REQUIRED)) - package_files):
        problems.append(f"wheel lacks {missing}")
    for extra in sorted(package_files - tracked_package_files()):
        problems.append(f"wheel has a file git does not track: {extra}")

    if metadata["Name"] != "django-dbworker" or metadata["Version"] != version:
        problems.append(f"metadata names {metadata['Name']} {metadata['Version']}")
    requires = metadata.get_all("Requires-Dist") or []
    if not any(r.startswith("django>=") or r.startswith("Django>=") for r in requires):
        problems.append(f"metadata does not require Django: {requires}")
    provided = metadata.get_all("Provides-Extra") or []
    for extra in EXTRAS:
        if extra not in provided:
            problems.append(f"metadata lacks the extra {extra!r} (has {provided})")
    if metadata.get("Description-Content-Type") != "text/markdown":
        problems.append("metadata: the README is not declared as Markdown")

    prefix = f"{PACKAGE}-{version}/"
    with tarfile.open(sdist) as tf:
        in_sdist = {m.name.removeprefix(prefix) for m in tf.getmembers() if m.isfile()}
    for required in ["README.md", "LICENSE", "pyproject.toml", *REQUIRED]:
        if required not in in_sdist:
            problems.append(f"sdist lacks {required}")
    if not problems:
        problems += installed_and_run(wheel)
    return problems


#: A project of two files: its settings, and an app whose workers.py has a handler.
PROJECT = """
from pathlib import Path

BASE = Path(__file__).resolve().parent
SECRET_KEY = "check-dist"
USE_TZ = True
ROOT_URLCONF = __name__
urlpatterns: list = []
INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "django_dbworker",
    "shop",
]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": BASE / "db.sqlite3",
        "OPTIONS": {"init_command": "PRAGMA journal_mode=WAL", "transaction_mode": "IMMEDIATE",
                    "timeout": 20},
    }
}
"""
HANDLER = """
from django_dbworker import WorkItemHandler


class Double(WorkItemHandler):
    name = "double"

    def handle(self, payload):
        return payload * 2
"""


def installed_and_run(wheel: Path) -> list[str]:
    """Install ``wheel`` into a fresh venv and run one item through it, outside the checkout."""
    wheel = wheel.resolve()  # the steps run in the temporary project
    with tempfile.TemporaryDirectory(prefix="dbworker-wheel-") as tmp:
        home = Path(tmp)
        venv.EnvBuilder(with_pip=True).create(home / "venv")
        python = str(home / "venv" / "bin" / "python")
        (home / "site_settings.py").write_text(PROJECT)
        (home / "shop").mkdir()
        (home / "shop" / "__init__.py").write_text("")
        (home / "shop" / "workers.py").write_text(HANDLER)
        env = {
            "PATH": "/usr/bin:/bin",
            "DJANGO_SETTINGS_MODULE": "site_settings",
            "PYTHONPATH": str(home),
            "HOME": str(home),
        }
        steps = [
            [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", str(wheel)],
            [python, "-m", "django", "check", "--fail-level", "WARNING"],
            [python, "-m", "django", "migrate", "-v", "0"],
            [
                python,
                "-c",
                "import django; django.setup(); import shop.workers as w; w.Double.enqueue(21)",
            ],
            [python, "-m", "django", "run_workers", "--burst", "double"],
            [
                python,
                "-c",
                "import django; django.setup(); "
                "from django_dbworker.models import WorkItem; "
                "row = WorkItem.objects.get(); "
                "assert (row.status, row.result) == ('succeeded', 42), row.last_error",
            ],
        ]
        for step in steps:
            done = subprocess.run(
                step, cwd=home, env=env, capture_output=True, text=True, timeout=300
            )
            if done.returncode != 0:
                return [
                    f"installed wheel: {' '.join(step[1:4])}... exited {done.returncode}: "
                    f"{(done.stderr or done.stdout).strip()[-1500:]}"
                ]
    return []


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} DIST_DIR")
    found = main(Path(sys.argv[1]))
    for problem in found:
        print(f"!! {problem}", file=sys.stderr)
    if found:
        sys.exit(1)
    print(
        "dist: sdist and wheel contain the package, migrations, templates and py.typed; "
        "the wheel installed in a clean venv ran an item"
    )
