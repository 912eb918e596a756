"""The peers through W1, W2 and W3, each in its own virtual environment.

    .venv/bin/python bench/peers.py [--items 10000] [--only pgqueuer]

Installs each peer from PyPI into bench/.peers/NAME (once), gives it a
fresh database in the same durable PostgreSQL cluster as our benchmarks,
and runs its harness (bench/peer_harness/NAME_bench.py) with the same sizes and
the same concurrency (8) as ours. Prints one JSON line per result.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from common import machine, start_postgres, stop_postgres

BENCH = Path(__file__).resolve().parent
VENVS = BENCH / ".peers"
HARNESS = BENCH / "peer_harness"

PEERS = {
    "pgqueuer": (["pgqueuer==1.6.0", "psycopg[binary]>=3.2"], "pgqueuer_bench.py"),
    "procrastinate": (["procrastinate==3.10.0", "psycopg[binary]>=3.2"], "procrastinate_bench.py"),
    "django-tasks-db": (
        ["django-tasks-db==0.13.0", "django-tasks", "Django>=5.2,<6", "psycopg[binary]>=3.2"],
        "djtasks_bench.py",
    ),
}


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
    import psycopg

    db = "peer_" + name.replace("-", "_")
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{db}"')
    return url.rsplit("/", 1)[0] + "/" + db


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
    parser.add_argument("--single", type=int, default=5_000)
    parser.add_argument("--many", type=int, default=10_000)
    parser.add_argument("--latency-items", type=int, default=200)
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--only", action="append")
    args = parser.parse_args()
    url = start_postgres()
    try:
        for name, (packages, script) in PEERS.items():
            if args.only and name not in args.only:
                continue
            python = venv_python(name, packages)
            results = {
                "w1": run(python, script, fresh_database(url, name), "w1", str(args.items)),
                "w2": run(
                    python,
                    script,
                    fresh_database(url, name),
                    "w2",
                    str(args.single),
                    str(args.many),
                ),
                "w3": run(
                    python,
                    script,
                    fresh_database(url, name),
                    "w3",
                    str(args.latency_items),
                    str(args.rate),
                ),
            }
            print(
                json.dumps(
                    {
                        "bench": "peer",
                        "peer": name,
                        "packages": packages,
                        **results,
                        "machine": machine(),
                    }
                ),
                flush=True,
            )
    finally:
        stop_postgres()


if __name__ == "__main__":
    main()
