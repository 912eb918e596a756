"""The probe of a worker's health file, without Django: ``python -m django_dbworker.probe``.

``run_workers --health-file PATH`` keeps a small JSON file fresh while the worker is
healthy (``worker/health_file.py``). A liveness probe runs every few seconds: setting
Django up for it (``manage.py dbworker_health``) costs 0.3 CPU-seconds a probe in the
example project, more in a project of many apps, against a worker's CPU request of a
fraction of a core. This module answers from the file alone with the standard library
(``import django_dbworker`` is all it pays: about 0.06 s), and ``dbworker_health``
answers through it, so the two never disagree:

    python -m django_dbworker.probe --file /tmp/worker-health --max-age 30

Exit status 0 with one line when the file was written within ``--max-age`` seconds; 1
with one line saying why not (missing: the worker is not running or has stopped;
stale: it is stuck or unhealthy, and its log says why); 2 for a usage error. The file
must be a regular file of the probing user (or of anyone, for root): a link at the
path, or a file another user wrote there, is not the worker's.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
import time
from pathlib import Path

#: Default ``--max-age``: a few of the worker's write intervals (5 s at most).
MAX_AGE = 30.0


def probe(path: Path, max_age: float) -> tuple[bool, str]:
    """Whether the worker that writes ``path`` is healthy, and one line saying so."""
    try:
        found = path.lstat()
        if not stat.S_ISREG(found.st_mode):
            what = "a link" if stat.S_ISLNK(found.st_mode) else "not a regular file"
            return False, f"Unhealthy: {path} is {what}, not the worker's file."
        if os.geteuid() not in (0, found.st_uid):
            return False, f"Unhealthy: {path} belongs to another user, not to the worker's."
        age = time.time() - found.st_mtime
        body = json.loads(path.read_text())
    except FileNotFoundError:
        return False, (f"Unhealthy: {path} does not exist (the worker is not running, or stopped).")
    except (OSError, ValueError) as exc:
        return False, f"Unhealthy: cannot read {path}: {exc}."
    who = f"pid {body.get('pid', '?')} on {body.get('host', '?')}"
    if age > max_age:
        return False, (
            f"Unhealthy: {path} ({who}) was last written {age:.0f} s ago, more than "
            f"{max_age:g} s; the worker's log says why."
        )
    return True, f"Healthy: {who}, written {age:.1f} s ago."


def seconds(text: str) -> float:
    """A positive, finite number of seconds (``--max-age``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


#: What ``--help`` says, here and for ``dbworker_health``.
DESCRIPTION = "Exit 0 if the worker's --health-file is fresh, 1 (saying why) if not."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--file`` and ``--max-age``: this module's and ``dbworker_health``'s flags."""
    parser.add_argument("--file", required=True, metavar="PATH", help="The worker's file.")
    parser.add_argument(
        "--max-age",
        type=seconds,
        default=MAX_AGE,
        metavar="SECONDS",
        help=f"Oldest acceptable write (default {MAX_AGE:g}).",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m django_dbworker.probe", description=DESCRIPTION
    )
    add_arguments(parser)
    options = parser.parse_args(argv)
    healthy, line = probe(Path(options.file), options.max_age)
    print(line, file=sys.stdout if healthy else sys.stderr)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
