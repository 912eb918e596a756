"""PostgreSQL's keyed claim: the statements that honour per-key concurrency limits.

One READ COMMITTED transaction of two statements (``PostgresOperations._claim_keyed``):

1. The candidates, locked (SKIP LOCKED), then an advisory transaction lock per key, in
   sorted order; of each key no more rows than its limit (the key's later rows could not
   be claimed by this claim anyway) and, in every row, how many rows it locked. Two ways:
   ``CLAIM_HEADS*`` (below) when every handler of the claim is limited: the free keys'
   first rows, found by key in ``dbworker_key_pending_idx``; otherwise, or past
   KEYS_WALKED pending keys, ``CLAIM_CANDIDATES*``, the walk: the next ready rows in claim
   order but keys at their limit (a hashed subplan over ``dbworker_key_slots_idx``).
2. ``CLAIM_WITHIN_LIMITS`` counts the keys' slots after the locks, in a snapshot of its own
   that sees the previous lock holder's commit, and claims the candidates that fit.

A slot is a claimed row. Locked rows that a claim leaves were held back by their keys, so
a claim cut short that way is not an empty queue (``Claimed.throttled``). Reading the
candidates without locks, as a window deduplicated before the lock, was tried: two
processes then read the same window and the second found its rows locked (W7 with 10,000
keys, 0.57x; docs/internals/benchmarks.md).

Text only, like ``postgresql_sql.py`` (the snapshot test pins each statement).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from django_dbworker.db.postgresql_sql import CLAIM_SET, CLAIMED_COLUMNS
from django_dbworker.db.sql import Statement

KEY_LOCK_SPACE = 1684109163  # the advisory locks' first number ("dbwk" as an int4)

# The limits are the handlers' current ones (%(limited)s -> %(limit_values)s).
_KEY_FILTER = """
      AND (p.concurrency_key IS NULL
           OR p.handler <> ALL(%(limited)s::text[])
           OR (p.handler, p.concurrency_key) NOT IN (
               SELECT h.handler, h.concurrency_key FROM django_dbworker_workitem AS h
               JOIN unnest(%(limited)s::text[], %(limit_values)s::integer[]) AS l(handler, lim)
                 ON l.handler = h.handler
               WHERE h.status = 'claimed'
                 AND h.concurrency_key IS NOT NULL
                 AND h.handler = ANY(%(limited)s::text[])
               GROUP BY h.handler, h.concurrency_key
               HAVING count(*) >= min(l.lim)))"""

_CANDIDATES_HEAD = """
WITH c AS (
    SELECT p.id, p.handler, p.concurrency_key, p.concurrency_limit, p.priority, p.run_after
    FROM django_dbworker_workitem AS p
    WHERE p.status = 'pending'
      AND p.run_after <= statement_timestamp()
      AND p.handler = ANY(%(handlers)s::text[])
      AND p.queue NOT IN (SELECT name FROM django_dbworker_queuestate WHERE paused)"""

# The keys' advisory locks, in sorted order (no two claimers wait on each other), taken after
# the candidates' row locks, before the slots are counted (both candidates statements).
_KEY_LOCKS = f"""), locks AS (
    SELECT pg_advisory_xact_lock({KEY_LOCK_SPACE}, k.lock)
    FROM (
        SELECT DISTINCT hashtext(c.handler || ':' || c.concurrency_key) AS lock
        FROM c
        WHERE c.concurrency_key IS NOT NULL AND c.handler = ANY(%(limited)s::text[])
        ORDER BY 1
    ) AS k
    ORDER BY k.lock
)"""

# The locked rows a key's limit leaves out stay locked until the claim commits (no other
# claimer takes them meanwhile); only what may fit goes back to the worker and into
# CLAIM_WITHIN_LIMITS, with the count of rows locked (``locked``) in every row.
_CANDIDATES_TAIL = f"""
    ORDER BY p.priority DESC, p.run_after, p.id
    LIMIT %(limit)s
    FOR UPDATE OF p SKIP LOCKED
{_KEY_LOCKS}
SELECT r.id, r.handler, r.concurrency_key, r.concurrency_limit, r.locked
FROM (
    SELECT c.*,
           row_number() OVER (PARTITION BY c.handler, c.concurrency_key
                              ORDER BY c.priority DESC, c.run_after, c.id) AS rank,
           count(*) OVER () AS locked
    FROM c
) AS r
LEFT JOIN unnest(%(limited)s::text[], %(limit_values)s::integer[]) AS l(handler, lim)
  ON l.handler = r.handler
