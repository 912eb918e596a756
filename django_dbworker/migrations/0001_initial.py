"""The tables of django-dbworker 0.1, in one migration (development history squashed).

Django builds the tables from the models; what Django cannot say about them is added
here, per database, in SQL written out (a migration is history: it must not change when
the package does):

- **MySQL and MariaDB** have no partial indexes and no conditional unique constraints:
  Django builds WorkItem's partial indexes without their condition (system check
  models.W037), skips the conditional unique constraint (W036), and on MariaDB the claim
  indexes, whose descending priority is an expression to Django (W043). So:
  ``dbworker_my_claim_idx`` and ``dbworker_my_claim_queue_idx`` hold the claim's WHERE
  and ORDER BY (``LIMIT n FOR UPDATE SKIP LOCKED`` reads and locks n rows in claim order
  and stops, where a filesort would lock every ready row it read); descending index
  parts need MySQL 8 or MariaDB 10.8 (10.6 and 10.7 build an ascending index: correct,
  slower on a large backlog). ``dbworker_my_stale_idx`` serves the stale scan,
  ``dbworker_my_queue_idx`` the admin's list of queues (a loose index scan). A virtual
  generated column ``active_unique_key`` (handler, NUL, unique_key while the row is
  pending or claimed; NULL otherwise) with the unique index
  ``dbworker_my_active_key_uniq`` refuses a second live row with the same key, race-free,
  as the partial unique index does elsewhere; Django's model never reads or writes it.
  Names compared by the claims, pauses, locks and rate windows (handler, queue,
  unique_key, concurrency_key, the flow lock, queue state and rate start names) are in
  a binary NO PAD collation (``utf8mb4_nopad_bin`` on MariaDB, ``utf8mb4_0900_bin`` on
  MySQL 8): byte for byte, so ``"echo"``, ``"Echo"`` and ``"echo "`` differ, as on
  PostgreSQL and SQLite. A later ``AlterField`` of these columns must keep it.
- **PostgreSQL**'s keyed claim reads two partial indexes of pending rows:
  ``dbworker_key_pending_idx`` orders a key's pending rows as the claim does, so that
  the claim finds each pending key and its first ready rows in one descent;
  ``dbworker_claim_unkeyed_idx`` holds the rows without a key by handler. Other
  databases keep their claims and get neither.

No foreign key constraint links a work item to its batch or a dependency to its items:
an enqueue into a batch and a finisher locking the batch row must not wait on each
other's key locks, and pruning deletes work items without touching their batch.

Databases migrated by a development version (migrations 0001-0012 before the squash):
see docs/upgrading.md.
"""

import django.db.models.deletion
import django.db.models.functions.datetime
from django.db import migrations, models

WORK_ITEMS = "django_dbworker_workitem"

MYSQL_WORK_ITEMS = [
    f"""ALTER TABLE {WORK_ITEMS}
    MODIFY handler VARCHAR(200) CHARACTER SET utf8mb4 COLLATE {{collation}} NOT NULL,
    MODIFY queue VARCHAR(100) CHARACTER SET utf8mb4 COLLATE {{collation}} NOT NULL,
    MODIFY unique_key VARCHAR(255) CHARACTER SET utf8mb4 COLLATE {{collation}} NULL,
    MODIFY concurrency_key VARCHAR(200) CHARACTER SET utf8mb4 COLLATE {{collation}} NULL""",
    f"""ALTER TABLE {WORK_ITEMS}
    ADD COLUMN active_unique_key VARBINARY(2048)
        GENERATED ALWAYS AS (
            CASE WHEN status IN ('pending', 'claimed')
                 THEN CONCAT(handler, X'00', unique_key) END
        ) VIRTUAL,
    ADD UNIQUE INDEX dbworker_my_active_key_uniq (active_unique_key)""",
    f"CREATE INDEX dbworker_my_claim_idx ON {WORK_ITEMS} (status, priority DESC, run_after, id)",
    f"CREATE INDEX dbworker_my_claim_queue_idx ON {WORK_ITEMS} "
    "(queue, status, priority DESC, run_after, id)",
    f"CREATE INDEX dbworker_my_stale_idx ON {WORK_ITEMS} (status, heartbeat_at)",
    f"CREATE INDEX dbworker_my_queue_idx ON {WORK_ITEMS} (queue)",
]

