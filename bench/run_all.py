"""Run every benchmark N times side by side; write the medians table.

    .venv/bin/python bench/run_all.py [--runs 3] [--out docs/benchmarks-results.md]

One durable PostgreSQL cluster serves every run (ours, the raw ceiling and
the peers), so ratios compare like with like. Raw JSON lines go to
bench/results/results.jsonl; the Markdown table goes to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import ROOT, machine, start_postgres, stop_postgres

BENCH = Path(__file__).resolve().parent
#: W1 is also run at these --concurrency values (8, the default, is w1_p1).
CONCURRENCIES = (1, 2, 32)
RESULTS = BENCH / "results"


def run(script: str, *args: str) -> list[dict]:
    env = dict(os.environ, BENCH_KEEP_PG="1")
    out = subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if out.returncode != 0:
        raise SystemExit(f"{script} {args} failed:\n{out.stderr[-3000:]}")
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def med(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def fmt(values: list[float], digits: int = 0) -> str:
    m, lo, hi = med(values)
    return f"{m:,.{digits}f} ({lo:,.{digits}f}-{hi:,.{digits}f})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--items", type=int, default=10_000)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks-results.md")
    parser.add_argument("--skip-peers", action="store_true")
    args = parser.parse_args()
    RESULTS.mkdir(exist_ok=True)
    start_postgres()
    rows: dict[str, list[dict]] = {}
    started = time.time()
    try:
        for n in range(args.runs):
            print(f"run {n + 1}/{args.runs}", file=sys.stderr, flush=True)
            plan = [
                ("raw", "raw_ceiling.py", ["--items", str(args.items)]),
                ("w1_p1", "w1_throughput.py", ["--items", str(args.items)]),
                *[
                    (
                        f"w1_p1_c{c}",
                        "w1_throughput.py",
                        ["--items", str(args.items), "--concurrency", str(c)],
                    )
                    for c in CONCURRENCIES
                ],
                ("w1_p2", "w1_throughput.py", ["--items", str(args.items), "--processes", "2"]),
                ("w2", "w2_enqueue.py", []),
                ("w3", "w3_latency.py", []),
                ("w4", "w4_big_table.py", ["--items", str(args.items)]),
                ("w5", "w5_memory.py", []),
            ]
            if not args.skip_peers:
                plan.append(("peers", "peers.py", ["--items", str(args.items)]))
            for key, script, extra in plan:
                print(f"  {key}", file=sys.stderr, flush=True)
                for result in run(script, *extra):
                    name = f"peer:{result['peer']}" if result.get("bench") == "peer" else key
                    rows.setdefault(name, []).append(result)
                    with open(RESULTS / "results.jsonl", "a") as fh:
                        fh.write(json.dumps(result) + "\n")
    finally:
        os.environ.pop("BENCH_KEEP_PG", None)
        stop_postgres()
    args.out.write_text(render(rows, args.runs, time.time() - started))
    print(args.out.read_text())


def col(rows: dict[str, list[dict]], key: str, field: str) -> list[float]:
    return [float(r[field]) for r in rows.get(key, [])]


def render(rows: dict[str, list[dict]], runs: int, seconds: float) -> str:
    m = machine()
    raw1 = col(rows, "raw", "claim_complete_batch1_per_second")
    raw100 = col(rows, "raw", "claim_complete_batch100_per_second")
    raw_insert = col(rows, "raw", "single_insert_per_second")
    w1 = col(rows, "w1_p1", "items_per_second_active")
    w1_wall = col(rows, "w1_p1", "items_per_second_wall")
    w1c = col(rows, "w1_p1_c32", "items_per_second_active")
    w1_commits = col(rows, "w1_p1", "commits_per_item")
    w1p2 = col(rows, "w1_p2", "items_per_second_active")
    w2s = col(rows, "w2", "single_per_second")
    w2m = col(rows, "w2", "many_per_second")
    w3p50 = col(rows, "w3", "p50_ms")
    w3p99 = col(rows, "w3", "p99_ms")
    w4 = col(rows, "w4", "ratio")
    w5 = col(rows, "w5", "growth")
    w5s = col(rows, "w5", "rss_start_mib")
    w5e = col(rows, "w5", "rss_end_mib")
    ceiling = statistics.median(raw100) if raw100 else float("nan")
    lines = [
        f"Machine: {m['cpus']} cores, {m['platform']}, Python {m['python']}, "
        f"PostgreSQL 15 (durable commits: fsync on, synchronous_commit on). "
        f"Date: {m['date']}. {runs} runs, {seconds / 60:.0f} minutes in all; "
        "median (min-max).",
        "",
        "| measure | django-dbworker | raw ceiling | ratio |",
        "|---|---|---|---|",
        f"| W1 jobs/s, 1 process, CONCURRENCY 8 (active) | {fmt(w1)} | batch 100: "
        f"{fmt(raw100)}; batch 1: {fmt(raw1)} | "
        f"{statistics.median(w1) / ceiling:.0%} of batch 100 |",
        f"| W1 jobs/s, same, wall clock incl. start-up | {fmt(w1_wall)} | | |",
        f"| W1 commits per job (pg_stat_database) | {fmt(w1_commits, 3)} | | |",
        f"| W1 jobs/s, 1 process, --concurrency 32 | {fmt(w1c)} | | "
        f"{statistics.median(w1c) / ceiling:.0%} of batch 100 |",
        f"| W1 jobs/s, 2 processes, CONCURRENCY 8 | {fmt(w1p2)} | | "
        f"{statistics.median(w1p2) / ceiling:.0%} of batch 100 |",
        f"| W2 single enqueue()/s | {fmt(w2s)} | single INSERT+commit: {fmt(raw_insert)} | "
        f"{statistics.median(w2s) / statistics.median(raw_insert):.0%} |",
        f"| W2 enqueue_many rows/s | {fmt(w2m)} | | |",
        f"| W3 wake-up latency p50 / p99 ms | {fmt(w3p50, 2)} / {fmt(w3p99, 2)} | | |",
        f"| W4 W1 with 1,000,000 finished rows, ratio to empty table | {fmt(w4, 2)} | | |",
        f"| W5 RSS over 100,000 items: start / end MiB, growth | {fmt(w5s, 1)} / {fmt(w5e, 1)},"
        f" {fmt([g * 100 for g in w5], 1)} % | | |",
        "",
        f"The machine's commit rate in this run: the raw claim/complete loop, one row per "
        f"transaction (two commits per row), did {fmt(raw1)} rows/s.",
        "",
        "| W1, 1 process, --concurrency | jobs/s | ratio to raw batch 1 | ratio to raw batch 100 |",
        "|---|---|---|---|",
    ]
    for c in sorted((*CONCURRENCIES, 8)):
        values = col(rows, "w1_p1" if c == 8 else f"w1_p1_c{c}", "items_per_second_active")
        if values:
            m = statistics.median(values)
            lines.append(
                f"| {c} | {fmt(values)} | {m / statistics.median(raw1):.1f}x | {m / ceiling:.0%} |"
            )
    lines.append("")
    peers = sorted(k for k in rows if k.startswith("peer:"))
    if peers:
        lines += [
            "| peer (same machine, same run) | W1 jobs/s | W2 single enqueue/s | "
            "W2 batch rows/s | W3 p50 / p99 ms | dbworker W1 ratio |",
            "|---|---|---|---|---|---|",
        ]
        for key in peers:
            r = rows[key]
            pw1 = [float(x["w1"]["items_per_second"]) for x in r]
            pw2 = [float(x["w2"]["single_per_second"]) for x in r]
            pwm = [float(x["w2"]["many_per_second"]) for x in r if x["w2"]["many_per_second"]]
            p50 = [float(x["w3"]["p50_ms"]) for x in r]
            p99 = [float(x["w3"]["p99_ms"]) for x in r]
            lines.append(
                f"| {key[5:]} ({r[0]['packages'][0]}) | {fmt(pw1)} | {fmt(pw2)} | "
                f"{fmt(pwm) if pwm else 'n/a'} | {fmt(p50, 2)} / {fmt(p99, 2)} | "
                f"{statistics.median(w1) / statistics.median(pw1):.1f}x |"
            )
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