WHERE (SELECT count(*) FROM locks) >= 0
  AND (r.concurrency_key IS NULL OR l.lim IS NULL OR r.rank <= l.lim)
ORDER BY r.priority DESC, r.run_after, r.id"""


# A worker of some queues leaves a limited key's row while a better row of the key (in claim
# order) is ready in a queue it does not serve: a key's slot goes to its best ready row,
# whichever worker serves it (a key split across queues of different workers starved one of
# them). The key's best ready row is one descent of dbworker_key_pending_idx per keyed
# candidate, in the walks of a worker of some queues only; its queue, read by id, says
# whether it is elsewhere (and not paused). A row behind a better row of its key in its own
# queue waits for that one anyway. The key is matched by a range, and leads the ORDER BY,
# so that only that index returns the rows in order: as an equality the planner drops it
# from the order, and with statistics that saw one key it took the claim index and read
# the other queue's whole backlog of that key.
def _best_of_its_key(served: str, row: str = "p") -> str:
    return f"""
      AND ({row}.concurrency_key IS NULL OR {row}.handler <> ALL(%(limited)s::text[])
           OR NOT EXISTS (
          SELECT 1 FROM (
              SELECT b.id, b.priority, b.run_after FROM django_dbworker_workitem AS b
              WHERE b.status = 'pending' AND b.concurrency_key IS NOT NULL
                AND b.handler = {row}.handler
                AND b.concurrency_key >= {row}.concurrency_key
                AND b.concurrency_key <= {row}.concurrency_key
                AND b.run_after <= statement_timestamp()
                AND b.queue NOT IN (SELECT name FROM django_dbworker_queuestate WHERE paused)
              ORDER BY b.concurrency_key, b.priority DESC, b.run_after, b.id
              LIMIT 1
          ) AS best
          JOIN django_dbworker_workitem AS bq ON bq.id = best.id
          WHERE (best.priority, {row}.run_after, {row}.id)
                > ({row}.priority, best.run_after, best.id)
            AND {served}))"""


def _candidates(queue_filter: str) -> str:
    return _CANDIDATES_HEAD + queue_filter + _KEY_FILTER + _CANDIDATES_TAIL + "\n"


CLAIM_CANDIDATES = Statement(
    "claim_candidates",
    "Lock the next ready rows of some handlers (any queue) but keys at their limit; lock keys.",
    _candidates(""),
)
CLAIM_CANDIDATES_IN_QUEUE = Statement(
    "claim_candidates_in_queue",
    "Lock the next ready rows of some handlers in one queue but keys at their limit; lock keys.",
    _candidates("\n      AND p.queue = %(queue)s" + _best_of_its_key("bq.queue <> %(queue)s")),
)
CLAIM_CANDIDATES_IN_QUEUES = Statement(
    "claim_candidates_in_queues",
    "Lock the next ready rows of some handlers in some queues but keys at their limit; lock keys.",
    _candidates(
        "\n      AND p.queue = ANY(%(queues)s::text[])"
        + _best_of_its_key("bq.queue <> ALL(%(queues)s::text[])")
    ),
)

READ_COMMITTED = Statement(
    "read_committed",
    "The keyed claim's own transaction counts slots in fresh snapshots (first statement).",
    "SET TRANSACTION ISOLATION LEVEL READ COMMITTED\n",
)
TRANSACTION_ISOLATION = Statement(
    "transaction_isolation",
    "The isolation of the caller's transaction.",
    "SHOW transaction_isolation\n",
)

# Candidates as arrays in claim order (n) with their handlers' current limits; one fits
# while its key's claimed rows plus its rank stay within the limit.
CLAIM_WITHIN_LIMITS = Statement(
    "claim_within_limits",
    "Count the candidates' keys' slots and claim the candidates that fit, in claim order.",
    """
