"""Every benchmark script, run at tiny sizes so that none of them can rot.

Speed is not asserted here (benchmarks are not tests): only that each
script runs to completion and prints its JSON result line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.db import connection

ROOT = Path(__file__).resolve().parent.parent.parent
BENCH = ROOT / "bench"

pytestmark = [pytest.mark.postgres_only, pytest.mark.django_db]

SCRIPTS = [
    ("raw_ceiling.py", ["--items", "200", "--inserts", "50"], "raw_ceiling"),
    ("w1_throughput.py", ["--items", "300"], "w1_throughput"),
    ("w1_throughput.py", ["--items", "300", "--processes", "2"], "w1_throughput"),
    ("w2_enqueue.py", ["--single", "30", "--many", "100"], "w2_enqueue"),
    (
        "w10_notify.py",
        ["--threads", "2", "--seconds", "0.2", "--rounds", "1"],
        "w10_notify",
    ),
    ("w3_latency.py", ["--items", "5", "--rate", "50"], "w3_latency"),
    (
        "w6_priority.py",
        ["--backlog", "600", "--job-ms", "1", "--urgent", "3", "--rate", "50"],
        "w6_priority",
    ),
    ("w7_keys.py", ["--items", "300", "--keys", "30"], "w7_keys"),
    ("w7_keys.py", ["--items", "60", "--keys", "60"], "w7_keys"),  # no chain: no free time
    ("w7_keys.py", ["--items", "300", "--keys", "30", "--job-ms", "2"], "w7_keys"),  # real jobs
    ("w1_throughput.py", ["--items", "300", "--also", "bench_keyed"], "w1_throughput"),
    ("claim_cost.py", ["--rounds", "2", "--claim", "20", "--keys", "5"], "claim_cost"),
    ("startup.py", ["--runs", "1"], "startup"),
    ("w8_rate.py", ["--rate", "30", "--seconds", "1"], "w8_rate"),
    ("w9_batches.py", ["--items", "300", "--runs", "1", "--links", "5"], "w9_batches"),
    (
        "w11_async.py",
        ["--items", "50", "--sync-items", "8", "--noop-items", "50", "--latency-items", "3"],
        "w11_async_sleep",
    ),
    (
        "w12_fair.py",
        ["--flood", "300", "--job-ms", "0", "--seconds", "1", "--items", "200", "--keys", "4"],
        "w12_fair",
    ),
    ("w4_big_table.py", ["--finished", "3000", "--items", "300"], "w4_big_table"),
    ("w5_memory.py", ["--items", "4000"], "w5_memory"),
    ("tracing_overhead.py", ["--iterations", "2000"], "tracing_overhead"),
    (
        "tasks_compare.py",
        ["--items", "200", "--latency-items", "5", "--rate", "50", "--skip-peer", "--save", ""],
        "tasks_compare",
    ),
]


def bench_env() -> dict[str, str]:
    """The benchmarks use the cluster's ``postgres`` database, not the test database."""
    settings = connection.settings_dict
    url = f"postgres://{settings['USER']}@{settings['HOST']}:{settings['PORT']}/postgres"
    env = dict(os.environ, DATABASE_URL=url)
    env.pop("DJANGO_SETTINGS_MODULE", None)
    return env


@pytest.mark.parametrize(("script", "args", "name"), SCRIPTS)
def test_bench_script_runs(script: str, args: list[str], name: str) -> None:
    out = subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        cwd=ROOT,
        env=bench_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.splitlines()[0])
    assert result["bench"] == name
    if name == "w7_keys":  # the legs' CPU figures (Linux), and the job length as asked
        assert result["job_ms"] == (2.0 if "--job-ms" in args else 0.0)
        assert result["key_overlaps"] == 0
        for leg in ("keyed", "plain"):
            assert 0 < result[f"{leg}_cpu_busy"] <= 1
            assert result[f"{leg}_cpu_us_per_item"] > 0


def test_peers_script_runs_pgqueuer() -> None:
    """Installs pgqueuer into bench/.peers from PyPI (once) and runs it tiny."""
    out = subprocess.run(
        [
            sys.executable,
            str(BENCH / "peers.py"),
            "--only",
            "pgqueuer",
            "--items",
            "200",
            "--single",
            "20",
            "--many",
            "50",
            "--latency-items",
            "5",
            "--rate",
            "50",
        ],
        cwd=ROOT,
        env=bench_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["peer"] == "pgqueuer"
    assert {"w1", "w2", "w3"} <= set(result)


def test_ab_script_compares_two_trees(tmp_path: Path) -> None:
    """bench/ab.py with this checkout as its own base: one table row per figure."""
    out_file = tmp_path / "ab.md"
    out = subprocess.run(
        [
            sys.executable,
            str(BENCH / "ab.py"),
            "--base",
            str(ROOT),
            "--runs",
            "1",
            "--bench",
            "w1_throughput.py --items 200",
            "--out",
            str(out_file),
        ],
        cwd=ROOT,
        env=bench_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    table = out_file.read_text()
    assert "| `w1_throughput.py --items 200` | items_per_second_whole |" in table
    assert "| `w1_throughput.py --items 200` | items_per_second_active |" in table
    # The CPU per item, the figure that holds on a shared machine.
    assert "| `w1_throughput.py --items 200` | worker_cpu_us_per_item |" in table
    assert "| `w1_throughput.py --items 200` | database_cpu_us_per_item |" in table


#: The scale scripts start a durable cluster of their own, with
#: pg_stat_statements loaded (a restart the test cluster must not take).
SCALE_SCRIPTS = [
    (
        "scale_processes.py",
        ["--items", "300", "--processes", "1,2", "--stream-rate", "50", "--stream-seconds", "1"],
        "scale_processes",
    ),
    ("scale_idle.py", ["--workers", "2", "--window", "1", "--settle", "0"], "scale_idle"),
    (
        "scale_history.py",
        ["--finished", "3000", "--items", "300", "--stream-seconds", "1", "--rate", "20"],
        "scale_history",
    ),
    ("scale_pgbench.py", ["--scale", "1", "--clients", "2", "--seconds", "1"], "scale_pgbench"),
]


@pytest.mark.parametrize(("script", "args", "name"), SCALE_SCRIPTS)
def test_scale_script_runs(script: str, args: list[str], name: str, tmp_path: Path) -> None:
    env = bench_env()
    env.pop("DATABASE_URL")
    env["BENCH_SCALE_STATE"] = str(tmp_path / "pg.json")
    out = subprocess.run(
        [sys.executable, str(BENCH / script), "--no-raw", *args]
        if script == "scale_processes.py"
        else [sys.executable, str(BENCH / script), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    names = [json.loads(line)["bench"] for line in out.stdout.splitlines() if line.startswith("{")]
    assert name in names
    assert not (tmp_path / "pg.json").exists()  # the cluster was stopped
