"""Fill the work table with N realistic rows in one SQL statement (PostgreSQL).

Used by the W4 benchmark and the admin's big-table tests (bench/ stands on
its own: tests may borrow from it, never the reverse): mostly succeeded
rows, some failed with tracebacks, a few pending, claimed and cancelled,
across several queues and handlers.
"""

from __future__ import annotations

from django.db import connection

FILL_SQL = """
INSERT INTO django_dbworker_workitem (
    handler, queue, payload, status, priority, run_after, attempts, max_attempts,
    claimed_at, heartbeat_at, claimed_by, claim_token, finished_at, last_error, result,
    unique_key, trace_context, created_at, updated_at)
SELECT
    (ARRAY['noop','echo','record','urgent'])[1 + g %% 4],
    (ARRAY['default','echoes','urgent','emails','images'])[1 + g %% 5],
    jsonb_build_object('n', g, 'text', repeat('x', 200)),
    CASE WHEN g %% 100 < 94 THEN 'succeeded'
         WHEN g %% 100 < 97 THEN 'failed'
         WHEN g %% 100 < 99 THEN 'pending'
         WHEN g %% 1000 = 999 THEN 'claimed'
         ELSE 'cancelled' END,
    (g %% 7) - 3,
    now() - make_interval(secs => %(n)s - g),
    1, 3,
    now() - make_interval(secs => %(n)s - g),
    now() - make_interval(secs => %(n)s - g),
    'bighost:' || (g %% 10) || ':MainThread',
    NULL,
    now() - make_interval(secs => %(n)s - g - 1),
    CASE WHEN g %% 100 BETWEEN 94 AND 96
         THEN 'ValueError: row ' || g || ' failed' || E'\n\n' || repeat('Traceback line ', 300)
         ELSE '' END,
    NULL, NULL, '{}'::jsonb,
    now() - make_interval(secs => %(n)s - g),
    now() - make_interval(secs => %(n)s - g)
FROM generate_series(1, %(n)s) AS g
"""


def fill(n: int) -> None:
    """Insert ``n`` rows and refresh the planner statistics."""
    with connection.cursor() as cursor:
        cursor.execute(FILL_SQL, {"n": n})
        cursor.execute("ANALYZE django_dbworker_workitem")
