"""PostgreSQL's statements: every SQL text that ``postgresql.py`` runs, named and explained.

Every statement is fixed text: lists travel as array parameters (``= ANY(%(handlers)s)``,
``unnest(%(payloads)s::jsonb[])``), so a reader sees exactly what runs and the server parses a
handful of distinct texts. Django's psycopg backend binds parameters on the client by default, so
the planner sees the arrays as constants, as it did the IN lists.

The claim statements must keep their plans on a table of millions of finished rows: an index scan
of the partial claim index ``dbworker_claim_idx`` (or ``dbworker_claim_queue_idx`` for one queue)
in claim order, stopped by the LIMIT; the status and handler indexes leave pending rows out so that
nothing else can be chosen.

Text only, read top to bottom (tests/conformance/snapshots/postgresql.sql pins each statement as it
runs): this module must not import Django, the driver or the operations, and runs nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django_dbworker.db.sql import Statement, Turns

# What a claim sets on each row it takes, and the columns it returns (``_rows_to_items``).
CLAIM_SET = """SET status = 'claimed',
    attempts = w.attempts + 1,
    claimed_at = statement_timestamp(),
    heartbeat_at = statement_timestamp(),
    updated_at = statement_timestamp(),
    claimed_by = %(worker)s,
    claim_token = gen_random_uuid()
"""
# The rows the claim's CTE chose, by their ids: a join with the CTE was planned, after an ANALYZE
# that counted the pages but none of the rows (autovacuum during an uncommitted enqueue_many), as a
# walk of the whole primary key with the CTE scanned for each row (test_the_fair_claim_reads_...).
CLAIMED_ROWS = "WHERE w.id = ANY(ARRAY(SELECT id FROM c))\n"
CLAIMED_COLUMNS = """RETURNING w.id, w.handler, w.queue, w.payload, w.priority, w.run_after, \
w.attempts,
          w.max_attempts, w.claimed_by, w.claim_token, w.trace_context, w.batch_id,
          w.has_dependents, w.concurrency_key, w.fair_key
