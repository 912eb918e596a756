#!/usr/bin/env python3
"""Throwaway PostgreSQL clusters for tests and benchmarks (stdlib only).

    scripts/pgcluster.py start --state .tmp/pg.json [--durable]   # prints the URL
    scripts/pgcluster.py stop  --state .tmp/pg.json
    scripts/pgcluster.py down  --state .tmp/pg.json   # stop, keeping the data (an outage)
    scripts/pgcluster.py up    --state .tmp/pg.json   # and start it again

Uses the Debian ``postgresql`` server binaries, installing them with apt-get
when missing (root only). As root, the cluster is owned by the unprivileged
``postgres`` user, since PostgreSQL refuses to run as root. The server
listens on 127.0.0.1 and a private socket directory only. Tests run with
``fsync=off`` (a crash of the test server loses nothing we need);
benchmarks pass ``--durable`` to measure real commits.
"""

from __future__ import annotations

import glob
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import throwaway  # scripts/throwaway.py, beside this script


def log(msg: str) -> None:
    print(f"[pgcluster] {msg}", file=sys.stderr, flush=True)


def find_bindir() -> Path | None:
    candidates = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0,
    )
    if candidates:
        return Path(candidates[-1]).parent
    found = shutil.which("initdb")
    return Path(found).resolve().parent if found else None


def ensure_installed() -> Path:
    return throwaway.ensure_installed("postgresql", find_bindir, log)


def run_as_owner(cmd: list[str], owner: str | None) -> subprocess.CompletedProcess[str]:
    if owner:
        cmd = ["runuser", "-u", owner, "--", *cmd]
    return subprocess.run(cmd, check=True, text=True, capture_output=True)


def start(state: Path, durable: bool) -> dict[str, object]:
    if state.exists():
        info = json.loads(state.read_text())
        if _running(Path(str(info["datadir"]))):
            log(f"reusing the running cluster in {info['datadir']}")
            return info
        stop(state)
    bindir = ensure_installed()
    owner = None
    if os.geteuid() == 0:
        owner = "postgres"
        try:
            pwd.getpwnam(owner)
        except KeyError:
            subprocess.run(["useradd", "--system", "--no-create-home", owner], check=True)
    base = Path(tempfile.mkdtemp(prefix="dbworker-pg-"))
    datadir = base / "data"
    if owner:
        shutil.chown(base, owner)
    os.chmod(base, 0o755)
    run_as_owner(
        [
            str(bindir / "initdb"),
            "-D",
            str(datadir),
            "-U",
            "postgres",
            "--auth=trust",
            "-E",
            "UTF8",
            "--locale=C.UTF-8" if _has_c_utf8() else "--locale=C",
            "--no-sync",
        ],
        owner,
    )
    port = throwaway.free_port()
    settings = {
        "listen_addresses": "'127.0.0.1'",
        "port": str(port),
        "unix_socket_directories": f"'{base}'",
        "max_connections": "300",
        "shared_buffers": "256MB",
        "fsync": "on" if durable else "off",
        "synchronous_commit": "on" if durable else "off",
        "full_page_writes": "on" if durable else "off",
        "log_min_messages": "warning",
        "logging_collector": "off",
    }
    conf = "".join(f"{k} = {v}\n" for k, v in settings.items())
    with open(datadir / "postgresql.conf", "a") as fh:
        fh.write(conf)
    logfile = base / "server.log"
    run_as_owner(
        [str(bindir / "pg_ctl"), "-D", str(datadir), "-l", str(logfile), "-w", "-t", "60", "start"],
        owner,
    )
    info: dict[str, object] = {
        "datadir": str(datadir),
        "base": str(base),
        "port": port,
        "bindir": str(bindir),
        "owner": owner,
        "url": f"postgres://postgres@127.0.0.1:{port}/postgres",
        "durable": durable,
    }
    state.parent.mkdir(parents=True, exist_ok=True)
    state.write_text(json.dumps(info))
    log(f"PostgreSQL started on 127.0.0.1:{port} ({'durable' if durable else 'fsync off'})")
    return info


def _running(datadir: Path) -> bool:
    """Whether the server of ``datadir`` runs: its pid file names a live process (a pid file
    left by a machine's restart names none, or another process, which then holds no port)."""
    try:
        pid = int((datadir / "postmaster.pid").read_text().split()[0])
        os.kill(pid, 0)
    except (OSError, ValueError, IndexError):
        return False
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # no /proc here: the live pid is taken as the server's
        return True
    return command.split(b"\0")[0].endswith(b"postgres")


def _has_c_utf8() -> bool:
    return any(Path(p).exists() for p in ("/usr/lib/locale/C.utf8", "/usr/lib/locale/C.UTF-8"))


def stop(state: Path) -> None:
    if not state.exists():
        return
    info = json.loads(state.read_text())
    datadir = Path(str(info["datadir"]))
    if (datadir / "postmaster.pid").exists():
        try:
            run_as_owner(
                [
                    str(Path(str(info["bindir"])) / "pg_ctl"),
                    "-D",
                    str(datadir),
                    "-m",
                    "fast",
                    "-w",
                    "-t",
                    "60",
                    "stop",
                ],
                info.get("owner") or None,  # type: ignore[arg-type]
            )
        except subprocess.CalledProcessError as exc:
            log(f"pg_ctl stop failed: {exc.stderr.strip()}")
    shutil.rmtree(str(info["base"]), ignore_errors=True)
    state.unlink(missing_ok=True)
    log("PostgreSQL stopped and removed")


def restart(state: Path) -> None:
    """Restart the server in place (used by the server-restart test)."""
    info = json.loads(state.read_text())
    run_as_owner(
        [
            str(Path(str(info["bindir"])) / "pg_ctl"),
            "-D",
            str(info["datadir"]),
            "-m",
            "fast",
            "-w",
            "-t",
            "60",
            "-l",
            str(Path(str(info["base"])) / "server.log"),
            "restart",
        ],
        info.get("owner") or None,  # type: ignore[arg-type]
    )


def _pg_ctl(state: Path, action: str) -> None:
    info = json.loads(state.read_text())
    run_as_owner(
        [
            str(Path(str(info["bindir"])) / "pg_ctl"),
            "-D",
            str(info["datadir"]),
            "-m",
            "fast",
            "-w",
            "-t",
            "60",
            "-l",
            str(Path(str(info["base"])) / "server.log"),
            action,
        ],
        info.get("owner") or None,  # type: ignore[arg-type]
    )


def down(state: Path) -> None:
    """Stop the server, keeping its data (an outage; ``up`` ends it)."""
    _pg_ctl(state, "stop")


def up(state: Path) -> None:
    """Start the server stopped by ``down``, on the same port, with the same data."""
    _pg_ctl(state, "start")


def main() -> None:
    throwaway.main(
        __doc__,
        Path(".tmp/pg.json"),
        start=start,
        stop=stop,
        restart=restart,
        ensure_installed=ensure_installed,
        down=down,
        up=up,
    )


if __name__ == "__main__":
    main()
