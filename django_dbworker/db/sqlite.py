"""SQLite: its statements, and the operations that run them.

Claims are one conditional UPDATE ... RETURNING. SQLite has no row locks;
a single UPDATE statement takes the database write lock for its whole
duration, so "select the ready ids, mark them claimed" is atomic across
threads and processes. Busy waits are bounded by the connection's
``timeout`` option (see the system check). There are no cross-process
wake-ups (workers poll) and no planner statistics.

SQLite has no array parameters: a list of N values is N placeholders. Such
statements have a ``{slot}`` where the list goes, and ``numbered`` /
``numbered_rows`` write it out as named parameters ``%(handler_0)s, ...``;
the rest of the text is fixed.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Collection, Mapping, Sequence
from functools import lru_cache
from uuid import UUID

from django_dbworker.db.base import (
    Claimed,
    Statement,
    Turn,
    UnsupportedDatabase,
    VendorOperations,
    as_uuid,
    fair_filtered,
    numbered,
    numbered_params,
)
from django_dbworker.models import WorkItem

#: UPDATE ... RETURNING arrived in SQLite 3.35.
MIN_VERSION = (3, 35, 0)

# -- statements ---------------------------------------------------------------------
#
# The database clock is STRFTIME('%Y-%m-%d %H:%M:%f', 'NOW') (Django's Now()
# on SQLite); its % signs are doubled because the statements take parameters.
# Django stores UUIDField as 32 hex characters on SQLite, which is exactly
# what lower(hex(randomblob(16))) yields: a fresh claim token per row.
# The outer status test repeats the subquery's condition so that the
# statement stays a conditional UPDATE whatever the plan. Its WHERE and
# ORDER BY are WorkItem.objects.ready().in_order().
# Rows of a paused queue (a QueueState row with ``paused``) are not claimable.

CLAIM = Statement(
    "claim",
    "Claim the next ready rows of some handlers, in any queue.",
    """
UPDATE django_dbworker_workitem
SET status = 'claimed',
    attempts = attempts + 1,
    claimed_at = STRFTIME('%%Y-%%m-%%d %%H:%%M:%%f', 'NOW'),
    heartbeat_at = STRFTIME('%%Y-%%m-%%d %%H:%%M:%%f', 'NOW'),
    updated_at = STRFTIME('%%Y-%%m-%%d %%H:%%M:%%f', 'NOW'),
    claimed_by = %(worker)s,
    claim_token = lower(hex(randomblob(16)))
WHERE id IN (
    SELECT id FROM django_dbworker_workitem
    WHERE status = 'pending'
      AND run_after <= STRFTIME('%%Y-%%m-%%d %%H:%%M:%%f', 'NOW')
      AND handler IN ({handlers})
      AND queue NOT IN (SELECT name FROM django_dbworker_queuestate WHERE paused)
    ORDER BY priority DESC, run_after, id
    LIMIT %(limit)s
)
AND status = 'pending'
RETURNING id, handler, queue, payload, priority, run_after, attempts,
          max_attempts, claimed_by, claim_token, trace_context, batch_id, has_dependents,
          concurrency_key, fair_key
""",
)

CLAIM_IN_QUEUES = Statement(
    "claim_in_queues",
    "Claim the next ready rows of some handlers in some queues.",
    """
UPDATE django_dbworker_workitem
SET status = 'claimed',
    attempts = attempts + 1,
    claimed_at = STRFTIME('%%Y-%%m-%%d %%H:%%M:%%f', 'NOW'),
    heartbeat_at = STRFTIME('%%Y-%%m-%%d %%H:%%M:%%f', 'NOW'),
    updated_at = STRFTIME('%%Y-%%m-%%d %%H:%%M:%%f', 'NOW'),
    claimed_by = %(worker)s,
    claim_token = lower(hex(randomblob(16)))
WHERE id IN (
    SELECT id FROM django_dbworker_workitem
    WHERE status = 'pending'
      AND run_after <= STRFTIME('%%Y-%%m-%%d %%H:%%M:%%f', 'NOW')
      AND handler IN ({handlers})
      AND queue IN ({queues})
      AND queue NOT IN (SELECT name FROM django_dbworker_queuestate WHERE paused)
    ORDER BY priority DESC, run_after, id
    LIMIT %(limit)s
)
AND status = 'pending'
RETURNING id, handler, queue, payload, priority, run_after, attempts,
          max_attempts, claimed_by, claim_token, trace_context, batch_id, has_dependents,
          concurrency_key, fair_key
