"""MySQL 8 and MariaDB 10.6+: every SQL text that ``mysql.py`` runs, named and explained.

Neither has array parameters: a list of N values is N placeholders, a
statement's ``{slot}`` filled by ``numbered``; the ``*_sql`` functions
render each statement for one list length, once (they are cached), and
``insert_chunks`` cuts a batch enqueue into statements that fit a packet.

The database clock is ``UTC_TIMESTAMP(6)``: Django stores aware datetimes
as naive UTC in DATETIME(6) columns, and ``UTC_TIMESTAMP`` is UTC whatever
the session's time zone. (Django's ``Now()`` is ``CURRENT_TIMESTAMP(6)``,
in the session's zone: ``MySQLOperations.prepare_session`` pins every
MySQL connection to UTC so that both agree.) Claim tokens are
``REPLACE(UUID(), '-', '')``: the 32 hex characters Django's UUIDField
stores on MySQL, which MariaDB's native UUID type (10.7+) also takes;
unique per row, which is what fencing needs.

There are no partial indexes: the initial migration gives MySQL its claim indexes
``dbworker_my_claim_idx`` ``(status, priority DESC, run_after, id)`` and
``dbworker_my_claim_queue_idx`` ``(queue, status, ...)``, whose order is
the claim order, so the LIMIT stops the index scan and SKIP LOCKED never
has to sort (a filesort would lock every row it read). The claims name
them (FORCE INDEX): the optimizer must never pick a cheaper-looking index
whose order is not the claim order. unique_key is a unique index on a
generated column that holds the key only while the row is pending or
claimed.

Text only, read top to bottom (tests/conformance/snapshots/mysql.sql pins
each statement as it runs): this module must not import Django, the driver
or the operations, and runs nothing.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import lru_cache

from django_dbworker.db.sql import Statement, Turn, fair_filtered, numbered

#: A batch enqueue's statements: at most this many rows, and about this many
#: bytes (payloads plus INSERT_ROW_BYTES of SQL per row), well inside the
#: server's default ``max_allowed_packet``.
INSERT_ROWS = 1000
INSERT_BYTES = 4 * 1024 * 1024
INSERT_ROW_BYTES = 400

# -- statements ---------------------------------------------------------------------
#
# Lists are N placeholders (no array parameters): a ``{slot}`` filled by
# ``numbered``. The claim's SELECT is WorkItem.objects.ready().in_order().
# Rows of a paused queue (a QueueState row with ``paused``) are not
# claimable; the subquery takes no locks (a locking read does not lock the
# rows of a nested subquery that has no locking clause of its own).

SET_TIME_ZONE = Statement(
    "set_time_zone",
    "Pin the session's time zone to UTC, so that CURRENT_TIMESTAMP agrees with UTC_TIMESTAMP.",
    """
SET time_zone = '+00:00'
""",
)

# For writes that must not hold up their thread (``bounded_lock_wait``): the session's
# lock wait, kept in a session variable, is put back after the block.
SET_LOCK_WAIT = Statement(
    "set_lock_wait",
    "Wait at most this many seconds for a row lock, keeping the session's own setting.",
    """
SET @dbworker_lock_wait = @@SESSION.innodb_lock_wait_timeout,
    SESSION innodb_lock_wait_timeout = %(seconds)s
""",
)

RESTORE_LOCK_WAIT = Statement(
    "restore_lock_wait",
    "Put back the session's lock wait that SET_LOCK_WAIT kept.",
    """
SET SESSION innodb_lock_wait_timeout = @dbworker_lock_wait
""",
)

# Only when the project's OPTIONS chose another isolation level than
# Django's default (READ COMMITTED): it applies to the next transaction only.
SET_READ_COMMITTED = Statement(
    "set_read_committed",
    "Run the next transaction at READ COMMITTED (no gap locks, fresh reads).",
    """
SET TRANSACTION ISOLATION LEVEL READ COMMITTED
""",
)

CLAIM_SELECT = Statement(
    "claim_select",
    "Lock the next ready rows of some handlers, in any queue (first step of a claim).",
    """
