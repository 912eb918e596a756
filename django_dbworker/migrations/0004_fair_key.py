"""Fair share between tenants: ``WorkItem.fair_key`` and the rotation's ``FairKey`` rows.

Cheap on a big work table: the column is nullable (no row is rewritten), and its index,
``dbworker_fair_idx`` (a key's pending rows in claim order), is built with CREATE INDEX
CONCURRENTLY on PostgreSQL, by migration 0002's operation, so claims, outcomes and
enqueues go on while it is built (hence ``atomic = False``). MySQL and MariaDB build no
partial index: theirs holds the status, made here, with the keys compared byte for byte
as 0001 has the other key columns.
"""

from importlib import import_module

from django.db import migrations, models

import django_dbworker.flow.models

AddIndexConcurrentlyOnPostgres = import_module(
    "django_dbworker.migrations.0002_workitem_dbworker_concurrency_key_idx"
).AddIndexConcurrentlyOnPostgres
_run = import_module("django_dbworker.migrations.0001_initial")._run

MYSQL_FAIR = [
    """ALTER TABLE django_dbworker_workitem
    MODIFY fair_key VARCHAR(200) CHARACTER SET utf8mb4 COLLATE {collation} NULL""",
    """ALTER TABLE django_dbworker_fairkey
    MODIFY `key` VARCHAR(200) CHARACTER SET utf8mb4 COLLATE {collation} NOT NULL""",
    "CREATE INDEX dbworker_fair_idx ON django_dbworker_workitem "
    "(fair_key, status, priority DESC, run_after, id)",
]


def mysql_fair(apps, schema_editor):
    _run(schema_editor, "django_dbworker_workitem", {"mysql": MYSQL_FAIR})


def mysql_fair_backwards(apps, schema_editor):
    _run(
        schema_editor,
        "django_dbworker_workitem",
        {"mysql": ["DROP INDEX dbworker_fair_idx ON django_dbworker_workitem"]},
    )


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ('django_dbworker', '0003_liveworker'),
    ]

    operations = [
        migrations.CreateModel(
            name='FairKey',
            fields=[
                ('key', models.CharField(blank=True, max_length=200, primary_key=True, serialize=False)),
                ('weight', models.FloatField(default=1.0, validators=[django_dbworker.flow.models.fair_weight_validator])),
                ('served', models.FloatField(default=0.0, editable=False)),
                ('started', models.FloatField(default=0.0, editable=False)),
            ],
            options={
                'verbose_name': 'fair key',
                'verbose_name_plural': 'fair keys',
            },
        ),
        migrations.AddField(
            model_name='workitem',
            name='fair_key',
            field=models.CharField(blank=True, max_length=200, null=True),
        ),
        AddIndexConcurrentlyOnPostgres(
            model_name='workitem',
            index=models.Index(models.F('fair_key'), models.OrderBy(models.F('priority'), descending=True), models.F('run_after'), models.F('id'), condition=models.Q(('status', 'pending')), name='dbworker_fair_idx'),
        ),
        migrations.RunPython(mysql_fair, mysql_fair_backwards, elidable=False),
    ]
