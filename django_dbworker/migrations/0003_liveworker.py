"""The register of live workers: one ``LiveWorker`` row per ``run_workers`` process.

For operators only (the admin's Workers page, ``dbworker_stats``); nothing that claims
or recovers items reads it. A new table, on every database; no existing row changes,
and workers of the previous version run beside it untouched.
"""

import django.db.models.functions.datetime
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('django_dbworker', '0002_workitem_dbworker_concurrency_key_idx'),
    ]

    operations = [
        migrations.CreateModel(
            name='LiveWorker',
            fields=[
                ('name', models.CharField(max_length=255, primary_key=True, serialize=False)),
                ('queues', models.JSONField(blank=True, null=True)),
                ('handlers', models.JSONField(blank=True, default=list)),
                ('concurrency', models.PositiveIntegerField(default=0)),
                ('version', models.CharField(blank=True, default='', max_length=50)),
                ('started_at', models.DateTimeField(db_default=django.db.models.functions.datetime.Now())),
                ('heartbeat_at', models.DateTimeField(db_default=django.db.models.functions.datetime.Now())),
            ],
            options={
                'verbose_name': 'worker',
                'verbose_name_plural': 'workers',
            },
        ),
    ]
