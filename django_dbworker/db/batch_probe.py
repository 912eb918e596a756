"""A batch finisher's quick answer to "am I possibly the last?", per vendor.

A finisher of batch items (``completion.complete_batches``) that finds one
of the batch's items still ``pending`` and not locked by anybody, and
share-locks it until its own commit, is not the last: that item's own
ending comes after this commit (it cannot be claimed or cancelled while
the share lock is held), and that ending's check sees this one. So only
the finishers that find no such item take the batch row's lock, and a
batch of 10,000 items is not one hot row that serialises every success
write of every worker: its lock is taken when the batch is nearly done.

``SKIP LOCKED`` matters: an item a claimer or a canceller holds right now
is skipped, since its ending may be under way in a transaction that would
not see this one. SQLite has a single writer: the finisher holds the
write lock from its final-state write to its commit, so any later ending
sees it, and a plain read is enough.
"""

from __future__ import annotations

from django.db import connections

from django_dbworker.db.sql import Statement

# PostgreSQL's and MySQL 8's spelling; MySQL 8's LOCK IN SHARE MODE takes no SKIP LOCKED.
HOLD_PENDING_FOR_SHARE = Statement(
    "hold_batch_pending",
    "Share-lock one pending, unlocked item of a batch until commit (a later ending sees us).",
    """
SELECT id FROM django_dbworker_workitem
WHERE batch_id = %(batch)s AND status = 'pending'
LIMIT 1
FOR SHARE SKIP LOCKED
""",
)

# MariaDB's shared locking read is spelled LOCK IN SHARE MODE (SKIP LOCKED since 10.6).
HOLD_PENDING_MARIADB = Statement(
    "hold_batch_pending",
    "Share-lock one pending, unlocked item of a batch until commit (a later ending sees us).",
    """
SELECT id FROM django_dbworker_workitem
WHERE batch_id = %(batch)s AND status = 'pending'
LIMIT 1
LOCK IN SHARE MODE SKIP LOCKED
""",
)

PENDING_SQLITE = Statement(
    "hold_batch_pending",
    "Whether a batch has a pending item (the single writer orders every ending after us).",
    """
SELECT id FROM django_dbworker_workitem
WHERE batch_id = %(batch)s AND status = 'pending'
LIMIT 1
""",
)


def _statement(using: str) -> Statement:
    connection = connections[using]
    if connection.vendor == "sqlite":
        return PENDING_SQLITE
    if getattr(connection, "mysql_is_mariadb", False):
        return HOLD_PENDING_MARIADB
    return HOLD_PENDING_FOR_SHARE


def holds_a_pending_item(batch_id: int, using: str) -> bool:
    """Share-lock (to commit) one pending item of the batch nobody holds; True if found.

    Call it in the finisher's transaction, after its final-state writes.
    """
    with connections[using].cursor() as cursor:
        cursor.execute(_statement(using).sql, {"batch": batch_id})
        return cursor.fetchone() is not None
