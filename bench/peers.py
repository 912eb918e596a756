"""The peers through W1, W2 and W3 (and W6, start-up), each in its own virtual environment.

    .venv/bin/python bench/peers.py [--items 10000] [--only pgqueuer]
        [--modes w1,w2,w3,w1_large,w6,startup]

Installs each peer from PyPI into bench/.peers/NAME (once), gives it a
fresh database in the same durable PostgreSQL cluster as our benchmarks,
and runs its harness (bench/peer_harness/NAME_bench.py) with the same sizes and
the same concurrency (8) as ours. Prints one JSON line per peer, its
results under the mode names: w1, w2 and w3 by default; with ``--modes``
also w1_large (W1 at --items-large), w6 and startup, for the peers whose
harness has them (EXTRA_MODES; bench/run_all.py asks for all).

    .venv/bin/python bench/peers.py --mysql [--only django-tasks-db]

runs the peers that support MySQL (django-tasks-db only) on a durable
MariaDB instead, started by scripts/mariadbcluster.py (its own state file,
stopped at the end), or on the mysql:// DATABASE_URL when one is set.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

from common import ROOT, machine, start_postgres, stop_postgres

BENCH = Path(__file__).resolve().parent
MARIADB_STATE = ROOT / ".tmp" / "mariadb-peers.json"
VENVS = BENCH / ".peers"
HARNESS = BENCH / "peer_harness"

PEERS = {
    # asyncpg: the driver pgqueuer's README and CLI lead with (see its harness).
    # typer 0.29 breaks pgqueuer 1.6's CLI (`pgq run` fails in setup_fancy_logger:
    # its --log-level arrives as a str), so the last typer it runs with.
    "pgqueuer": (["pgqueuer==1.6.0", "asyncpg>=0.30.0", "typer<0.29"], "pgqueuer_bench.py"),
    "procrastinate": (["procrastinate==3.10.0", "psycopg[binary]>=3.2"], "procrastinate_bench.py"),
    "django-tasks-db": (
        ["django-tasks-db==0.13.0", "django-tasks", "Django>=5.2,<6", "psycopg[binary]>=3.2"],
        "djtasks_bench.py",
    ),
}
#: The peers that run on MySQL/MariaDB, and what their venv needs on top.
MYSQL_PEERS = {"django-tasks-db": ["mysqlclient"]}
#: Every peer's harness has w1, w2 and w3; these have the issue-20 modes too.
EXTRA_MODES = {"pgqueuer": ("w1_large", "w6", "startup")}
MODES = ("w1", "w2", "w3", "w1_large", "w6", "startup")


def venv_python(name: str, packages: list[str]) -> Path:
    venv = VENVS / name
    python = venv / "bin" / "python"
    marker = venv / ".installed"
    wanted = " ".join(packages)
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    if not marker.exists() or marker.read_text() != wanted:
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *packages],
            check=True,
        )
        marker.write_text(wanted)
    return python


def fresh_database(url: str, name: str) -> str:
    db = "peer_" + name.replace("-", "_")
    if url.startswith(("mysql://", "mariadb://")):
        return fresh_mysql_database(url, db)
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{db}"')
    return url.rsplit("/", 1)[0] + "/" + db


def fresh_mysql_database(url: str, db: str) -> str:
    import MySQLdb

    parts = urlparse(url)
    conn = MySQLdb.connect(
        host=parts.hostname,
        port=parts.port or 3306,
        user=parts.username or "root",
        password=parts.password or "",
        charset="utf8mb4",
    )
    try:
        cursor = conn.cursor()
        cursor.execute(f"DROP DATABASE IF EXISTS `{db}`")
        cursor.execute(f"CREATE DATABASE `{db}` CHARACTER SET utf8mb4 COLLATE utf8mb4_unicode_ci")
    finally:
        conn.close()
    return url.rsplit("/", 1)[0] + "/" + db


def start_mariadb() -> tuple[str, bool]:
    """The mysql:// DATABASE_URL if set, else a durable MariaDB of our own."""
    if os.environ.get("DATABASE_URL", "").startswith(("mysql://", "mariadb://")):
        return os.environ["DATABASE_URL"], False
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "mariadbcluster.py"),
            "start",
            "--durable",
            "--state",
            str(MARIADB_STATE),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    return out.stdout.strip(), True


