"""Before and after in one run: a benchmark script from two source trees, alternated.

    .venv/bin/python bench/ab.py --base /path/to/old/checkout [--runs 5]
        [--bench "w1_throughput.py --items 10000" --bench "w3_latency.py"]
        [--out docs/internals/benchmarks-ab.md]

"Within noise of today's medians" is a claim about two commits, and two
commits measured hours apart on a shared 2-core machine differ by more
than most changes do. So each benchmark runs from ``--base`` and from
this tree in turn (base, this, base, this, ...) against one durable
PostgreSQL cluster, and the table reports both medians (min-max) and their
ratio. Every run uses this tree's virtual environment; the trees differ
only in their ``django_dbworker`` and ``bench``, imported from the tree
that runs (the scripts put their own checkout first on ``sys.path``).
The base must have the same migrations or fewer: columns it does not
know are NULL or have database defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

from common import ROOT, machine, start_postgres, stop_postgres

#: The figures each benchmark reports that the table compares.
FIGURES = {
    "w1_throughput": (
        "items_per_second_whole",
        "items_per_second_active",
        "worker_cpu_us_per_item",
        "database_cpu_us_per_item",
    ),
    "w3_latency": ("p50_ms", "p99_ms"),
    "w2_enqueue": (
        "single_per_second",
        "single_client_cpu_us",
        "single_database_cpu_us",
        "many_per_second",
    ),
    "startup": ("first_job_s_median", "burst_one_s_median"),
    "raw_ceiling": ("claim_complete_batch100_per_second", "single_insert_per_second"),
    "w6_priority": ("p50_ms", "p99_ms", "to_claim_p50_ms", "claim_to_start_p50_ms"),
    "w7_keys": (
        "keyed_items_per_second_active",
        "plain_items_per_second_active",
        "keyed_share_active",
        "slot_held_p50_ms",
        "slot_free_p50_ms",
    ),
}


def run(tree: Path, script: list[str], url: str) -> dict:
    env = dict(os.environ, DATABASE_URL=url, BENCH_KEEP_PG="1")
    out = subprocess.run(
        [sys.executable, str(tree / "bench" / script[0]), *script[1:]],
        env=env,
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=3600,
        check=False,
    )
    if out.returncode != 0:
        raise SystemExit(f"{tree}: {script} failed:\n{out.stderr[-3000:]}")
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return lines[-1]


def fmt(values: list[float]) -> str:
    return f"{statistics.median(values):,.2f} ({min(values):,.2f}-{max(values):,.2f})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", type=Path, required=True)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--bench", action="append", default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    benches = args.bench or ["w1_throughput.py --items 10000", "w3_latency.py"]
    url = start_postgres()
    trees = {"base": args.base.resolve(), "this": ROOT}
    rows = []
    try:
        for spec in benches:
            script = shlex.split(spec)
            name = Path(script[0]).stem
            got: dict[str, list[dict]] = {"base": [], "this": []}
            for _ in range(args.runs):
                for label, tree in trees.items():
                    got[label].append(run(tree, script, url))
            for figure in FIGURES.get(name, ()):
                base = [r[figure] for r in got["base"] if r.get(figure) is not None]
                this = [r[figure] for r in got["this"] if r.get(figure) is not None]
                if not base or not this:
                    continue  # not measured in this setting (W7's free time with a key per item)
                before = statistics.median(base)
                # A figure at 0 in the base (W7's free time, now that a slot is handed on).
                ratio = f"{statistics.median(this) / before:.2f}" if before else "-"
                rows.append((spec, figure, fmt(base), fmt(this), ratio))
    finally:
        stop_postgres()
    head = git_head(ROOT)
    lines = [
        f"Base: `{git_head(args.base)}`; this: `{head}`; {args.runs} runs each, alternated.",
        f"Machine: {machine()}",
        "",
        "| benchmark | figure | base median (min-max) | this median (min-max) | this/base |",
        "|---|---|---|---|---|",
        *(f"| `{s}` | {f} | {b} | {t} | {r} |" for s, f, b, t, r in rows),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


def git_head(tree: Path) -> str:
    out = subprocess.run(
        ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    )
    return out.stdout.strip() or "?"


if __name__ == "__main__":
    main()
