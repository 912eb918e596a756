"""Flow control: concurrency keys and limits, snoozes, cancel requests, paused queues.

Every new WorkItem column is NULL or has a database default, so the
enqueue statements that name their columns (COPY, multi-row INSERT) need
no change, and PostgreSQL adds them without rewriting a large table. The
slot index is partial (claimed rows with a key) where the database has
partial indexes; on MySQL it covers every row, and stays small in use
because the key is NULL for unlimited work. ``FlowLock`` and ``RateStart``
serialise the claims of one key or rate-limited handler (models.py).

On MySQL/MariaDB, ``concurrency_key`` and ``FlowLock.name`` get the binary
NO PAD collation 0005 gives handler, queue and unique_key
(``utf8mb4_nopad_bin`` on MariaDB, ``utf8mb4_0900_bin`` on MySQL 8): keys
compare byte for byte, so ``"a"``, ``"A"``, ``"Ä"`` and ``"A "`` are four
keys, as on PostgreSQL and SQLite (``utf8mb4_bin`` is PAD SPACE: ``"A "``
would equal ``"A"``). A no-op elsewhere; reversed to the table's default.
The slot index leads with (handler, concurrency_key, status), so MySQL's
count of a key's claimed rows is an index range, not a walk of its history.
"""

import django.db.models.functions.datetime
from django.db import migrations, models

FORWARDS = [
    """ALTER TABLE django_dbworker_workitem
    MODIFY concurrency_key VARCHAR(200) CHARACTER SET utf8mb4 COLLATE {collation} NULL""",
    """ALTER TABLE django_dbworker_flowlock
    MODIFY name VARCHAR(255) CHARACTER SET utf8mb4 COLLATE {collation} NOT NULL""",
]

BACKWARDS = [
    "ALTER TABLE django_dbworker_workitem MODIFY concurrency_key VARCHAR(200) NULL",
    "ALTER TABLE django_dbworker_flowlock MODIFY name VARCHAR(255) NOT NULL",
]


def _run_on_mysql(statements):
    def run(apps, schema_editor):
        connection = schema_editor.connection
        if connection.vendor != "mysql":
            return
        collation = "utf8mb4_nopad_bin" if connection.mysql_is_mariadb else "utf8mb4_0900_bin"
        for sql in statements:
            schema_editor.execute(sql.replace("{collation}", collation))

    return run


class Migration(migrations.Migration):

    dependencies = [
        ('django_dbworker', '0005_mysql_support'),
    ]

    operations = [
        migrations.CreateModel(
            name='FlowLock',
            fields=[
                ('name', models.CharField(max_length=255, primary_key=True, serialize=False)),
            ],
            options={
                'verbose_name': 'flow lock',
                'verbose_name_plural': 'flow locks',
            },
        ),
        migrations.CreateModel(
            name='QueueState',
            fields=[
                ('name', models.CharField(max_length=100, primary_key=True, serialize=False)),
                ('paused', models.BooleanField(default=False)),
                ('paused_at', models.DateTimeField(blank=True, null=True)),
                ('paused_by', models.CharField(blank=True, default='', max_length=255)),
                ('updated_at', models.DateTimeField(db_default=django.db.models.functions.datetime.Now())),
            ],
            options={
                'verbose_name': 'queue',
                'verbose_name_plural': 'queues',
            },
        ),
        migrations.CreateModel(
            name='RateStart',
            fields=[
                ('id', models.BigAutoField(primary_key=True, serialize=False)),
                ('handler', models.CharField(max_length=200)),
                ('started_at', models.DateTimeField(db_default=django.db.models.functions.datetime.Now())),
            ],
            options={
                'verbose_name': 'rate-limited start',
                'verbose_name_plural': 'rate-limited starts',
            },
        ),
        migrations.AddField(
            model_name='workitem',
            name='cancel_requested_at',
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name='workitem',
            name='concurrency_key',
            field=models.CharField(blank=True, max_length=200, null=True),
        ),
        migrations.AddField(
            model_name='workitem',
            name='concurrency_limit',
            field=models.PositiveIntegerField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name='workitem',
            name='snoozes',
            field=models.PositiveIntegerField(db_default=0, default=0),
        ),
        migrations.AddIndex(
            model_name='workitem',
            index=models.Index(condition=models.Q(('status', 'claimed'), ('concurrency_key__isnull', False)), fields=['handler', 'concurrency_key', 'status'], name='dbworker_key_slots_idx'),
        ),
        migrations.AddIndex(
            model_name='ratestart',
            index=models.Index(fields=['handler', 'started_at'], name='dbworker_rate_start_idx'),
        ),
        migrations.RunPython(
            _run_on_mysql(FORWARDS), _run_on_mysql(BACKWARDS), atomic=False, elidable=False
        ),
    ]
