"""MySQL and MariaDB: their own indexes, and unique_key enforced without a partial index.

MySQL has no partial indexes and no conditional unique constraints: Django
builds WorkItem's partial indexes there without their condition (system
check models.W037; the status, handler, finished_at and unique_key indexes
serve the admin as they are), skips the conditional unique constraint
(models.W036), and on MariaDB skips the claim indexes, whose descending
priority is an expression to Django (models.W043). This migration gives
MySQL what those do on PostgreSQL and SQLite, and does nothing on any
other database:

- ``dbworker_my_claim_idx`` ``(status, priority DESC, run_after, id)`` and
  ``dbworker_my_claim_queue_idx`` ``(queue, status, priority DESC,
  run_after, id)``: the claim's WHERE and ORDER BY in one index, so that
  ``LIMIT n FOR UPDATE SKIP LOCKED`` reads (and locks) n rows in claim
  order and stops; a filesort would lock every ready row it read and
  serialise the workers. Descending index parts need MySQL 8 or MariaDB
  10.8; MariaDB 10.6 and 10.7 accept ``DESC`` and build an ascending index,
  and their claims then sort (correct, slower on large backlogs).
- ``dbworker_my_stale_idx`` ``(status, heartbeat_at)``: the stale scan
  (claimed rows only, not every row with a heartbeat).
- ``dbworker_my_queue_idx`` ``(queue)``: the admin's list of queues by a
  loose index scan, which MariaDB does not do on ``dbworker_queue_idx``
  ``(queue, id DESC)``.
- ``active_unique_key``, a virtual generated column holding ``handler``,
  NUL and ``unique_key`` while the row is pending or claimed (NULL
  otherwise, and NULLs never collide), with the unique index
  ``dbworker_my_active_key_uniq``: the database refuses a second live row
  with the same key, race-free, as the partial unique index does on
  PostgreSQL. VARBINARY, so keys compare byte for byte (case and accents
  matter, as on PostgreSQL), whatever the table's collation. Django's
  model does not know the column and never reads or writes it.
- ``handler``, ``queue`` and ``unique_key`` in a binary NO PAD collation
  (``utf8mb4_nopad_bin`` on MariaDB, ``utf8mb4_0900_bin`` on MySQL 8): with
  MySQL's default, case-insensitive collations a claim for handler ``echo``
  would take rows of ``Echo``, and with a PAD SPACE one (``utf8mb4_bin``)
  the lookup of the live row holding unique_key ``"k"`` would find the row
  of ``"k "``. A later ``AlterField`` of these fields on MySQL must keep
  the collation.

The SQL is written out here rather than imported from ``db/mysql.py``: a
migration is history and must not change when the package does.
"""

from django.db import migrations

TABLE = "django_dbworker_workitem"

FORWARDS = [
    f"""ALTER TABLE {TABLE}
    MODIFY handler VARCHAR(200) CHARACTER SET utf8mb4 COLLATE {{collation}} NOT NULL,
    MODIFY queue VARCHAR(100) CHARACTER SET utf8mb4 COLLATE {{collation}} NOT NULL,
    MODIFY unique_key VARCHAR(255) CHARACTER SET utf8mb4 COLLATE {{collation}} NULL""",
    f"""ALTER TABLE {TABLE}
    ADD COLUMN active_unique_key VARBINARY(2048)
        GENERATED ALWAYS AS (
            CASE WHEN status IN ('pending', 'claimed')
                 THEN CONCAT(handler, X'00', unique_key) END
        ) VIRTUAL,
    ADD UNIQUE INDEX dbworker_my_active_key_uniq (active_unique_key)""",
    f"CREATE INDEX dbworker_my_claim_idx ON {TABLE} (status, priority DESC, run_after, id)",
    f"CREATE INDEX dbworker_my_claim_queue_idx ON {TABLE} "
    "(queue, status, priority DESC, run_after, id)",
    f"CREATE INDEX dbworker_my_stale_idx ON {TABLE} (status, heartbeat_at)",
    f"CREATE INDEX dbworker_my_queue_idx ON {TABLE} (queue)",
]

BACKWARDS = [
    f"DROP INDEX dbworker_my_queue_idx ON {TABLE}",
    f"DROP INDEX dbworker_my_stale_idx ON {TABLE}",
    f"DROP INDEX dbworker_my_claim_queue_idx ON {TABLE}",
    f"DROP INDEX dbworker_my_claim_idx ON {TABLE}",
    f"ALTER TABLE {TABLE} DROP INDEX dbworker_my_active_key_uniq, DROP COLUMN active_unique_key",
    f"""ALTER TABLE {TABLE}
    MODIFY handler VARCHAR(200) NOT NULL,
    MODIFY queue VARCHAR(100) NOT NULL,
    MODIFY unique_key VARCHAR(255) NULL""",
]


def _run_on_mysql(statements):
    def run(apps, schema_editor):
        connection = schema_editor.connection
        if connection.vendor != "mysql":
            return
        # Binary and NO PAD: trailing spaces count, as they do on PostgreSQL.
        collation = "utf8mb4_nopad_bin" if connection.mysql_is_mariadb else "utf8mb4_0900_bin"
        for sql in statements:
            schema_editor.execute(sql.replace("{collation}", collation))

    return run


class Migration(migrations.Migration):
    dependencies = [
        ("django_dbworker", "0004_workitem_error_history"),
    ]

    operations = [
        # Not atomic: MySQL cannot roll DDL back, and Django refuses DDL in a
        # transaction there.
        migrations.RunPython(
            _run_on_mysql(FORWARDS), _run_on_mysql(BACKWARDS), atomic=False, elidable=False
        ),
    ]
