#!/usr/bin/env python3
"""Throwaway MariaDB servers for tests and benchmarks (stdlib only).

    scripts/mariadbcluster.py start --state .tmp/mariadb.json [--durable]   # prints the URL
    scripts/mariadbcluster.py stop  --state .tmp/mariadb.json

Uses the Debian ``mariadb-server`` binaries, installing them with apt-get
when missing (root only). As root, the server runs as the unprivileged
``mysql`` user (``--user``). It listens on 127.0.0.1 and a private socket
in its temporary directory only, with its data there too; ``stop`` removes
all of it. Tests run with ``innodb_flush_log_at_trx_commit=0`` and no
doublewrite (a crash of the test server loses nothing we need); benchmarks
pass ``--durable`` to measure real commits. The binary log stays off (so
the binlog_format warning of the system checks does not apply), and the
isolation level is the server's default, REPEATABLE READ, on purpose: the
worker must not rely on a READ-COMMITTED server setting.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import throwaway  # scripts/throwaway.py, beside this script

#: How long the server may take to accept connections, or to exit.
START_TIMEOUT = 60.0
STOP_TIMEOUT = 60.0


def log(msg: str) -> None:
    print(f"[mariadbcluster] {msg}", file=sys.stderr, flush=True)


def find_binaries() -> tuple[Path, Path, Path] | None:
    """``mariadbd``, ``mariadb-install-db`` and the ``mariadb`` client, if all are there."""
    server = shutil.which("mariadbd") or shutil.which("mariadbd", path="/usr/sbin:/usr/bin")
    install = shutil.which("mariadb-install-db")
    client = shutil.which("mariadb")
    if server and install and client:
        return Path(server), Path(install), Path(client)
    return None


def ensure_installed() -> tuple[Path, Path, Path]:
    return throwaway.ensure_installed("mariadb-server", find_binaries, log)


def server_args(info: dict[str, object]) -> list[str]:
    """The server's command line: every setting explicit, no option files read."""
    base = Path(str(info["base"]))
    durable = bool(info["durable"])
    args = [
        str(info["server"]),
        "--no-defaults",
        f"--datadir={info['datadir']}",
        f"--socket={base / 'mysqld.sock'}",
        f"--pid-file={base / 'mysqld.pid'}",
        f"--log-error={base / 'server.log'}",
        f"--port={info['port']}",
        "--bind-address=127.0.0.1",
        "--skip-name-resolve",
        "--skip-log-bin",
        "--character-set-server=utf8mb4",
        "--collation-server=utf8mb4_unicode_ci",
        # Deliberately not UTC: the package must set its sessions' zone itself
        # (Django's Now() is CURRENT_TIMESTAMP, in the session's time zone),
        # and a test server in UTC would hide it if it did not.
        "--default-time-zone=+05:30",
        "--max-connections=400",
        "--innodb-buffer-pool-size=256M",
        "--innodb-log-file-size=256M",
        f"--innodb-flush-log-at-trx-commit={1 if durable else 0}",
        f"--innodb-doublewrite={1 if durable else 0}",
        f"--sync-binlog={1 if durable else 0}",
        "--performance-schema=OFF",
    ]
    if info.get("owner"):
        args.append(f"--user={info['owner']}")
    return args


def client(info: dict[str, object], sql: str) -> str:
    base = Path(str(info["base"]))
    result = subprocess.run(
        [
            str(info["client"]),
            "--no-defaults",
            f"--socket={base / 'mysqld.sock'}",
            "-uroot",
            "--batch",
            "--skip-column-names",
            "-e",
            sql,
        ],
        check=True,
        text=True,
        capture_output=True,
    )
    return result.stdout


