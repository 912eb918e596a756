"""The ceiling: the same work as django-dbworker, as a bare psycopg loop.

    .venv/bin/python bench/raw_ceiling.py [--items 10000]

On the same table with the same indexes: claim ``batch`` ready rows with
one UPDATE ... FOR UPDATE SKIP LOCKED ... RETURNING, mark them succeeded with
one UPDATE, each its own commit (batch 1 and batch 100); and a loop of
single-row INSERTs, each its own commit (the enqueue ceiling). No framework,
no threads, no handler: what PostgreSQL itself allows on this machine.

On a mysql:// DATABASE_URL only the INSERT + commit loop runs (MySQLdb,
autocommit): the claim/complete statements above are PostgreSQL's.
"""

from __future__ import annotations

import argparse
import time

import psycopg
from common import report, reset_table, setup_django, start_postgres, stop_postgres

TABLE = "django_dbworker_workitem"
CLAIM = f"""
UPDATE {TABLE} AS w SET status = 'claimed', attempts = w.attempts + 1,
    claimed_at = statement_timestamp(), heartbeat_at = statement_timestamp(),
    updated_at = statement_timestamp(), claimed_by = 'raw', claim_token = gen_random_uuid()
FROM (SELECT id FROM {TABLE} WHERE status = 'pending' AND run_after <= statement_timestamp()
      ORDER BY priority DESC, run_after, id LIMIT %s FOR UPDATE SKIP LOCKED) AS c
WHERE w.id = c.id RETURNING w.id, w.claim_token
"""
COMPLETE = f"""
UPDATE {TABLE} SET status = 'succeeded', finished_at = statement_timestamp(),
    updated_at = statement_timestamp()
WHERE id = ANY(%s) AND claim_token = ANY(%s) AND status = 'claimed'
"""
INSERT = f"""
INSERT INTO {TABLE} (handler, queue, payload, status, priority, run_after, attempts,
    max_attempts, claimed_by, last_error, trace_context, created_at, updated_at)
VALUES ('bench_noop', 'default', 'null', 'pending', 0, statement_timestamp(), 0, 3, '', '',
    '{{}}', statement_timestamp(), statement_timestamp())
"""

MYSQL_INSERT = f"""
INSERT INTO {TABLE} (handler, queue, payload, status, priority, run_after, attempts,
    max_attempts, claimed_by, last_error, trace_context, created_at, updated_at)
VALUES ('bench_noop', 'default', 'null', 'pending', 0, CURRENT_TIMESTAMP(6), 0, 3, '', '',
    '{{}}', CURRENT_TIMESTAMP(6), CURRENT_TIMESTAMP(6))
"""


def fill(items: int) -> None:
    from bench.benchapp.workers import BenchNoop

    reset_table()
    for start in range(0, items, 5000):
        BenchNoop.enqueue_many([None] * min(5000, items - start))


def claim_complete(conn: psycopg.Connection, batch: int) -> int:
    done = 0
    while True:
        rows = conn.execute(CLAIM, (batch,)).fetchall()
        if not rows:
            return done
        conn.execute(COMPLETE, ([r[0] for r in rows], [r[1] for r in rows]))
        done += len(rows)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--items", type=int, default=10_000)
    parser.add_argument("--inserts", type=int, default=5_000)
    args = parser.parse_args()
    url = start_postgres()
    try:
        setup_django(url)
        if url.startswith(("mysql://", "mariadb://")):
            report("raw_ceiling", mysql_inserts(args.inserts))
            return
        result: dict[str, object] = {"items": args.items}
        with psycopg.connect(url, autocommit=True) as conn:
            for batch in (1, 100):
                fill(args.items)
                started = time.perf_counter()
                done = claim_complete(conn, batch)
                elapsed = time.perf_counter() - started
                assert done == args.items, done
                result[f"claim_complete_batch{batch}_per_second"] = done / elapsed
            reset_table()
            started = time.perf_counter()
            for _ in range(args.inserts):
                conn.execute(INSERT)
            result["single_insert_per_second"] = args.inserts / (time.perf_counter() - started)
        report("raw_ceiling", result)
    finally:
        stop_postgres()


def mysql_inserts(inserts: int) -> dict[str, object]:
    """Single-row INSERT + commit on Django's own MySQL connection (autocommit)."""
    from django.db import connection

    reset_table()
    with connection.cursor() as cursor:
        started = time.perf_counter()
        for _ in range(inserts):
            cursor.execute(MYSQL_INSERT)
        elapsed = time.perf_counter() - started
    reset_table()
    return {"inserts": inserts, "single_insert_per_second": inserts / elapsed}


if __name__ == "__main__":
    main()