SELECT id FROM django_dbworker_workitem FORCE INDEX (dbworker_my_claim_idx)
WHERE status = 'pending'
  AND run_after <= UTC_TIMESTAMP(6)
  AND handler IN ({handlers})
  AND queue NOT IN (SELECT name FROM django_dbworker_queuestate WHERE paused)
ORDER BY priority DESC, run_after, id
LIMIT %(limit)s
FOR UPDATE SKIP LOCKED
""",
)

# An equality on the index's leading column: dbworker_my_claim_queue_idx then
# returns rows in claim order and the LIMIT stops the scan.
CLAIM_SELECT_IN_QUEUE = Statement(
    "claim_select_in_queue",
    "Lock the next ready rows of some handlers in one queue (first step of a claim).",
    """
SELECT id FROM django_dbworker_workitem FORCE INDEX (dbworker_my_claim_queue_idx)
WHERE queue = %(queue)s
  AND status = 'pending'
  AND run_after <= UTC_TIMESTAMP(6)
  AND handler IN ({handlers})
  AND queue NOT IN (SELECT name FROM django_dbworker_queuestate WHERE paused)
ORDER BY priority DESC, run_after, id
LIMIT %(limit)s
FOR UPDATE SKIP LOCKED
""",
)

# Several queues: the claim index in claim order, queue checked per row.
CLAIM_SELECT_IN_QUEUES = Statement(
    "claim_select_in_queues",
    "Lock the next ready rows of some handlers in several queues (first step of a claim).",
    """
SELECT id FROM django_dbworker_workitem FORCE INDEX (dbworker_my_claim_idx)
WHERE status = 'pending'
  AND run_after <= UTC_TIMESTAMP(6)
  AND handler IN ({handlers})
  AND queue IN ({queues})
  AND queue NOT IN (SELECT name FROM django_dbworker_queuestate WHERE paused)
ORDER BY priority DESC, run_after, id
LIMIT %(limit)s
FOR UPDATE SKIP LOCKED
""",
)

# -- the keyed claim (per-key concurrency limits) --------------------------------
#
# Only for workers whose handlers declare a concurrency_limit; the others
# run the claim above, unchanged. Same transaction shape as the plain
# claim (READ COMMITTED): the candidates are locked in claim order, skipping
# rows whose key already holds its limit of claimed rows (so a key at its
# limit does not stop the scan); then the FlowLock rows of their keys are
# locked in name order (the missing ones inserted first: INSERT IGNORE of
# an existing row would take a shared lock, and two claimers upgrading
# shared locks deadlock); then the claimed rows per key are counted by a
# statement of its own, which at READ COMMITTED sees what the previous
# lock holder committed; then CLAIM_UPDATE takes the candidates that fit
# (``base.within_limits``), and the rest stay pending, untouched.
#
# The keys at their limit are found once per statement (a materialised
# NOT IN over the claimed keyed rows, through dbworker_status_idx), so a
# skipped row costs a lookup. MySQL has no partial index:
# dbworker_key_slots_idx is (handler, concurrency_key) over every row, and
# COUNT_KEY_SLOTS reads the status of each row of a key, finished ones too.

# {limited}: the handlers with a limit now; {limits}: CASE arms, handler -> its limit.
_KEY_FILTER = """
  AND (p.concurrency_key IS NULL
       OR p.handler NOT IN ({limited})
       OR (p.handler, p.concurrency_key) NOT IN (
           SELECT h.handler, h.concurrency_key FROM django_dbworker_workitem AS h
           WHERE h.status = 'claimed'
             AND h.concurrency_key IS NOT NULL
             AND h.handler IN ({limited})
           GROUP BY h.handler, h.concurrency_key
           HAVING count(*) >= min(CASE h.handler {limits} END)))"""


# A worker of some queues leaves a limited key's row while the key's best ready row (in claim
# order) waits in a queue it does not serve and that is not paused: a key's slot goes to its
# best ready row, whichever worker serves it (a key split across queues of different workers
# starved one of them). Not locking: a plain read inside the locking one. It reads the key's
# pending rows (dbworker_key_slots_idx), per keyed candidate of a worker of some queues.
def _best_of_its_key(served: str) -> str:
    return f"""
  AND (p.concurrency_key IS NULL OR p.handler NOT IN ({{limited}}) OR NOT EXISTS (
      SELECT 1 FROM django_dbworker_workitem AS bq
      WHERE bq.id = (
          SELECT b.id FROM django_dbworker_workitem AS b
          WHERE b.status = 'pending' AND b.concurrency_key = p.concurrency_key
            AND b.handler = p.handler AND b.run_after <= UTC_TIMESTAMP(6)
            AND b.queue NOT IN (SELECT name FROM django_dbworker_queuestate WHERE paused)
          ORDER BY b.priority DESC, b.run_after, b.id
          LIMIT 1)
        AND bq.id <> p.id AND {served}))"""


CLAIM_CANDIDATES = Statement(
    "claim_candidates",
    "Lock the next ready rows of some handlers, in any queue, skipping keys at their limit.",
    f"""
