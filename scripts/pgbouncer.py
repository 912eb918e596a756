#!/usr/bin/env python3
"""A throwaway PgBouncer in transaction mode, in front of a throwaway cluster (stdlib only).

    scripts/pgbouncer.py start --state .tmp/bouncer.json --upstream-state .tmp/pg.json
    scripts/pgbouncer.py stop  --state .tmp/bouncer.json

``start`` prints a DATABASE_URL that reaches the cluster of
``--upstream-state`` (``scripts/pgcluster.py``) through PgBouncer: the
URL's database is ``dbworker_bouncer`` (any name reaches the cluster's
database of that name: the ``*`` entry), so that its test database
(``test_dbworker_bouncer``) is not the one of a test run connecting
directly to the same cluster.

Uses the Debian ``pgbouncer`` package (1.18 on bookworm), installing it with
apt-get when missing (root only). ``pool_mode = transaction``: a server
connection belongs to a client for one transaction only, what users of the
common pooler run, so session state (LISTEN, session advisory locks,
``SET``, protocol-level prepared statements) does not survive from one
transaction to the next. Authentication is ``trust`` with a userlist naming
the cluster's ``postgres`` user (``trust`` still wants the name listed);
the cluster itself trusts 127.0.0.1. PgBouncer listens on 127.0.0.1 only,
on a free port, with its config, pid file and log in a directory of its
own; it daemonizes (``-d``) only after writing its pid file, and ``stop``
signals that pid, never a process found by name. As root it runs as the
cluster's owner (PgBouncer refuses to run as root).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import throwaway  # scripts/throwaway.py, beside this script

#: The database name of the printed URL (a fresh name: see the module docstring).
DATABASE = "dbworker_bouncer"


def log(msg: str) -> None:
    print(f"[pgbouncer] {msg}", file=sys.stderr, flush=True)


def find_binary() -> Path | None:
    for candidate in ("/usr/sbin/pgbouncer", shutil.which("pgbouncer")):
        if candidate and Path(candidate).exists():
            return Path(candidate)
    return None


def ensure_installed() -> Path:
    return throwaway.ensure_installed("pgbouncer", find_binary, log)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _pid(info: dict[str, object]) -> int | None:
    try:
        return int(Path(str(info["pidfile"])).read_text().strip())
    except (OSError, ValueError):
        return None


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def start(state: Path, upstream_state: Path) -> dict[str, object]:
    if state.exists():
        info = json.loads(state.read_text())
        pid = _pid(info)
        if pid is not None and _alive(pid):
            log(f"reusing the running PgBouncer (pid {pid})")
            return info
        stop(state)
    binary = ensure_installed()
    upstream = json.loads(upstream_state.read_text())
    owner = upstream.get("owner") or None
    base = Path(tempfile.mkdtemp(prefix="dbworker-bouncer-"))
    if owner:
        shutil.chown(base, owner)
    os.chmod(base, 0o755)
    port = throwaway.free_port()
    userlist = base / "userlist.txt"
    userlist.write_text('"postgres" ""\n')
    config = base / "pgbouncer.ini"
    settings = {
        "listen_addr": "127.0.0.1",
        "listen_port": str(port),
        "unix_socket_dir": "",
        "auth_type": "trust",
        "auth_file": str(userlist),
        "admin_users": "postgres",
        "pool_mode": "transaction",
        "max_client_conn": "500",
        "default_pool_size": "20",
        "logfile": str(base / "pgbouncer.log"),
        "pidfile": str(base / "pgbouncer.pid"),
        # Django sets TimeZone on each connection; PgBouncer tracks it per client.
        "ignore_startup_parameters": "extra_float_digits,options",
    }
    config.write_text(
        "[databases]\n"
        f"* = host=127.0.0.1 port={upstream['port']} user=postgres\n"
        "[pgbouncer]\n" + "".join(f"{k} = {v}\n" for k, v in settings.items())
    )
    for path in (userlist, config):
        if owner:
            shutil.chown(path, owner)
    cmd = [str(binary), "-d", "-q", str(config)]
    if owner:
        cmd = ["runuser", "-u", owner, "--", *cmd]
    info: dict[str, object] = {
        "base": str(base),
        "port": port,
        "pidfile": str(base / "pgbouncer.pid"),
        "logfile": str(base / "pgbouncer.log"),
        "upstream_port": upstream["port"],
        "url": f"postgres://postgres@127.0.0.1:{port}/{DATABASE}",
    }
    state.parent.mkdir(parents=True, exist_ok=True)
    # Written before the start: a failed start is still stopped and removed.
    state.write_text(json.dumps(info))
    subprocess.run(cmd, check=True, text=True, capture_output=True)
    deadline = time.monotonic() + 30
    while not (_pid(info) is not None and _accepts(port)):
        if time.monotonic() > deadline:
            logtext = Path(str(info["logfile"])).read_text(errors="replace")
            stop(state)
            sys.exit(f"PgBouncer did not start within 30 s; its log:\n{logtext}")
        time.sleep(0.05)
    log(f"PgBouncer (transaction mode) on 127.0.0.1:{port} -> 127.0.0.1:{upstream['port']}")
    return info


def stop(state: Path) -> None:
    if not state.exists():
        return
    info = json.loads(state.read_text())
    pid = _pid(info)
    if pid is not None and _alive(pid):
        # SIGINT: PgBouncer's "safe shutdown" waits for clients to finish
        # their transactions; SIGTERM ("immediate shutdown") does not wait.
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while _alive(pid):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                break
            time.sleep(0.05)
    shutil.rmtree(str(info["base"]), ignore_errors=True)
    state.unlink(missing_ok=True)
    log("PgBouncer stopped and removed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("action", choices=["start", "stop", "ensure-installed"])
    parser.add_argument("--state", type=Path, default=Path(".tmp/bouncer.json"))
    parser.add_argument("--upstream-state", type=Path, default=Path(".tmp/pg.json"))
    args = parser.parse_args()
    if args.action == "start":
        print(start(args.state, args.upstream_state)["url"])
    elif args.action == "stop":
        stop(args.state)
    else:
        print(ensure_installed())


if __name__ == "__main__":
    main()