MYSQL_FLOW_NAMES = [
    """ALTER TABLE django_dbworker_flowlock
    MODIFY name VARCHAR(255) CHARACTER SET utf8mb4 COLLATE {collation} NOT NULL""",
    """ALTER TABLE django_dbworker_queuestate
    MODIFY name VARCHAR(100) CHARACTER SET utf8mb4 COLLATE {collation} NOT NULL""",
    """ALTER TABLE django_dbworker_ratestart
    MODIFY handler VARCHAR(200) CHARACTER SET utf8mb4 COLLATE {collation} NOT NULL""",
]

POSTGRESQL_WORK_ITEMS = [
    f"CREATE INDEX dbworker_key_pending_idx ON {WORK_ITEMS} "
    "(handler, concurrency_key, priority DESC, run_after, id) "
    "WHERE status = 'pending' AND concurrency_key IS NOT NULL",
    f"CREATE INDEX dbworker_claim_unkeyed_idx ON {WORK_ITEMS} "
    "(handler, priority DESC, run_after, id) "
    "WHERE status = 'pending' AND concurrency_key IS NULL",
]


def _run(schema_editor, table, statements):
    connection = schema_editor.connection
    if table not in connection.introspection.table_names():
        return  # a database the routers keep these tables off
    collation = ""
    if connection.vendor == "mysql":
        collation = "utf8mb4_nopad_bin" if connection.mysql_is_mariadb else "utf8mb4_0900_bin"
    for sql in statements.get(connection.vendor, ()):
        schema_editor.execute(sql.replace("{collation}", collation))


def work_items(apps, schema_editor):
    _run(
        schema_editor,
        WORK_ITEMS,
        {"mysql": MYSQL_WORK_ITEMS, "postgresql": POSTGRESQL_WORK_ITEMS},
    )


def flow_names(apps, schema_editor):
    _run(schema_editor, "django_dbworker_queuestate", {"mysql": MYSQL_FLOW_NAMES})