SELECT p.id, p.handler, p.concurrency_key, p.concurrency_limit
FROM django_dbworker_workitem AS p FORCE INDEX (dbworker_my_claim_idx)
WHERE p.status = 'pending'
  AND p.run_after <= UTC_TIMESTAMP(6)
  AND p.handler IN ({{handlers}})
  AND p.queue NOT IN (SELECT name FROM django_dbworker_queuestate WHERE paused){_KEY_FILTER}
ORDER BY p.priority DESC, p.run_after, p.id
LIMIT %(limit)s
FOR UPDATE SKIP LOCKED
""",
)

CLAIM_CANDIDATES_IN_QUEUE = Statement(
    "claim_candidates_in_queue",
    "Lock the next ready rows of some handlers in one queue, skipping keys at their limit.",
    f"""
SELECT p.id, p.handler, p.concurrency_key, p.concurrency_limit
FROM django_dbworker_workitem AS p FORCE INDEX (dbworker_my_claim_queue_idx)
WHERE p.queue = %(queue)s
  AND p.status = 'pending'
  AND p.run_after <= UTC_TIMESTAMP(6)
  AND p.handler IN ({{handlers}})
  AND p.queue NOT IN (SELECT name FROM django_dbworker_queuestate WHERE paused){_KEY_FILTER}{
        _best_of_its_key("bq.queue <> %(queue)s")
    }
ORDER BY p.priority DESC, p.run_after, p.id
LIMIT %(limit)s
FOR UPDATE SKIP LOCKED
""",
)

CLAIM_CANDIDATES_IN_QUEUES = Statement(
    "claim_candidates_in_queues",
    "Lock the next ready rows of some handlers in several queues, skipping keys at their limit.",
    f"""
SELECT p.id, p.handler, p.concurrency_key, p.concurrency_limit
FROM django_dbworker_workitem AS p FORCE INDEX (dbworker_my_claim_idx)
WHERE p.status = 'pending'
  AND p.run_after <= UTC_TIMESTAMP(6)
  AND p.handler IN ({{handlers}})
  AND p.queue IN ({{queues}})
  AND p.queue NOT IN (SELECT name FROM django_dbworker_queuestate WHERE paused){_KEY_FILTER}{
        _best_of_its_key("bq.queue NOT IN ({queues})")
    }
ORDER BY p.priority DESC, p.run_after, p.id
LIMIT %(limit)s
FOR UPDATE SKIP LOCKED
""",
)

LOCK_FLOW_LOCKS = Statement(
    "lock_flow_locks",
    "Lock the FlowLock rows of some keys, in name order, until the transaction ends.",
    """