WITH c AS (
    SELECT *
    FROM unnest(%(ids)s::bigint[], %(handlers)s::text[], %(keys)s::text[], %(limits)s::integer[])
         WITH ORDINALITY AS c(id, handler, concurrency_key, concurrency_limit, n)
), held AS (
    SELECT h.handler, h.concurrency_key, count(*) AS slots
    FROM django_dbworker_workitem AS h
    WHERE h.status = 'claimed'
      AND h.concurrency_key IS NOT NULL
      AND (h.handler, h.concurrency_key) IN (
          SELECT c.handler, c.concurrency_key FROM c WHERE c.concurrency_limit IS NOT NULL)
    GROUP BY h.handler, h.concurrency_key
), fits AS (
    SELECT r.id
    FROM (
        SELECT c.id, c.concurrency_limit,
               coalesce(held.slots, 0)
               + row_number() OVER (PARTITION BY c.handler, c.concurrency_key ORDER BY c.n)
               AS used
        FROM c
        LEFT JOIN held
          ON held.handler = c.handler AND held.concurrency_key = c.concurrency_key
    ) AS r
    WHERE r.concurrency_limit IS NULL OR r.used <= r.concurrency_limit
)
UPDATE django_dbworker_workitem AS w
"""
    + CLAIM_SET
    + """FROM fits
WHERE w.id = ANY(%(ids)s::bigint[])
  AND w.id = fits.id
  AND w.status = 'pending'
"""
    + CLAIMED_COLUMNS,
)


def candidates_statement(
    *,
    limit: int,
    handlers: Sequence[str],
    queues: Sequence[str] | None,
    limits: Mapping[str, int],
) -> tuple[str, dict[str, Any]]:
    """The keyed claim's candidate statement for these filters, and its parameters."""
    params: dict[str, Any] = {
        "handlers": list(handlers),
        "limit": limit,
        "limited": list(limits),
        "limit_values": list(limits.values()),
    }
    if not queues:
        return CLAIM_CANDIDATES.sql, params
    if len(queues) == 1:
        return CLAIM_CANDIDATES_IN_QUEUE.sql, {**params, "queue": queues[0]}
    return CLAIM_CANDIDATES_IN_QUEUES.sql, {**params, "queues": list(queues)}


# -- the key-driven candidates: a worker whose handlers are all limited -------------------
# The walk above reads every ready row of a key at its limit to leave it out: a hot key's
# backlog of 20,000 rows is read by every claim while its slot is held (15.7 ms a claim,
# linear in the backlog; bench/claim_cost.py). Here each pending key is found in one descent
# of dbworker_key_pending_idx (pending keyed rows by handler and key, in claim order within a
# key: the initial migration), and a key offers its first ready rows up to its free slots (its head,
# one more descent; a key at its limit offers none). The heads of every free key are then
# locked in claim order up to the claim's limit, skipping rows another claim holds (SKIP
# LOCKED below the LIMIT, as in the walk: a claim beside a claim in flight takes the next
# rows, not none). The claim order is the walk's, but a key's later rows neither cost a read
# nor take the places of the rows behind them; a claim that returns fewer rows than it asked
# for has seen everything claimable, so the claim loop sleeps instead of claiming again.
#
# Keyed rows only. While the handlers have a ready row without a key (one probe of
# dbworker_claim_unkeyed_idx, which leads with the handler), the statement locks nothing
# and answers a row of NULLs (its last column 0), and the caller walks: merging unkeyed
# rows into the heads either locked rows it did not return (a claim beside it came back
# empty) or cut them before locking (the same, from the other side). The loose scan costs
# one descent per pending key, the walk one row per ready row: past KEYS_WALKED keys the
# answer is the same row with 1, and the caller walks for WALK_FOR seconds. With no head
# to lock the same row says 2: nothing is free.
KEYS_WALKED = 1000
#: Seconds a worker walks, without trying the heads, after they found more keys than that.
WALK_FOR = 10.0