def launch(info: dict[str, object]) -> int:
    """Start the server in the background; wait until it answers. Returns its pid."""
    base = Path(str(info["base"]))
    logfile = open(base / "stdout.log", "ab")  # noqa: SIM115 - handed to the server
    proc = subprocess.Popen(
        server_args(info),
        stdin=subprocess.DEVNULL,
        stdout=logfile,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    logfile.close()
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        if proc.poll() is not None:
            tail = (base / "server.log").read_text(errors="replace")[-3000:]
            sys.exit(f"mariadbd exited with {proc.returncode}:\n{tail}")
        try:
            client(info, "SELECT 1")
            return proc.pid
        except subprocess.CalledProcessError:
            pass
        if time.monotonic() > deadline:
            os.kill(proc.pid, signal.SIGKILL)
            sys.exit(f"mariadbd did not accept connections within {START_TIMEOUT}s")
        time.sleep(0.1)


def start(state: Path, durable: bool) -> dict[str, object]:
    if state.exists():
        info = json.loads(state.read_text())
        if _alive(int(info.get("pid") or 0)):
            log(f"reusing the running server in {info['datadir']}")
            return info
        stop(state)
    server, install, client_bin = ensure_installed()
    owner = None
    if os.geteuid() == 0:
        owner = "mysql"
        try:
            pwd.getpwnam(owner)
        except KeyError:
            subprocess.run(["useradd", "--system", "--no-create-home", owner], check=True)
    base = Path(tempfile.mkdtemp(prefix="dbworker-mariadb-"))
    datadir = base / "data"
    if owner:
        shutil.chown(base, owner)
    os.chmod(base, 0o755)
    install_cmd = [
        str(install),
        "--no-defaults",
        f"--datadir={datadir}",
        "--auth-root-authentication-method=normal",
        "--skip-test-db",
    ]
    if owner:
        install_cmd.append(f"--user={owner}")
    # Once more if it fails: a CI run saw one of two installs started in the same second
    # fail (its output was not kept then; now it is printed).
    for attempt in (1, 2):
        done = subprocess.run(install_cmd, text=True, capture_output=True)
        if done.returncode == 0:
            break
        output = (done.stderr.strip() or done.stdout.strip())[-3000:]
        log(f"mariadb-install-db failed (exit {done.returncode}, try {attempt} of 2):\n{output}")
        if attempt == 2:
            raise SystemExit(1)
        shutil.rmtree(datadir, ignore_errors=True)
    port = throwaway.free_port()
    info: dict[str, object] = {
        "base": str(base),
        "datadir": str(datadir),
        "port": port,
        "server": str(server),
        "client": str(client_bin),
        "owner": owner,
        "durable": durable,
        "url": f"mysql://root@127.0.0.1:{port}/dbworker",
    }
    info["pid"] = launch(info)
    # root@localhost only matches the socket; TCP from 127.0.0.1 (with
    # skip-name-resolve) needs its own account. No password: the server
    # listens on the loopback only and lives as long as the test run.
    client(
        info,
        "CREATE USER IF NOT EXISTS 'root'@'127.0.0.1';"
        "GRANT ALL PRIVILEGES ON *.* TO 'root'@'127.0.0.1' WITH GRANT OPTION;"
        "CREATE DATABASE IF NOT EXISTS dbworker CHARACTER SET utf8mb4;",
    )
    state.parent.mkdir(parents=True, exist_ok=True)
    state.write_text(json.dumps(info))
    version = client(info, "SELECT VERSION()").strip()
    log(f"MariaDB {version} started on 127.0.0.1:{port} ({'durable' if durable else 'no flush'})")
    return info


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie of ours counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] != "Z"
    except OSError:
        return False


def shutdown(info: dict[str, object]) -> None:
    """Stop the server we started (by its pid): SIGTERM is a clean shutdown for mariadbd."""
    pid = int(info.get("pid") or 0)
    if not _alive(pid):
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT
    while _alive(pid):
        if time.monotonic() > deadline:
            log(f"mariadbd {pid} ignored SIGTERM for {STOP_TIMEOUT}s; killing it")
            os.kill(pid, signal.SIGKILL)
            break
        time.sleep(0.05)


def stop(state: Path) -> None:
    if not state.exists():
        return
    info = json.loads(state.read_text())
    shutdown(info)
    shutil.rmtree(str(info["base"]), ignore_errors=True)
    state.unlink(missing_ok=True)
    log("MariaDB stopped and removed")


def restart(state: Path) -> None:
    """Restart the server in place, same port and data (used by the server-restart test)."""
    info = json.loads(state.read_text())
    shutdown(info)
    info["pid"] = launch(info)
    state.write_text(json.dumps(info))


def main() -> None:
    throwaway.main(
        __doc__,
        Path(".tmp/mariadb.json"),
        start=start,
        stop=stop,
        restart=restart,
        ensure_installed=lambda: ensure_installed()[0],
    )


if __name__ == "__main__":
    main()