class Migration(migrations.Migration):

    initial = True

    dependencies = [
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
            name='PeriodicSchedule',
            fields=[
                ('name', models.CharField(max_length=200, primary_key=True, serialize=False)),
                ('last_slot', models.DateTimeField(blank=True, null=True)),
                ('last_item_id', models.BigIntegerField(blank=True, null=True)),
                ('skipped', models.PositiveIntegerField(default=0)),
                ('created_at', models.DateTimeField(db_default=django.db.models.functions.datetime.Now())),
                ('updated_at', models.DateTimeField(db_default=django.db.models.functions.datetime.Now())),
            ],
            options={
                'verbose_name': 'schedule',
                'verbose_name_plural': 'schedules',
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
            name='Batch',
            fields=[
                ('id', models.BigAutoField(primary_key=True, serialize=False)),
                ('on_complete', models.CharField(max_length=200)),
                ('queue', models.CharField(default='default', max_length=100)),
                ('max_attempts', models.PositiveIntegerField(default=1)),
                ('payload', models.JSONField(blank=True, default=dict)),
                ('total', models.PositiveIntegerField(default=0)),
                ('sealed_at', models.DateTimeField(blank=True, null=True)),
                ('completed_at', models.DateTimeField(blank=True, null=True)),
                ('succeeded', models.PositiveIntegerField(default=0)),
                ('failed', models.PositiveIntegerField(default=0)),
                ('cancelled', models.PositiveIntegerField(default=0)),
                ('callback_id', models.BigIntegerField(blank=True, null=True)),
                ('created_at', models.DateTimeField(db_default=django.db.models.functions.datetime.Now())),
            ],
            options={
                'verbose_name': 'batch',
                'verbose_name_plural': 'batches',
                'indexes': [models.Index(condition=models.Q(('completed_at__isnull', True)), fields=['completed_at'], name='dbworker_open_batch_idx')],
            },
        ),
        migrations.CreateModel(
            name='RateStart',
            fields=[
                ('id', models.BigAutoField(primary_key=True, serialize=False)),
                ('handler', models.CharField(max_length=200)),
                ('started_at', models.DateTimeField(db_default=django.db.models.functions.datetime.Now())),
                ('count', models.PositiveIntegerField(db_default=1, default=1)),
            ],
            options={
                'verbose_name': 'rate-limited start',
                'verbose_name_plural': 'rate-limited starts',
                'indexes': [models.Index(fields=['handler', 'started_at'], name='dbworker_rate_start_idx')],
            },
        ),
        migrations.CreateModel(
            name='WorkItem',
            fields=[
                ('id', models.BigAutoField(primary_key=True, serialize=False)),
                ('handler', models.CharField(max_length=200)),
                ('queue', models.CharField(default='default', max_length=100)),
                ('payload', models.JSONField(blank=True, null=True)),
                ('status', models.CharField(choices=[('pending', 'Pending'), ('claimed', 'Claimed'), ('succeeded', 'Succeeded'), ('failed', 'Failed'), ('cancelled', 'Cancelled')], default='pending', max_length=16)),
                ('priority', models.SmallIntegerField(default=0)),
                ('run_after', models.DateTimeField(db_default=django.db.models.functions.datetime.Now())),
                ('attempts', models.PositiveIntegerField(default=0)),
                ('max_attempts', models.PositiveIntegerField()),
                ('claimed_at', models.DateTimeField(blank=True, null=True)),
                ('heartbeat_at', models.DateTimeField(blank=True, null=True)),
                ('claimed_by', models.CharField(blank=True, default='', max_length=255)),
                ('claim_token', models.UUIDField(blank=True, null=True)),
                ('finished_at', models.DateTimeField(blank=True, null=True)),
                ('last_error', models.TextField(blank=True, default='')),
                ('error_history', models.JSONField(blank=True, editable=False, null=True)),
                ('result', models.JSONField(blank=True, null=True)),
                ('unique_key', models.CharField(blank=True, max_length=255, null=True)),
                ('trace_context', models.JSONField(blank=True, default=dict)),
                ('concurrency_key', models.CharField(blank=True, max_length=200, null=True)),
                ('concurrency_limit', models.PositiveIntegerField(blank=True, null=True)),
                ('snoozes', models.PositiveIntegerField(db_default=0, default=0)),
                ('cancel_requested_at', models.DateTimeField(blank=True, null=True)),
                ('waiting', models.BooleanField(db_default=False, default=False)),
                ('has_dependents', models.BooleanField(db_default=False, default=False)),
                ('created_at', models.DateTimeField(db_default=django.db.models.functions.datetime.Now())),
                ('updated_at', models.DateTimeField(db_default=django.db.models.functions.datetime.Now())),
                ('batch', models.ForeignKey(blank=True, db_constraint=False, db_index=False, null=True, on_delete=django.db.models.deletion.DO_NOTHING, related_name='items', to='django_dbworker.batch')),
            ],
            options={
                'verbose_name': 'work item',
                'verbose_name_plural': 'work items',
            },
        ),
        migrations.CreateModel(
            name='Dependency',
            fields=[
                ('id', models.BigAutoField(primary_key=True, serialize=False)),
                ('child', models.ForeignKey(db_constraint=False, on_delete=django.db.models.deletion.DO_NOTHING, related_name='parent_links', to='django_dbworker.workitem')),
                ('parent', models.ForeignKey(db_constraint=False, on_delete=django.db.models.deletion.DO_NOTHING, related_name='child_links', to='django_dbworker.workitem')),
            ],
            options={
                'verbose_name': 'dependency',
                'verbose_name_plural': 'dependencies',
            },
        ),
        migrations.CreateModel(
            name='ClaimedWorkItem',
            fields=[
            ],
            options={
                'verbose_name': 'claimed work item',
                'verbose_name_plural': 'claimed work items',
                'proxy': True,
                'indexes': [],
                'constraints': [],
            },
            bases=('django_dbworker.workitem',),
        ),
        migrations.CreateModel(
            name='FailedWorkItem',
            fields=[
            ],
            options={
                'verbose_name': 'failed work item',
                'verbose_name_plural': 'failed work items',
                'proxy': True,
                'indexes': [],
                'constraints': [],
            },
            bases=('django_dbworker.workitem',),
        ),
        migrations.CreateModel(
            name='QueueSummary',
            fields=[
            ],
            options={
                'verbose_name': 'queue summary',
                'verbose_name_plural': 'queue summary',
                'proxy': True,
                'indexes': [],
                'constraints': [],
            },
            bases=('django_dbworker.workitem',),
        ),
        migrations.AddIndex(
            model_name='workitem',
            index=models.Index(models.OrderBy(models.F('priority'), descending=True), models.F('run_after'), models.F('id'), condition=models.Q(('status', 'pending')), name='dbworker_claim_idx'),
        ),
        migrations.AddIndex(
            model_name='workitem',
            index=models.Index(models.F('queue'), models.OrderBy(models.F('priority'), descending=True), models.F('run_after'), models.F('id'), condition=models.Q(('status', 'pending')), name='dbworker_claim_queue_idx'),
        ),
        migrations.AddIndex(
            model_name='workitem',
            index=models.Index(condition=models.Q(('status', 'claimed')), fields=['heartbeat_at'], name='dbworker_stale_idx'),
        ),
        migrations.AddIndex(
            model_name='workitem',
            index=models.Index(condition=models.Q(('status', 'pending'), _negated=True), fields=['status', '-id'], name='dbworker_status_idx'),
        ),
        migrations.AddIndex(
            model_name='workitem',
            index=models.Index(fields=['queue', '-id'], name='dbworker_queue_idx'),
        ),
        migrations.AddIndex(
            model_name='workitem',
            index=models.Index(condition=models.Q(('status', 'pending'), _negated=True), fields=['handler', '-id'], name='dbworker_handler_idx'),
        ),
        migrations.AddIndex(
            model_name='workitem',
            index=models.Index(condition=models.Q(('finished_at__isnull', False)), fields=['finished_at'], name='dbworker_finished_idx'),
        ),
        migrations.AddIndex(
            model_name='workitem',
            index=models.Index(condition=models.Q(('unique_key__isnull', False)), fields=['unique_key'], name='dbworker_unique_key_idx'),
        ),
        migrations.AddIndex(
            model_name='workitem',
            index=models.Index(condition=models.Q(('status', 'claimed'), ('concurrency_key__isnull', False)), fields=['handler', 'concurrency_key', 'status'], name='dbworker_key_slots_idx'),
        ),
        migrations.AddIndex(
            model_name='workitem',
            index=models.Index(condition=models.Q(('batch__isnull', False)), fields=['batch', 'status'], name='dbworker_batch_idx'),
        ),
        migrations.AddIndex(
            model_name='workitem',
            index=models.Index(condition=models.Q(('waiting', True)), fields=['waiting'], name='dbworker_waiting_idx'),
        ),
        migrations.AddConstraint(
            model_name='workitem',
            constraint=models.CheckConstraint(condition=models.Q(('priority__gte', -100), ('priority__lte', 100)), name='dbworker_priority_range'),
        ),
        migrations.AddConstraint(
            model_name='workitem',
            constraint=models.UniqueConstraint(condition=models.Q(('status__in', ['pending', 'claimed']), ('unique_key__isnull', False)), fields=('handler', 'unique_key'), name='dbworker_unique_active_key'),
        ),
        migrations.AddConstraint(
            model_name='dependency',
            constraint=models.UniqueConstraint(fields=('child', 'parent'), name='dbworker_dependency_unique'),
        ),
        # After the tables, which these alter; reversed by dropping the tables. The hints
        # let routers that decide by model route each part with its tables.
        migrations.RunPython(
            work_items, migrations.RunPython.noop, atomic=False, elidable=False,
            hints={"model_name": "workitem"},
        ),
        migrations.RunPython(
            flow_names, migrations.RunPython.noop, atomic=False, elidable=False,
            hints={"model_name": "queuestate"},
        ),
    ]