""",
)

# The keyed claim (per-key concurrency limits), for workers whose handlers
# declare a concurrency_limit; the others run the claims above, unchanged.
# SQLite runs one writing statement at a time (the database write lock is
# held for the whole UPDATE), so the counts read inside it are exact: no
# FlowLock is needed. The candidates skip rows whose key already holds its
# limit of claimed rows (the keys at their limit found once per statement,
# from the claimed keyed rows of dbworker_key_slots_idx, so rows behind a
# key at its limit are claimed); among the candidates, a
# key's rows are ranked in claim order and only those that fit the slots
# left are claimed, the rest stay pending untouched, and at most keyed_cap rows of limited
# keys are claimed (nth: the fitting ones, counted in claim order).
CLAIM_KEYED = Statement(
    "claim_keyed",
    "Claim the next ready rows of some handlers (any queue, or some) within their keys' limits.",
    """
UPDATE django_dbworker_workitem
SET status = 'claimed',
    attempts = attempts + 1,
    claimed_at = STRFTIME('%%Y-%%m-%%d %%H:%%M:%%f', 'NOW'),
    heartbeat_at = STRFTIME('%%Y-%%m-%%d %%H:%%M:%%f', 'NOW'),
    updated_at = STRFTIME('%%Y-%%m-%%d %%H:%%M:%%f', 'NOW'),
    claimed_by = %(worker)s,
    claim_token = lower(hex(randomblob(16)))
WHERE id IN (
    SELECT r.id FROM (
    SELECT q.*,
           sum(CASE WHEN q.concurrency_limit IS NOT NULL AND q.held + q.n <= q.concurrency_limit
                    THEN 1 ELSE 0 END)
           OVER (ORDER BY q.priority DESC, q.run_after, q.id ROWS UNBOUNDED PRECEDING) AS nth
    FROM (
        SELECT c.id, c.priority, c.run_after,
               CASE WHEN c.concurrency_key IS NOT NULL THEN CASE c.handler {limits} END END
               AS concurrency_limit,
               row_number() OVER (
                   PARTITION BY c.handler, c.concurrency_key
                   ORDER BY c.priority DESC, c.run_after, c.id) AS n,
               (SELECT count(*) FROM django_dbworker_workitem AS h
                WHERE h.status = 'claimed'
                  AND h.handler = c.handler
                  AND h.concurrency_key = c.concurrency_key) AS held
        FROM (
            SELECT id, handler, concurrency_key, concurrency_limit, priority, run_after
            FROM django_dbworker_workitem AS p
            WHERE status = 'pending'
              AND run_after <= STRFTIME('%%Y-%%m-%%d %%H:%%M:%%f', 'NOW')
              AND handler IN ({handlers}){queues}
              AND queue NOT IN (SELECT name FROM django_dbworker_queuestate WHERE paused)
              AND (concurrency_key IS NULL
                   OR handler NOT IN ({limited})
                   OR (handler, concurrency_key) NOT IN (
                       SELECT h.handler, h.concurrency_key FROM django_dbworker_workitem AS h
                       WHERE h.status = 'claimed'
                         AND h.concurrency_key IS NOT NULL
                         AND h.handler IN ({limited})
                       GROUP BY h.handler, h.concurrency_key
                       HAVING count(*) >= min(CASE h.handler {limits} END)))
            ORDER BY priority DESC, run_after, id
            LIMIT %(limit)s
        ) AS c
    ) AS q
    ) AS r
    WHERE r.concurrency_limit IS NULL
       OR (r.held + r.n <= r.concurrency_limit AND r.nth <= %(keyed_cap)s)
)
AND status = 'pending'
RETURNING id, handler, queue, payload, priority, run_after, attempts,
          max_attempts, claimed_by, claim_token, trace_context, batch_id, has_dependents,
          concurrency_key, fair_key
