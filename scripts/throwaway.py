"""What the throwaway-server scripts share (pgcluster.py, mariadbcluster.py; stdlib only).

Installing a server's Debian package when its binaries are missing, and
picking a free port on 127.0.0.1. The scripts run before the package is
installed, so this sits beside them, not in it.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def ensure_installed(package: str, find: Callable[[], T | None], log: Callable[[str], None]) -> T:
    """``find()``, after ``apt-get install package`` if it found nothing (root only)."""
    found = find()
    if found is not None:
        return found
    if os.geteuid() != 0:
        sys.exit(f"The {package} binaries are missing; install the Debian {package!r} package.")
    log(f"installing the {package} binaries (apt-get install {package})")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", package],
        check=True,
        env=env,
    )
    found = find()
    if found is None:
        sys.exit(f"apt-get installed {package} but its binaries were not found")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(
    description: str,
    default_state: Path,
    *,
    start: Callable[[Path, bool], dict[str, object]],
    stop: Callable[[Path], None],
    restart: Callable[[Path], None],
    ensure_installed: Callable[[], object],
    down: Callable[[Path], None] | None = None,
    up: Callable[[Path], None] | None = None,
) -> None:
    """The command line of both scripts: start (prints the URL), stop, restart, ensure-installed.

    ``down`` and ``up`` (where a script has them) stop the server and start
    it again with its data kept: an outage of a chosen length.
    """
    parser = argparse.ArgumentParser(description=description)
    actions = ["start", "stop", "restart", "ensure-installed"]
    actions += [name for name, fn in (("down", down), ("up", up)) if fn is not None]
    parser.add_argument("action", choices=actions)
    parser.add_argument("--state", type=Path, default=default_state)
    parser.add_argument("--durable", action="store_true")
    args = parser.parse_args()
    if args.action == "start":
        print(start(args.state, args.durable)["url"])
    elif args.action == "stop":
        stop(args.state)
    elif args.action == "restart":
        restart(args.state)
    elif args.action == "down" and down is not None:
        down(args.state)
    elif args.action == "up" and up is not None:
        up(args.state)
    else:
        print(ensure_installed())