# A key's free slots (its limit less its claimed rows, ``held``) offer its first ready rows,
# found in dbworker_key_pending_idx; those heads are locked in claim order (SKIP LOCKED below
# the LIMIT), then the keys' advisory locks are taken (``_LOCK_HEADS``). A worker of some
# queues leaves a key whose best ready row waits in a queue it does not serve
# (``_best_of_its_key``, as the walk does).
_HEADS_OF_KEYS = """
), heads AS (
    SELECT hd.id
    FROM keys
    JOIN unnest(%(limited)s::text[], %(limit_values)s::integer[]) AS l(handler, lim)
      ON l.handler = keys.handler
    LEFT JOIN held
      ON held.handler = keys.handler AND held.concurrency_key = keys.concurrency_key
    CROSS JOIN LATERAL (
        SELECT p.id, p.handler, p.concurrency_key, p.priority, p.run_after
        FROM django_dbworker_workitem AS p
        WHERE p.status = 'pending' AND p.concurrency_key IS NOT NULL
          AND p.handler = keys.handler AND p.concurrency_key = keys.concurrency_key
          AND p.run_after <= statement_timestamp()
          AND p.queue NOT IN (SELECT name FROM django_dbworker_queuestate WHERE paused){queues}
        ORDER BY p.priority DESC, p.run_after, p.id
        LIMIT greatest(l.lim - coalesce(held.slots, 0), 0)
    ) AS hd
    WHERE NOT (SELECT over FROM walked){heads_best}
), c AS (
    SELECT p.id, p.handler, p.concurrency_key, p.concurrency_limit, p.priority, p.run_after
    FROM django_dbworker_workitem AS p
    WHERE p.id = ANY(ARRAY(SELECT heads.id FROM heads))
      AND p.status = 'pending'
    ORDER BY p.priority DESC, p.run_after, p.id
    LIMIT %(limit)s
    FOR UPDATE OF p SKIP LOCKED
"""

_LOCK_HEADS = (
    _KEY_LOCKS
    + """
(SELECT c.id, c.handler, c.concurrency_key, c.concurrency_limit,
        count(*) OVER () AS locked
 FROM c
 WHERE (SELECT count(*) FROM locks) >= 0
 ORDER BY c.priority DESC, c.run_after, c.id)"""
)

