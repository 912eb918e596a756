"""The register of live workers: one ``WorkerProcess`` row per ``run_workers`` process.

Workers of the same queues and handlers count each other here to split the keys of
limited handlers (``worker/peers.py``); nothing else reads it yet. A new table, on
every database; no existing row changes.
"""

import django.db.models.functions.datetime
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('django_dbworker', '0009_flow_names_binary'),
    ]

    operations = [
        migrations.CreateModel(
            name='WorkerProcess',
            fields=[
                ('name', models.CharField(max_length=255, primary_key=True, serialize=False)),
                ('pool', models.CharField(max_length=64)),
                ('queues', models.JSONField(blank=True, null=True)),
                ('threads', models.PositiveIntegerField(default=1)),
                ('started_at', models.DateTimeField(db_default=django.db.models.functions.datetime.Now())),
                ('seen_at', models.DateTimeField(db_default=django.db.models.functions.datetime.Now())),
            ],
            options={
                'verbose_name': 'worker process',
                'verbose_name_plural': 'worker processes',
            },
        ),
    ]
