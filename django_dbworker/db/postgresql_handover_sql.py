"""PostgreSQL's success write that hands freed key slots over (``handover.py`` says why).

One statement, so one round trip and one commit, as the plain success write:

- ``l`` and ``done``: ``SUCCEED_MANY``'s lock in id order and its fenced UPDATE;
- ``freed``: per key of a limited handler, how many of its claimed rows ``done`` ended;
- ``room``: as many as still fit the handler's current limit. The count reads the
  statement's snapshot, where ``done``'s rows are still claimed (a CTE's writes are not
  visible to the rest of its statement): the key's other holders are that count minus
  the freed ones;
- ``nxt``: per key, its next ready rows (the claim's readiness: pending, due, a queue not
  paused, the worker's queues), locked with SKIP LOCKED; at most ``budget`` in claim order;
- ``taken``: the claim of those rows (the claim's SET and columns).

The answer is ``done``'s rows (``handed`` false: id, token, has_dependents) and then
``taken``'s (``handed`` true, the claim's columns).

Text only, like ``postgresql_sql.py``.
"""

from __future__ import annotations

from django_dbworker.db.postgresql_sql import (
    CLAIM_SET,
    CLAIMED_COLUMNS,
    LOCKED_IN_ID_ORDER,
    SUCCEED_UPDATE,
)
from django_dbworker.db.sql import Statement

_NEXT = """
), freed AS (
    SELECT d.handler, d.concurrency_key, count(*) AS n, min(lim.value) AS lim
    FROM done AS d
    JOIN unnest(%(limited)s::text[], %(limit_values)s::integer[]) AS lim(handler, value)
      ON lim.handler = d.handler
    WHERE d.concurrency_key IS NOT NULL
    GROUP BY d.handler, d.concurrency_key
), room AS (
    SELECT f.handler, f.concurrency_key,
           least(f.n, f.lim + f.n - (
               SELECT count(*) FROM django_dbworker_workitem AS h
               WHERE h.status = 'claimed'
                 AND h.handler = f.handler
                 AND h.concurrency_key = f.concurrency_key)) AS n
    FROM freed AS f
), nxt AS (
    SELECT q.id
    FROM room AS r
    CROSS JOIN LATERAL (
        SELECT p.id, p.priority, p.run_after
        FROM django_dbworker_workitem AS p
        WHERE p.status = 'pending'
          AND p.run_after <= statement_timestamp()
          AND p.handler = r.handler
          AND p.concurrency_key = r.concurrency_key
          AND p.queue NOT IN (SELECT name FROM django_dbworker_queuestate WHERE paused)
          AND (%(any_queue)s OR p.queue = ANY(%(queues)s::text[]))
        ORDER BY p.priority DESC, p.run_after, p.id
        LIMIT greatest(r.n, 0)
        FOR UPDATE OF p SKIP LOCKED
    ) AS q
    ORDER BY q.priority DESC, q.run_after, q.id
    LIMIT %(budget)s
), taken AS (
    UPDATE django_dbworker_workitem AS w
"""

_ANSWER = """), answer AS (
    SELECT false AS handed, d.id, NULL::text AS handler, NULL::text AS queue,
           NULL::jsonb AS payload, NULL::integer AS priority, NULL::timestamptz AS run_after,
           NULL::integer AS attempts, NULL::integer AS max_attempts, NULL::text AS claimed_by,
           d.claim_token, NULL::jsonb AS trace_context, NULL::bigint AS batch_id,
           d.has_dependents
    FROM done AS d
    UNION ALL
    SELECT true, t.* FROM taken AS t
)
SELECT * FROM answer
"""

SUCCEED_HANDING_OVER = Statement(
    "succeed_handing_over",
    "Record successes and claim, per key they free, its next ready rows for the same worker.",
    LOCKED_IN_ID_ORDER
    + ", done AS (\n"
    + SUCCEED_UPDATE
    + "RETURNING w.id, w.claim_token, w.has_dependents, w.handler, w.concurrency_key\n"
    + _NEXT
    + CLAIM_SET
    + "FROM nxt\nWHERE w.id = nxt.id\n  AND w.status = 'pending'\n"
    + CLAIMED_COLUMNS
    + _ANSWER,
)
