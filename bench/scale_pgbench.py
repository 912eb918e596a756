"""Scale: this machine's pgbench figure, the yardstick for projecting to a larger server.

    .venv/bin/python bench/scale_pgbench.py [--scale 50] [--clients 16] [--seconds 30]

Runs PostgreSQL's own ``pgbench`` (the built-in TPC-B-like script:
BEGIN, three UPDATEs, a SELECT, an INSERT, END; ``-M prepared``) against
a durable cluster of its own (``.tmp/pg-scale-pgbench.json``, as the
other ``scale_*.py`` scripts) and reports its TPS and what each of its
transactions cost the server (CPU, commits, statements), measured the way
``scale_processes.py`` measures a job. Published pgbench figures for
larger servers then translate into jobs/s: see ``docs/scale.md``.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys

from common import machine
from scale_common import (
    cluster_info,
    commit_hash,
    snapshot,
    start_cluster,
    stop_cluster,
    use_state,
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scale", type=int, default=50)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=int, default=30)
    args = parser.parse_args()
    use_state("pgbench")
    try:
        url = start_cluster()
        info = cluster_info()
        pgbench = f"{info['bindir']}/pgbench"
        conn = ["-h", "127.0.0.1", "-p", str(info["port"]), "-U", "postgres", "postgres"]
        subprocess.run([pgbench, "-i", "-q", "-s", str(args.scale), *conn], check=True)
        before = snapshot(url)
        out = subprocess.run(
            [
                pgbench,
                "-c",
                str(args.clients),
                "-j",
                "2",
                "-T",
                str(args.seconds),
                "-M",
                "prepared",
                *conn,
            ],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        delta = snapshot(url).delta(before)
        match = re.search(r"tps = ([\d.]+) \(without initial", out)
        tps = float(match.group(1)) if match else float("nan")
        xacts = delta["xact_commit"]
        result = {
            "scale": args.scale,
            "clients": args.clients,
            "seconds": args.seconds,
            "tps": tps,
            "server_cpu_share": delta["server_cpu_seconds"] / delta["seconds"],
            "server_cpu_ms_per_transaction": delta["server_cpu_seconds"] * 1000 / xacts,
            "statements_per_transaction": delta["statements"] / xacts,
            "wal_bytes_per_transaction": delta["wal_bytes"] / xacts,
            "commit": commit_hash(),
            "argv": sys.argv,
            "machine": machine(),
        }
        print(json.dumps({"bench": "scale_pgbench", **result}), flush=True)
        print(out, file=sys.stderr)
    finally:
        stop_cluster()


if __name__ == "__main__":
    main()
