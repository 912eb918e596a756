"""MySQL/MariaDB: paused queues' names and rate-limited handlers' names compare byte for byte.

0005 gave ``WorkItem.handler`` and ``queue`` the binary NO PAD collation, and 0006 gave it
to ``concurrency_key`` and ``FlowLock.name``, but not to ``QueueState.name`` or
``RateStart.handler``, which kept the table's case-insensitive default. So on MySQL, with
queue ``reports`` paused, ``pause_queue("Reports")`` answered ``reports``' state and left
``Reports`` running, ``resume_queue("reports")`` could resume ``Reports``, and handlers
``s14_rated`` and ``S14_RATED`` counted (and pruned) one rate window. Now they are
different names, as in the claims and on PostgreSQL and SQLite
(``tests/integration/test_pause_and_rate.py``). Two rows that differ only in case could
not have been stored before, so nothing existing collides. A no-op elsewhere; reversed
to the table's default.
"""

from django.db import migrations

FORWARDS = [
    """ALTER TABLE django_dbworker_queuestate
    MODIFY name VARCHAR(100) CHARACTER SET utf8mb4 COLLATE {collation} NOT NULL""",
    """ALTER TABLE django_dbworker_ratestart
    MODIFY handler VARCHAR(200) CHARACTER SET utf8mb4 COLLATE {collation} NOT NULL""",
]

BACKWARDS = [
    "ALTER TABLE django_dbworker_queuestate MODIFY name VARCHAR(100) NOT NULL",
    "ALTER TABLE django_dbworker_ratestart MODIFY handler VARCHAR(200) NOT NULL",
]


def _run_on_mysql(statements):
    def run(apps, schema_editor):
        connection = schema_editor.connection
        if connection.vendor != "mysql":
            return
        if "django_dbworker_queuestate" not in connection.introspection.table_names():
            return  # a database the routers keep the work tables off
        collation = "utf8mb4_nopad_bin" if connection.mysql_is_mariadb else "utf8mb4_0900_bin"
        for sql in statements:
            schema_editor.execute(sql.replace("{collation}", collation))

    return run


class Migration(migrations.Migration):
    dependencies = [
        ("django_dbworker", "0008_key_heads"),
    ]

    # The hint lets routers that decide by model route this as the flow tables' own.
    operations = [
        migrations.RunPython(
            _run_on_mysql(FORWARDS),
            _run_on_mysql(BACKWARDS),
            atomic=False,
            elidable=False,
            hints={"model_name": "queuestate"},
        ),
    ]