SELECT name FROM django_dbworker_flowlock
WHERE name IN ({names})
ORDER BY name
FOR UPDATE
""",
)

# Only names LOCK_FLOW_LOCKS did not find; locked by the insert itself. A
# name another claimer inserted meanwhile is ignored here and locked by
# LOCK_FLOW_LOCKS again (a deadlock on a key's first use is retried).
INSERT_FLOW_LOCKS = Statement(
    "insert_flow_locks",
    "Create the FlowLock rows of some keys that have none yet.",
    """
INSERT IGNORE INTO django_dbworker_flowlock (name) VALUES {rows}
""",
)

# One row per pair asked, named by the values sent (not by a group's first
# row): the claim reads a missing pair as full.
COUNT_KEY_SLOTS = Statement(
    "count_key_slots",
    "The claimed rows of some (handler, concurrency_key) pairs: the slots they hold.",
    """
SELECT k.handler, k.concurrency_key,
       (SELECT count(*)
        FROM django_dbworker_workitem AS h FORCE INDEX (dbworker_key_slots_idx)
        WHERE h.handler = k.handler AND h.concurrency_key = k.concurrency_key
          AND h.status = 'claimed')
FROM ({pairs}) AS k
""",
)

# Every statement that finds rows by id names the primary key: the status
# index looks cheaper to the optimizer when few rows are pending or claimed,
# and a locking read through it would wait on (and deadlock with) rows that
# other workers hold, instead of taking exactly its own rows in id order.
# The rows are locked by this transaction: the status test only restates it.
CLAIM_UPDATE = Statement(
    "claim_update",
    "Mark the locked rows claimed: new token, worker, times, one more attempt.",
    """
UPDATE django_dbworker_workitem FORCE INDEX (PRIMARY)
SET status = 'claimed',
    attempts = attempts + 1,
    claimed_at = UTC_TIMESTAMP(6),
    heartbeat_at = UTC_TIMESTAMP(6),
    updated_at = UTC_TIMESTAMP(6),
    claimed_by = %(worker)s,
    claim_token = REPLACE(UUID(), '-', '')
WHERE id IN ({ids})
  AND status = 'pending'
ORDER BY id
""",
)

CLAIM_READ = Statement(
    "claim_read",
    "Read back the rows this transaction just claimed.",
    """
SELECT id, handler, queue, payload, priority, run_after, attempts,
       max_attempts, claimed_by, claim_token, trace_context, batch_id, has_dependents,
       concurrency_key, fair_key
FROM django_dbworker_workitem FORCE INDEX (PRIMARY)
WHERE id IN ({ids})
  AND status = 'claimed'
""",
)

# The status is read, not filtered on: a filter could make the optimizer
# pick the status index (see above).
SUCCEED_LOCK = Statement(
    "succeed_lock",
    "Lock the rows of a batch of successes in id order; read their status and token.",
    """
SELECT id, status, claim_token, has_dependents FROM django_dbworker_workitem FORCE INDEX (PRIMARY)
WHERE id IN ({ids})
ORDER BY id
FOR UPDATE
""",
)

# Each row gets its own result; the token test repeats the fence that the
# locked read checked (tokens are unique, so IN cannot pair them wrongly).
SUCCEED_UPDATE = Statement(
    "succeed_update",
    "Record the successes of the locked attempts still held, each with its own result.",
    """
UPDATE django_dbworker_workitem FORCE INDEX (PRIMARY)
SET status = 'succeeded',
    result = CASE id {cases} END,
    finished_at = UTC_TIMESTAMP(6),
    updated_at = UTC_TIMESTAMP(6),
    last_error = ''
WHERE id IN ({ids})
  AND claim_token IN ({tokens})
  AND status = 'claimed'
ORDER BY id
""",
)

# The heartbeat locks the attempts' rows in id order, as every bulk writer
# does (``lock_rows``), and reads in the same statement which are still
# claimed and which an operator asked to stop; the UPDATE of their
# heartbeat_at follows in the same transaction. MySQL has no UPDATE ...
# RETURNING, and the locking read was paid for anyway.
HEARTBEAT_LOCK = Statement(
    "heartbeat_lock",
    "Lock the claimed rows of some attempts in id order; read their tokens and cancel requests.",
    """
