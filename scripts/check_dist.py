#!/usr/bin/env python3
"""Checks the built sdist and wheel (stdlib only): what a user would install.

    python -m build --outdir .tmp/dist . && scripts/check_dist.py .tmp/dist

`twine check` validates the metadata's rendering; this checks the contents:
every module of the package that git tracks, its migrations, templates and
``py.typed`` are in the wheel, nothing else is (no tests, no bytecode), the
sdist holds the package, README, LICENSE and pyproject.toml, the metadata
names the distribution, Django and the extras the README installs, and the
wheel file name the README spells out is the one the build produced.
Exits 1 with one line per problem.
"""

from __future__ import annotations

import email
import subprocess
import sys
import tarfile
import tomllib
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


def main(dist: Path) -> list[str]:
    problems: list[str] = []
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    version = project["version"]
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
    return problems


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} DIST_DIR")
    found = main(Path(sys.argv[1]))
    for problem in found:
        print(f"!! {problem}", file=sys.stderr)
    if found:
        sys.exit(1)
    print("dist: sdist and wheel contain the package, migrations, templates and py.typed")