_HEADS = (
    f"""
WITH RECURSIVE unkeyed AS (
    SELECT EXISTS (
        SELECT 1 FROM django_dbworker_workitem AS p
        WHERE p.status = 'pending' AND p.concurrency_key IS NULL
          AND p.handler = ANY(%(handlers)s::text[])
          AND p.run_after <= statement_timestamp()
          AND p.queue NOT IN (SELECT name FROM django_dbworker_queuestate WHERE paused){{queues}}
    ) AS ready
), keys AS (
    SELECT f.handler, f.concurrency_key, 1 AS n
    FROM unnest(%(limited)s::text[]) AS lh(handler)
    CROSS JOIN LATERAL (
        SELECT k.handler, k.concurrency_key FROM django_dbworker_workitem AS k
        WHERE k.status = 'pending' AND k.concurrency_key IS NOT NULL AND k.handler = lh.handler
        ORDER BY k.concurrency_key
        LIMIT 1
    ) AS f
    WHERE NOT (SELECT ready FROM unkeyed)
    UNION ALL
    SELECT nx.handler, nx.concurrency_key, keys.n + 1
    FROM keys
    CROSS JOIN LATERAL (
        SELECT k.handler, k.concurrency_key FROM django_dbworker_workitem AS k
        WHERE k.status = 'pending' AND k.concurrency_key IS NOT NULL
          AND k.handler = keys.handler AND k.concurrency_key > keys.concurrency_key
        ORDER BY k.concurrency_key
        LIMIT 1
    ) AS nx
    WHERE keys.n <= {KEYS_WALKED}
), walked AS (
    SELECT count(*) > {KEYS_WALKED} AS over, (SELECT ready FROM unkeyed) AS unkeyed
    FROM keys
), held AS (
    SELECT h.handler, h.concurrency_key, count(*) AS slots FROM django_dbworker_workitem AS h
    WHERE h.status = 'claimed'
      AND h.concurrency_key IS NOT NULL
      AND h.handler = ANY(%(limited)s::text[])
    GROUP BY h.handler, h.concurrency_key"""
    + _HEADS_OF_KEYS
    + _LOCK_HEADS
    + """
UNION ALL
SELECT NULL, NULL, NULL, NULL,
       CASE WHEN over THEN 1 WHEN unkeyed THEN 0 ELSE 2 END
FROM walked WHERE over OR unkeyed OR NOT EXISTS (SELECT 1 FROM c)
"""
)

# The loose scan's plan must not follow wrong statistics: after an ANALYZE of a table that
# held no keyed rows, the planner took each step of the recursion for a seq scan and a sort
# of a tiny table (100 keys: 220 ms a claim where the index takes 2), and with seq scans off
# for a bitmap scan of the key's every row and a sort (145 ms). Seq and bitmap scans off,
# and JIT with them: the disabled paths' cost (1e10) passes every JIT threshold, and
# compiling the statement took 1.3 s. The candidates are locked by primary key from an
# array, a plan that no estimate changes (a semi-join to the heads became a nested loop over
# every pending row). Sent with the statement where the claim's BEGIN opened the transaction
# (SET LOCAL ends with it; CLAIM_WITHIN_LIMITS plans by the primary key either way); in a
# caller's transaction, or with AUTOCOMMIT off, the statement runs as planned (CLAIM_PLAN).
HEADS_PLAN = Statement(
    "heads_plan",
    "Plan the key-driven candidates on ordered index scans; compile nothing (its transaction).",
    "SET LOCAL enable_seqscan = off;\nSET LOCAL enable_bitmapscan = off;\nSET LOCAL jit = off;\n",
)

CLAIM_HEADS = Statement(
    "claim_heads",
    "Lock the heads of free keys and the unkeyed rows of limited handlers (any queue); lock keys.",
    _HEADS.replace("{queues}", "").replace("{heads_best}", ""),
)
CLAIM_HEADS_IN_QUEUES = Statement(
    "claim_heads_in_queues",
    "Lock the heads of free keys and the unkeyed rows of limited handlers in some queues.",
    _HEADS.replace("{queues}", "\n          AND p.queue = ANY(%(queues)s::text[])").replace(
        "{heads_best}", _best_of_its_key("bq.queue <> ALL(%(queues)s::text[])", row="hd")
    ),
)


def heads_statement(
    *,
    limit: int,
    handlers: Sequence[str],
    queues: Sequence[str] | None,
    limits: Mapping[str, int],
) -> tuple[str, dict[str, Any]] | None:
    """The key-driven candidates statement and its parameters; None unless every handler
    of the claim is limited (an unlimited handler's keyed rows would need the walk).
    Sent after HEADS_PLAN where the claim has its own transaction."""
    if not set(handlers) <= set(limits):
        return None
    params: dict[str, Any] = {
        "handlers": list(handlers),
        "limit": limit,
        "limited": list(handlers),
        "limit_values": [limits[name] for name in handlers],
    }
    if not queues:
        return CLAIM_HEADS.sql, params
    return CLAIM_HEADS_IN_QUEUES.sql, {**params, "queues": list(queues)}