SELECT id, claim_token, cancel_requested_at IS NOT NULL
FROM django_dbworker_workitem FORCE INDEX (PRIMARY)
WHERE id IN ({ids})
  AND status = 'claimed'
ORDER BY id
FOR UPDATE
""",
)

LOCK_ROWS = Statement(
    "lock_rows",
    "Lock rows by id in ascending id order, before a bulk UPDATE of the ORM changes them.",
    """
SELECT id FROM django_dbworker_workitem FORCE INDEX (PRIMARY)
WHERE id IN ({ids})
ORDER BY id
FOR UPDATE
""",
)

# MariaDB returns the inserted rows (INSERT ... RETURNING, 10.5+), in the
# order of the VALUES list; MySQL 8 cannot, and keeps Django's bulk_create.
# The shared values are named once and repeated by name in every row: the
# driver quotes each parameter once, whatever the batch size.
INSERT_ITEMS = Statement(
    "insert_items",
    "Insert pending rows sharing all but their payloads; return their ids and times.",
    """
INSERT INTO django_dbworker_workitem (
    handler, queue, payload, status, priority, run_after, attempts, max_attempts,
    claimed_by, last_error, trace_context, concurrency_key, concurrency_limit, fair_key,
    created_at, updated_at)
VALUES {rows}
RETURNING id, run_after, created_at, updated_at
""",
)

#: One row of ``INSERT_ITEMS``; ``{n}`` numbers its payload parameter.
INSERT_ROW = (
    "(%(handler)s, %(queue)s, %(payload_{n})s, 'pending', %(priority)s, "
    "COALESCE(%(run_at)s, UTC_TIMESTAMP(6) + INTERVAL %(delay_us)s MICROSECOND), "
    "0, %(max_attempts)s, '', '', %(trace_context)s, %(concurrency_key)s, "
    "%(concurrency_limit)s, %(fair_key)s, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6))"
)

# MySQL and MariaDB read DISTINCT on the leading column of an index by a
# loose index scan (one probe per value) on their own, from
# dbworker_my_queue_idx (not from dbworker_queue_idx: MariaDB does not
# loose-scan an index with a descending part).
DISTINCT_QUEUES = Statement(
    "distinct_queues",
    "Every queue name in the table, by a loose index scan (one index probe per queue).",
    """
SELECT DISTINCT queue FROM django_dbworker_workitem ORDER BY queue
""",
)

# {query} is the ORM's SQL for the queryset being paged (the admin's filters).
ESTIMATE_COUNT = Statement(
    "estimate_count",
    "The optimizer's row estimate for a query, without running it.",
    """
EXPLAIN {query}
""",
)

SERVER_SETTINGS = Statement(
    "server_settings",
    "Whether the binary log is on, and its format (for the replication check).",
    """
SELECT @@log_bin, @@binlog_format
""",
)


# Rendered once per list length: a worker claims with the same filters and
# similar batch sizes thousands of times a minute.
@lru_cache(maxsize=256)
def claim_select_sql(handlers: int, queues: int) -> str:
    """The claim's SELECT for ``handlers`` handler names and ``queues`` queue names (0: any)."""
    if queues == 0:
        return CLAIM_SELECT.render(handlers=numbered("handler", handlers))
    if queues == 1:
        return CLAIM_SELECT_IN_QUEUE.render(handlers=numbered("handler", handlers))
    return CLAIM_SELECT_IN_QUEUES.render(
        handlers=numbered("handler", handlers), queues=numbered("queue", queues)
    )