"""


# -- statements ---------------------------------------------------------------------
# The claim: one UPDATE joined to a MATERIALIZED CTE, which runs once (a FROM subquery rerun as a
# nested loop's inner side locked new rows each time: a claim of 1 took 3); SKIP LOCKED lets
# claimers take disjoint rows; WHERE and ORDER BY are WorkItem.objects.ready().in_order(). Wake-ups:
# channel "django_dbworker", payload queue and priority (``wakers.wake_payload``). A paused queue's
# rows are not claimable: the NOT IN is a hashed subplan over the few QueueState rows, checked per
# candidate from the claim index, so the plan keeps its index path (test_claim_plans).
def _claim(queue_filter: str) -> str:
    return _CLAIM_HEAD + queue_filter + _CLAIM_TAIL


_CLAIM_HEAD = """
WITH c AS MATERIALIZED (
    SELECT id FROM django_dbworker_workitem
    WHERE status = 'pending'
      AND run_after <= statement_timestamp()
      AND handler = ANY(%(handlers)s::text[])"""

_CLAIM_TAIL = (
    """
      AND queue NOT IN (SELECT name FROM django_dbworker_queuestate WHERE paused)
    ORDER BY priority DESC, run_after, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
UPDATE django_dbworker_workitem AS w
"""
    + CLAIM_SET
    + CLAIMED_ROWS
    + CLAIMED_COLUMNS
)

CLAIM = Statement(
    "claim",
    "Claim the next ready rows of some handlers, in any queue.",
    _claim(""),
)

# A plain equality, not "= ANY" of one queue: only an equality on the index's leading column lets
# dbworker_claim_queue_idx return rows in claim order, so the LIMIT stops the scan (no sort).
CLAIM_IN_QUEUE = Statement(
    "claim_in_queue",
    "Claim the next ready rows of some handlers in one queue.",
    _claim("\n      AND queue = %(queue)s"),
)

CLAIM_IN_QUEUES = Statement(
    "claim_in_queues",
    "Claim the next ready rows of some handlers in several queues.",
    _claim("\n      AND queue = ANY(%(queues)s::text[])"),
)

# The fair rotation's claim (``flow/fair.py``): every turn of one claim in one statement, at one
# priority. The keyed turns are a LATERAL subquery per key (keys and counts travel as two arrays),
# the rows without a key have a branch of their own (``IS NULL`` is another index condition); each
# reads dbworker_fair_idx in its order from the key's first ready row, stopped by the turn's count.
# A claim statement per turn, as before, cost most of a fair claim (W12's throughput leg).
_FAIR_TURN = """
        SELECT id FROM django_dbworker_workitem
        WHERE status = 'pending'
          AND run_after <= statement_timestamp()
          AND handler = ANY(%(handlers)s::text[]){queues}
          AND queue NOT IN (SELECT name FROM django_dbworker_queuestate WHERE paused)
          AND {key}
          AND priority = %(fair_priority)s
        ORDER BY fair_key, priority DESC, run_after, id
        LIMIT {limit}
        FOR UPDATE SKIP LOCKED"""


def _fair_claim(queue_filter: str) -> str:
    # The key as a range: an equality would leave the claim index (in claim order as well
    # at one key) to the planner, which then walks every other key's ready rows to the turn's.
    keyed = _FAIR_TURN.format(
        queues=queue_filter, key="fair_key >= f.key AND fair_key <= f.key", limit="f.n"
    )
    unkeyed = _FAIR_TURN.format(
        queues=queue_filter, key="fair_key IS NULL", limit="%(fair_unkeyed)s"
    )
    return (
        """
WITH c AS MATERIALIZED (
    SELECT t.id FROM unnest(%(fair_keys)s::text[], %(fair_counts)s::int[]) AS f(key, n)
    CROSS JOIN LATERAL ("""
        + keyed
        + """
    ) t
    UNION ALL
    SELECT n.id FROM ("""
        + unkeyed
        + """
    ) n
)
UPDATE django_dbworker_workitem AS w
"""
        + CLAIM_SET
        + CLAIMED_ROWS
        + CLAIMED_COLUMNS
    )


FAIR_CLAIM = Statement(
    "fair_claim",
    "Claim the turns of the fair rotation: each key's share of its next ready rows, any queue.",
    _fair_claim(""),
)

FAIR_CLAIM_IN_QUEUE = Statement(
    "fair_claim_in_queue",
    "Claim the turns of the fair rotation in one queue.",
    _fair_claim("\n          AND queue = %(queue)s"),
)

FAIR_CLAIM_IN_QUEUES = Statement(
    "fair_claim_in_queues",
    "Claim the turns of the fair rotation in several queues.",
    _fair_claim("\n          AND queue = ANY(%(queues)s::text[])"),
)

# The claim's plan must not follow wrong statistics: after an ANALYZE that counted the pages but
# none of the rows (autovacuum during an uncommitted enqueue_many; a table emptied, then refilled),
# the planner expects one pending row and sorts the whole backlog on each claim (W6's slow mode,
# docs/internals/benchmarks.md). Sent with the claim in one message (SET LOCAL: its implicit
# transaction only). Not for several queues (a top-N sort by design) nor the keyed claim (it sorts
# candidates anyway; tried, a keyed process test took 5-11 s instead of 2.4 s).
CLAIM_PLAN = Statement(
    "claim_plan",
    "Plan the claim that follows in its index's order, never a sort (its transaction only).",
    "SET LOCAL enable_sort = off;\nSET LOCAL enable_incremental_sort = off;\n",
)

# Bulk writers of claimed rows (recovery, release, cancel) lock in id order, as LOCKED_IN_ID_ORDER.
LOCK_ROWS = Statement(
    "lock_rows",
    "Lock rows by id, in ascending id order, until the transaction ends.",
    """
SELECT id FROM django_dbworker_workitem WHERE id = ANY(%(ids)s::bigint[]) ORDER BY id FOR UPDATE
""",
)

# Success writes and heartbeats lock their rows first, in id order (a LockRows over a sort):
# locking in their plans' orders (arrays', table's), a worker's two deadlocked (docs/scale.md).
LOCKED_IN_ID_ORDER = """
WITH l AS MATERIALIZED (
    SELECT id FROM django_dbworker_workitem
    WHERE id = ANY(%(ids)s::bigint[])
      AND claim_token = ANY(%(tokens)s::uuid[])
      AND status = 'claimed'
    ORDER BY id
    FOR UPDATE
)"""

SUCCEED_UPDATE = """UPDATE django_dbworker_workitem AS w
SET status = 'succeeded',
    result = v.result,
    finished_at = statement_timestamp(),
    updated_at = statement_timestamp(),
    last_error = ''
FROM l, unnest(%(ids)s::bigint[], %(tokens)s::uuid[], %(results)s::jsonb[]) AS v(id, token, result)
WHERE w.id = l.id
  AND w.id = v.id
  AND w.claim_token = v.token
  AND w.status = 'claimed'
"""

# The separate "w.id = l.id" from the locked ids pins the plan to primary-key lookups,
# whatever the planner thinks of the join with the unnested arrays.
SUCCEED_MANY = Statement(
    "succeed_many",
    "Record the successes of several attempts, each fenced by its own id, token and status.",
    LOCKED_IN_ID_ORDER
    + "\n"
    + SUCCEED_UPDATE
    + "RETURNING w.id, w.claim_token, w.has_dependents\n",
)

# The heartbeat of every attempt a process runs, in one statement that also says
# which an operator asked to stop: cancel requests come at no extra round trip. The locked
# rows by their ids, as the claims' (CLAIMED_ROWS): a join was planned as a walk of the
# whole primary key after an ANALYZE that counted no row.
HEARTBEAT = Statement(
    "heartbeat",
    "Refresh the heartbeats of the attempts still held; return them with their cancel requests.",
    LOCKED_IN_ID_ORDER
    + """
UPDATE django_dbworker_workitem AS w
SET heartbeat_at = statement_timestamp()
WHERE w.id = ANY(ARRAY(SELECT id FROM l))
RETURNING w.id, w.claim_token, w.cancel_requested_at IS NOT NULL
""",
)

# NOTIFY is transactional: delivered if the insert commits. run_at is an absolute time,
# or NULL for "delay after now". pg_notify() in RETURNING runs once, for the one row:
# cheaper to parse and plan than a WITH joining the insert to the NOTIFY.
INSERT_ITEM = Statement(
    "insert_item",
    "Insert one pending row and notify its queue, in one round trip.",
    """
INSERT INTO django_dbworker_workitem (
    handler, queue, payload, status, priority, run_after, attempts, max_attempts,
    claimed_by, last_error, trace_context, concurrency_key, concurrency_limit, fair_key,
    created_at, updated_at)
VALUES (
    %(handler)s, %(queue)s, %(payload)s::jsonb, 'pending', %(priority)s,
    coalesce(%(run_at)s::timestamptz, statement_timestamp() + %(delay)s::interval),
    0, %(max_attempts)s, '', '', %(trace_context)s::jsonb,
    %(concurrency_key)s::text, %(concurrency_limit)s::integer, %(fair_key)s::text,
    statement_timestamp(), statement_timestamp())
RETURNING id, run_after, created_at, updated_at, pg_notify('django_dbworker', %(wake)s)
""",
)

# All payloads travel as one jsonb[] parameter: one statement whatever the batch size (no
# 65,535-parameter ceiling). Ids come from the sequence in insertion order, which follows ORDER BY
# u.n; the outer ORDER BY id lines the returned rows up with the payloads.
INSERT_ITEMS = Statement(
    "insert_items",
    "Insert pending rows sharing all but their payloads, and notify their queue.",
    """
WITH ins AS (
    INSERT INTO django_dbworker_workitem (
        handler, queue, payload, status, priority, run_after, attempts, max_attempts,
        claimed_by, last_error, trace_context, concurrency_key, concurrency_limit, fair_key,
        created_at, updated_at)
    SELECT
        %(handler)s, %(queue)s, u.payload, 'pending', %(priority)s,
        coalesce(%(run_at)s::timestamptz, statement_timestamp() + %(delay)s::interval),
        0, %(max_attempts)s, '', '', %(trace_context)s::jsonb,
        %(concurrency_key)s::text, %(concurrency_limit)s::integer, %(fair_key)s::text,
        statement_timestamp(), statement_timestamp()
    FROM unnest(%(payloads)s::jsonb[]) WITH ORDINALITY AS u(payload, n)
    ORDER BY u.n
    RETURNING id, run_after, created_at, updated_at
)
SELECT ins.id, ins.run_after, ins.created_at, ins.updated_at
FROM ins, (SELECT pg_notify('django_dbworker', %(wake)s)) AS wake
ORDER BY ins.id
""",
)

# WAKEUP_WINDOW > 0 or WAKEUPS off: the inserts without NOTIFY (db/wake_window.py sends it after).
INSERT_ITEM_QUIET = Statement(
    "insert_item_quiet",
    "Insert one pending row; its wake-up, if any, is sent after the commit.",
    INSERT_ITEM.sql.replace(", pg_notify('django_dbworker', %(wake)s)", ""),
)
INSERT_ITEMS_QUIET = Statement(
    "insert_items_quiet",
    "Insert pending rows sharing all but their payloads; the wake-up follows the commit.",
    INSERT_ITEMS.sql.replace(", (SELECT pg_notify('django_dbworker', %(wake)s)) AS wake", ""),
)

# A large batch goes in by COPY (no per-row executor work, no giant array). COPY returns nothing,
# so the ids come first from the table's sequence (distinct for every caller, increasing in one
# session: they follow the payloads), with the times every row shares, read from the database
# clock by the same statement: the returned items hold exactly what is stored.
RESERVE_IDS = Statement(
    "reserve_ids",
    "Take ids for a batch from the table's sequence, and the database times its rows get.",
    """
SELECT statement_timestamp(),
       coalesce(%(run_at)s::timestamptz, statement_timestamp() + %(delay)s::interval),
       array(
           SELECT nextval(s.seq)
           FROM (SELECT pg_get_serial_sequence('django_dbworker_workitem', 'id')::regclass
                 AS seq) AS s,
                generate_series(1, %(count)s)
       )
""",
)

# Text format; the column order puts the two that vary (id, payload) first.
COPY_ITEMS = Statement(
    "copy_items",
    "Write pending rows with reserved ids, as COPY text (their wake-up is a NOTIFY).",
    """
COPY django_dbworker_workitem (
    id, payload, handler, queue, status, priority, run_after, attempts, max_attempts,
    claimed_by, last_error, trace_context, concurrency_key, concurrency_limit, fair_key,
    created_at, updated_at)
FROM STDIN
""",
)

NOTIFY = Statement(
    "notify",
    "Wake idle workers of a queue when the current transaction (or this statement) commits.",
    "SELECT pg_notify('django_dbworker', %(wake)s)\n",
)
# Does a NOTIFY reach a listener? (postgresql_listen.py) A channel of its own: no wake-up.
NOTIFY_PROBE = Statement(
    "notify_probe", "A listener's probe.", "SELECT pg_notify('django_dbworker_probe', %(wake)s)\n"
)
LISTEN_PROBE = Statement("listen_probe", "Receive the probes.", "LISTEN django_dbworker_probe\n")
LISTEN = Statement(
    "listen",
    "Receive the wake-ups that NOTIFY and the inserts send (on a connection of its own).",
    "LISTEN django_dbworker\n",
)
UNLISTEN_ALL = Statement(
    "unlisten_all",
    "Receive nothing while waiting for the wake-up turn (a listener that does not read holds "
    "back the server's notification queue).",
    "UNLISTEN *\n",
)
# The wake-up turn (postgresql_listen.py): one session advisory lock per group of workers that
# claim alike; its holder alone acts on every wake-up, and its session's end frees it. The wait
# has no lock_timeout (local to its statement: a role's setting would end it every few seconds).
WAKE_TURN_SPACE = 1684109164  # the turns' first number ("dbwl" as an int4); keys' is "dbwk"
WAIT_TURN = Statement(
    "wait_turn",
    "Wait for a group's wake-up turn, however long it takes.",
    "SELECT set_config('lock_timeout', '0', true),"
    f" pg_advisory_lock({WAKE_TURN_SPACE}, %(group)s)\n",
)
PASS_TURN = Statement(
    "pass_turn",
    "Hand a group's wake-up turn to the next waiter.",
    f"SELECT pg_advisory_unlock({WAKE_TURN_SPACE}, %(group)s)\n",
)

# SELECT DISTINCT reads every row; this recursive query jumps queue to queue (dbworker_queue_idx).
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

# {query} is the ORM's SQL for the queryset being paged (the admin's filters).
ESTIMATE_COUNT = Statement(
    "estimate_count",
    "The planner's row estimate for a query, without running it.",
    """
EXPLAIN (FORMAT JSON) {query}
""",
)

# reltuples and pg_stats are what ANALYZE (and autovacuum) keep: free to read at any table size.
TABLE_ESTIMATE = Statement(
    "table_estimate",
    "The work table's planner row count and value frequencies of some columns.",
    """
SELECT c.reltuples, s.attname, s.most_common_vals::text, s.most_common_freqs, s.n_distinct
FROM pg_class c
LEFT JOIN pg_stats s
  ON s.tablename = c.relname AND s.schemaname = current_schema()
 AND s.attname = ANY(%(columns)s::text[])
WHERE c.oid = to_regclass('django_dbworker_workitem')
""",
)

# Both percentiles from one sort per handler (an array of fractions). The finished_at range is a
# scan of the partial dbworker_finished_idx; status and claimed_at are checked on its rows.
RUN_TIMES = Statement(
    "run_times",
    "p50 and p95 run time per handler of the rows that succeeded in the last N seconds.",
    """
SELECT handler,
       count(*),
       percentile_cont(ARRAY[0.5, 0.95]::float8[]) WITHIN GROUP (ORDER BY seconds)
FROM (
    SELECT handler, EXTRACT(EPOCH FROM finished_at - claimed_at)::float8 AS seconds
    FROM django_dbworker_workitem
    WHERE finished_at >= now() - make_interval(secs => %(seconds)s)
      AND status = 'succeeded'
      AND claimed_at IS NOT NULL
) AS runs
GROUP BY handler
ORDER BY handler
""",
)


# For writes that must not hold up their thread (``bounded_lock_wait``): the setting
# lasts until the transaction ends.
LOCAL_LOCK_TIMEOUT = Statement(
    "local_lock_timeout",
    "Wait at most this long for a lock until the transaction ends, then fail.",
    """
SELECT set_config('lock_timeout', %(timeout)s, true)
""",
)


def claim_statement(
    *, limit: int, handlers: Sequence[str], queues: Sequence[str] | None, worker: str
) -> tuple[str, dict[str, Any]]:
    """The claim statement for these filters, and its parameters."""
    params: dict[str, Any] = {"worker": worker, "handlers": list(handlers), "limit": limit}
    if not queues:
        return CLAIM.sql, params
    if len(queues) == 1:
        return CLAIM_IN_QUEUE.sql, {**params, "queue": queues[0]}
    return CLAIM_IN_QUEUES.sql, {**params, "queues": list(queues)}


def fair_claim_statement(
    *, turns: Turns, handlers: Sequence[str], queues: Sequence[str] | None, worker: str
) -> tuple[str, dict[str, Any]]:
    """The fair rotation's claim of ``turns`` for these filters, and its parameters."""
    keyed = [(key, rows) for key, rows in turns.shares if key]
    params: dict[str, Any] = {
        "worker": worker,
        "handlers": list(handlers),
        "fair_priority": turns.priority,
        "fair_keys": [key for key, _ in keyed],
        "fair_counts": [rows for _, rows in keyed],
        "fair_unkeyed": sum(rows for key, rows in turns.shares if not key),
    }
    if not queues:
        return FAIR_CLAIM.sql, params
    if len(queues) == 1:
        return FAIR_CLAIM_IN_QUEUE.sql, {**params, "queue": queues[0]}
    return FAIR_CLAIM_IN_QUEUES.sql, {**params, "queues": list(queues)}


def index_ordered(sql: str) -> bool:
    """Whether ``sql`` is a claim whose rows come in claim order from an index (``CLAIM_PLAN``)."""
    return sql in _INDEX_ORDERED


# The fair claims walk dbworker_fair_idx whatever their queues (a queue is a filter there).
_INDEX_ORDERED = frozenset(
    statement.sql
    for statement in (CLAIM, CLAIM_IN_QUEUE, FAIR_CLAIM, FAIR_CLAIM_IN_QUEUE, FAIR_CLAIM_IN_QUEUES)
)