""",
)

# A worker of some queues leaves a limited key's row while the key's best ready row (in claim
# order) waits in a queue it does not serve and that is not paused: a key's slot goes to its
# best ready row, whichever worker serves it (a key split across queues of different workers
# starved one of them). A part of CLAIM_KEYED's candidates, for a worker
# of some queues ({served}: the better row is in another queue).
_BEST_OF_ITS_KEY = """
              AND (concurrency_key IS NULL OR handler NOT IN ({limited}) OR NOT EXISTS (
                  SELECT 1 FROM django_dbworker_workitem AS bq
                  WHERE bq.id = (
                      SELECT b.id FROM django_dbworker_workitem AS b
                      WHERE b.status = 'pending' AND b.concurrency_key = p.concurrency_key
                        AND b.handler = p.handler
                        AND b.run_after <= STRFTIME('%%Y-%%m-%%d %%H:%%M:%%f', 'NOW')
                        AND b.queue NOT IN (
                            SELECT name FROM django_dbworker_queuestate WHERE paused)
                      ORDER BY b.priority DESC, b.run_after, b.id
                      LIMIT 1)
                    AND bq.id <> p.id AND {served}))"""

# The separate "id IN (...)" pins the plan to primary-key lookups, whatever
# the planner thinks of the join with the VALUES rows.
SUCCEED_MANY = Statement(
    "succeed_many",
    "Record the successes of several attempts, each fenced by its own id, token and status.",
    """
WITH v(id, token, result) AS (VALUES {rows})
UPDATE django_dbworker_workitem
SET status = 'succeeded',
    result = v.result,
    finished_at = STRFTIME('%%Y-%%m-%%d %%H:%%M:%%f', 'NOW'),
    updated_at = STRFTIME('%%Y-%%m-%%d %%H:%%M:%%f', 'NOW'),
    last_error = ''
FROM v
WHERE django_dbworker_workitem.id IN ({ids})
  AND django_dbworker_workitem.id = v.id
  AND django_dbworker_workitem.claim_token = v.token
  AND django_dbworker_workitem.status = 'claimed'
RETURNING django_dbworker_workitem.id, django_dbworker_workitem.claim_token,
          django_dbworker_workitem.has_dependents
""",
)

# The heartbeat, and which of the attempts an operator asked to stop, in one
# statement (see postgresql_sql.HEARTBEAT). It returns cancel_requested_at
# itself: SQLite 3.40 answered "cancel_requested_at IS NOT NULL" with 1 for
# NULLs in RETURNING (seen on a table Django's migrations rebuilt).
HEARTBEAT = Statement(
    "heartbeat",
    "Refresh the heartbeats of the attempts still held; return them with their cancel requests.",
    """
UPDATE django_dbworker_workitem
SET heartbeat_at = STRFTIME('%%Y-%%m-%%d %%H:%%M:%%f', 'NOW')
WHERE id IN ({ids})
  AND claim_token IN ({tokens})
  AND status = 'claimed'
RETURNING id, claim_token, cancel_requested_at
""",
)

# SELECT DISTINCT queue reads every index entry; this recursive query jumps
# from one queue to the next through dbworker_queue_idx.
DISTINCT_QUEUES = Statement(
    "distinct_queues",
    "Every queue name in the table, by a loose index scan (one index probe per queue).",
    """