@lru_cache(maxsize=256)
def fair_claim_sql(sql: str, turn: Turn | None) -> str:
    """A claim's SELECT (plain or keyed candidates) narrowed to one turn of the fair
    rotation: by ``dbworker_fair_idx`` (the key, then claim order) instead of the claim
    indexes, which would read every other key's rows first. None: ``sql`` as it is."""
    if turn is None:
        return sql
    for index in ("dbworker_my_claim_idx", "dbworker_my_claim_queue_idx"):
        sql = sql.replace(f"FORCE INDEX ({index})", "FORCE INDEX (dbworker_fair_idx)", 1)
    return fair_filtered(sql, turn)


@lru_cache(maxsize=256)
def claim_candidates_sql(handlers: int, queues: int, limited: int) -> str:
    """The keyed claim's candidates for ``handlers`` and ``queues`` names (0: any queue).

    ``limited``: how many handlers declare a limit now (``limited_<i>`` -> ``limit_<i>``).
    """
    keys = {
        "limited": numbered("limited", limited),
        "limits": " ".join(f"WHEN %(limited_{i})s THEN %(limit_{i})s" for i in range(limited)),
        "handlers": numbered("handler", handlers),
    }
    if queues == 0:
        return CLAIM_CANDIDATES.render(**keys)
    if queues == 1:
        return CLAIM_CANDIDATES_IN_QUEUE.render(**keys)
    return CLAIM_CANDIDATES_IN_QUEUES.render(**keys, queues=numbered("queue", queues))


@lru_cache(maxsize=256)
def lock_flow_locks_sql(names: int) -> str:
    return LOCK_FLOW_LOCKS.render(names=numbered("name", names))


@lru_cache(maxsize=256)
def insert_flow_locks_sql(names: int) -> str:
    return INSERT_FLOW_LOCKS.render(rows=", ".join(f"(%(name_{i})s)" for i in range(names)))


@lru_cache(maxsize=256)
def count_key_slots_sql(pairs: int) -> str:
    return COUNT_KEY_SLOTS.render(
        pairs=" UNION ALL ".join(
            f"SELECT %(handler_{i})s AS handler, %(key_{i})s AS concurrency_key"
            for i in range(pairs)
        )
    )


@lru_cache(maxsize=256)
def claim_update_sql(rows: int) -> str:
    return CLAIM_UPDATE.render(ids=numbered("id", rows))


@lru_cache(maxsize=256)
def claim_read_sql(rows: int) -> str:
    return CLAIM_READ.render(ids=numbered("id", rows))


@lru_cache(maxsize=256)
def succeed_lock_sql(rows: int) -> str:
    return SUCCEED_LOCK.render(ids=numbered("id", rows))


@lru_cache(maxsize=256)
def succeed_update_sql(rows: int) -> str:
    cases = " ".join(f"WHEN %(id_{i})s THEN %(result_{i})s" for i in range(rows))
    return SUCCEED_UPDATE.render(
        cases=cases, ids=numbered("id", rows), tokens=numbered("token", rows)
    )


@lru_cache(maxsize=256)
def heartbeat_lock_sql(rows: int) -> str:
    return HEARTBEAT_LOCK.render(ids=numbered("id", rows))


@lru_cache(maxsize=256)
def lock_rows_sql(rows: int) -> str:
    return LOCK_ROWS.render(ids=numbered("id", rows))


@lru_cache(maxsize=16)
def insert_items_sql(rows: int) -> str:
    return INSERT_ITEMS.render(rows=", ".join(INSERT_ROW.format(n=n) for n in range(rows)))


def insert_chunks(payloads: Sequence[str | None]) -> Iterator[Sequence[str | None]]:
    """``payloads`` in runs of at most INSERT_ROWS rows and about INSERT_BYTES of JSON.

    One statement must fit in the server's ``max_allowed_packet`` (16 MiB by
    default on MariaDB, 64 MiB on MySQL 8); a row on its own always goes.
    """
    start = size = 0
    for index, payload in enumerate(payloads):
        length = len(payload or "") + INSERT_ROW_BYTES
        if index > start and (index - start >= INSERT_ROWS or size + length > INSERT_BYTES):
            yield payloads[start:index]
            start, size = index, 0
        size += length
    if start < len(payloads):
        yield payloads[start:]