def stop_mariadb() -> None:
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "mariadbcluster.py"),
            "stop",
            "--state",
            str(MARIADB_STATE),
        ],
        check=False,
        capture_output=True,
    )


def run(python: Path, script: str, url: str, *args: str) -> dict:
    env = dict(
        os.environ,
        DATABASE_URL=url,
        PYTHONPATH=str(HARNESS),
        BENCH_STAMPS=str(VENVS / "stamps.txt"),
    )
    out = subprocess.run(
        [str(python), str(HARNESS / script), *args],
        env=env,
        cwd=HARNESS,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if out.returncode != 0:
        raise SystemExit(f"{script} {args} failed:\n{out.stderr[-3000:]}")
    lines = [line for line in out.stdout.splitlines() if line.startswith('{"bench"')]
    if not lines:
        raise SystemExit(f"{script} {args} printed no result:\n{out.stdout[-2000:]}")
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--items", type=int, default=10_000)
    parser.add_argument("--items-large", type=int, default=100_000)
    parser.add_argument("--single", type=int, default=5_000)
    parser.add_argument("--many", type=int, default=10_000)
    parser.add_argument("--latency-items", type=int, default=200)
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--backlog", type=int, default=20_000, help="W6")
    parser.add_argument("--urgent", type=int, default=40, help="W6")
    parser.add_argument("--urgent-rate", type=float, default=10.0, help="W6")
    parser.add_argument("--job-ms", type=float, default=10.0, help="W6")
    parser.add_argument("--startup-runs", type=int, default=5)
    parser.add_argument("--only", action="append")
    parser.add_argument(
        "--modes",
        default="w1,w2,w3",
        help=f"comma-separated, of {','.join(MODES)}; each peer runs those its harness has",
    )
    parser.add_argument(
        "--mysql",
        action="store_true",
        help="on MariaDB (the peers that support it), not PostgreSQL",
    )
    args = parser.parse_args()
    modes = args.modes.split(",")
    if set(modes) - set(MODES):
        parser.error(f"--modes: of {', '.join(MODES)}")
    plan = {
        "w1": ["w1", str(args.items)],
        "w2": ["w2", str(args.single), str(args.many)],
        "w3": ["w3", str(args.latency_items), str(args.rate)],
        "w1_large": ["w1", str(args.items_large)],
        "w6": ["w6", str(args.backlog), str(args.urgent), str(args.urgent_rate), str(args.job_ms)],
        "startup": ["startup", str(args.startup_runs)],
    }
    if args.mysql:
        if args.only and set(args.only) - set(MYSQL_PEERS):
            parser.error(f"on MySQL only: {', '.join(MYSQL_PEERS)}")
        url, started = start_mariadb()
    else:
        url, started = start_postgres(), False
    try:
        for name, (packages, script) in PEERS.items():
            if args.only and name not in args.only:
                continue
            if args.mysql:
                if name not in MYSQL_PEERS:
                    continue
                packages = [*packages, *MYSQL_PEERS[name]]
            has = ("w1", "w2", "w3", *EXTRA_MODES.get(name, ()))
            python = venv_python(name, packages)
            results = {
                mode: run(python, script, fresh_database(url, name), *plan[mode])
                for mode in modes
                if mode in has
            }
            print(
                json.dumps(
                    {
                        "bench": "peer",
                        "peer": name,
                        "packages": packages,
                        "database": "mariadb" if args.mysql else "postgresql",
                        **results,
                        "machine": machine(),
                    }
                ),
                flush=True,
            )
    finally:
        if args.mysql:
            if started and not os.environ.get("BENCH_KEEP_PG"):
                stop_mariadb()
        else:
            stop_postgres()


if __name__ == "__main__":
    main()