WITH RECURSIVE queues(name) AS (
    SELECT (SELECT queue FROM django_dbworker_workitem ORDER BY queue LIMIT 1)
    UNION ALL
    SELECT (SELECT queue FROM django_dbworker_workitem
            WHERE queue > queues.name ORDER BY queue LIMIT 1)
    FROM queues WHERE queues.name IS NOT NULL
)
SELECT name FROM queues WHERE name IS NOT NULL
""",
)


def numbered_rows(names: Sequence[str], count: int) -> str:
    """``(%(a_0)s, %(b_0)s), (%(a_1)s, %(b_1)s), ...``: ``count`` rows for a VALUES list."""
    return ", ".join(
        "(" + ", ".join(f"%({name}_{i})s" for name in names) + ")" for i in range(count)
    )


# Rendered once per list length: a worker claims with the same filters and
# similar batch sizes thousands of times a minute.
@lru_cache(maxsize=256)
def claim_sql(handlers: int, queues: int) -> str:
    """The claim statement for ``handlers`` handler names and ``queues`` queue names (0: any)."""
    if queues == 0:
        return CLAIM.render(handlers=numbered("handler", handlers))
    return CLAIM_IN_QUEUES.render(
        handlers=numbered("handler", handlers), queues=numbered("queue", queues)
    )


@lru_cache(maxsize=256)
def claim_keyed_sql(handlers: int, queues: int, limited: int) -> str:
    """The keyed claim for ``handlers`` and ``queues`` names (0: any queue).

    ``limited``: how many handlers declare a limit now (``limited_<i>`` -> ``limit_<i>``).
    """
    in_queues = ""
    if queues:
        names = numbered("queue", queues)
        in_queues = f"\n              AND queue IN ({names})" + _BEST_OF_ITS_KEY.format(
            limited=numbered("limited", limited), served=f"bq.queue NOT IN ({names})"
        )
    return CLAIM_KEYED.render(
        handlers=numbered("handler", handlers),
        queues=in_queues,
        limited=numbered("limited", limited),
        limits=" ".join(f"WHEN %(limited_{i})s THEN %(limit_{i})s" for i in range(limited)),
    )


@lru_cache(maxsize=256)
def succeed_many_sql(rows: int) -> str:
    """The success statement for ``rows`` outcomes."""
    return SUCCEED_MANY.render(
        rows=numbered_rows(("id", "token", "result"), rows), ids=numbered("id", rows)
    )


@lru_cache(maxsize=256)
def heartbeat_sql(rows: int) -> str:
    """The heartbeat statement for ``rows`` attempts."""
    return HEARTBEAT.render(ids=numbered("id", rows), tokens=numbered("token", rows))


# -- operations ---------------------------------------------------------------------


class SQLiteOperations(VendorOperations):
    vendor = "sqlite"
    supports_notify = False
    supports_skip_locked = False
    # Every claim, even one that finds nothing, is an UPDATE that takes the
    # database's one write lock, which heartbeats and outcome writes need
    # too; frequent polls would starve them.
    poll_adaptively = False
    # A claim commits behind the database's one write lock, which the other
    # workers' claims, heartbeats and outcome writes queue for: from a
    # claim to its handler's start takes up to about 50 ms here (measured
    # with two workers), against a few on PostgreSQL and MariaDB.
    rate_allowance = 0.05

    def check_version(self) -> None:
        if sqlite3.sqlite_version_info < MIN_VERSION:
            raise UnsupportedDatabase(
                "django-dbworker needs SQLite 3.35 or newer (UPDATE ... RETURNING); "
                f"this Python links SQLite {sqlite3.sqlite_version}."
            )

    def claim(
        self,
        *,
        limit: int,
        handlers: Sequence[str],
        queues: Sequence[str] | None,
        worker: str,
        limits: Mapping[str, int] | None = None,
        keyed_cap: int | None = None,
        turn: Turn | None = None,
    ) -> Claimed[WorkItem]:
        queues = queues or ()
        params = {
            "worker": worker,
            "limit": limit,
            **numbered_params("handler", handlers),
            **numbered_params("queue", queues),
        }
        if limits:
            params["keyed_cap"] = limit if keyed_cap is None else keyed_cap
            params.update(numbered_params("limited", list(limits)))
            params.update(numbered_params("limit", list(limits.values())))
            sql = claim_keyed_sql(len(handlers), len(queues), len(limits))
        else:
            sql = claim_sql(len(handlers), len(queues))
        if turn is not None:
            params.update(turn.params())
        rows = self._fetch(fair_filtered(sql, turn), params)
        # The statement does not say how many candidates it held back.
        return self._rows_to_items(rows)

    def succeed_rows(
        self, outcomes: Sequence[tuple[int, UUID, str | None]]
    ) -> list[tuple[int, UUID, bool]]:
        if not outcomes:
            return []
        params = {
            **numbered_params("id", [pk for pk, _, _ in outcomes]),
            # UUIDField's storage on SQLite: 32 hex characters.
            **numbered_params("token", [token.hex for _, token, _ in outcomes]),
            **numbered_params("result", [result for _, _, result in outcomes]),
        }
        rows = self._fetch(succeed_many_sql(len(outcomes)), params)
        return [(pk, as_uuid(token), bool(linked)) for pk, token, linked in rows]

    def heartbeat(self, claims: Collection[tuple[int, UUID]]) -> list[tuple[int, UUID, bool]]:
        claims = list(claims)
        params = {
            **numbered_params("id", [pk for pk, _ in claims]),
            **numbered_params("token", [token.hex for _, token in claims]),
        }
        return [
            (pk, as_uuid(token), requested is not None)
            for pk, token, requested in self._fetch(heartbeat_sql(len(claims)), params)
        ]

    def distinct_queues(self) -> list[str]:
        return [name for (name,) in self._fetch(DISTINCT_QUEUES.sql)]
