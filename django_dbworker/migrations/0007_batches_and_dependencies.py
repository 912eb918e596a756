"""Batches and dependencies: the Batch and Dependency tables, three WorkItem columns.

``batch_id`` is NULL and ``waiting`` / ``has_dependents`` have database
defaults, so the enqueue statements that name their columns (COPY,
multi-row INSERT) need no change and PostgreSQL adds them without
rewriting a large table. No foreign key constraint: an enqueue into a batch
and a finisher locking the batch row must not wait on each other's key
locks, and pruning deletes work items without touching their batch. The
claim statements and indexes do not change: a waiting row is pending with
a ``run_after`` after every real time.
"""

import django.db.models.deletion
import django.db.models.functions.datetime
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('django_dbworker', '0006_flow_control'),
    ]

    operations = [
        migrations.CreateModel(
            name='Dependency',
            fields=[
                ('id', models.BigAutoField(primary_key=True, serialize=False)),
            ],
            options={
                'verbose_name': 'dependency',
                'verbose_name_plural': 'dependencies',
            },
        ),
        migrations.AddField(
            model_name='workitem',
            name='has_dependents',
            field=models.BooleanField(db_default=False, default=False),
        ),
        migrations.AddField(
            model_name='workitem',
            name='waiting',
            field=models.BooleanField(db_default=False, default=False),
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
        migrations.AddField(
            model_name='workitem',
            name='batch',
            field=models.ForeignKey(blank=True, db_constraint=False, db_index=False, null=True, on_delete=django.db.models.deletion.DO_NOTHING, related_name='items', to='django_dbworker.batch'),
        ),
        migrations.AddIndex(
            model_name='workitem',
            index=models.Index(condition=models.Q(('batch__isnull', False)), fields=['batch', 'status'], name='dbworker_batch_idx'),
        ),
        migrations.AddIndex(
            model_name='workitem',
            index=models.Index(condition=models.Q(('waiting', True)), fields=['waiting'], name='dbworker_waiting_idx'),
        ),
        migrations.AddField(
            model_name='dependency',
            name='child',
            field=models.ForeignKey(db_constraint=False, on_delete=django.db.models.deletion.DO_NOTHING, related_name='parent_links', to='django_dbworker.workitem'),
        ),
        migrations.AddField(
            model_name='dependency',
            name='parent',
            field=models.ForeignKey(db_constraint=False, on_delete=django.db.models.deletion.DO_NOTHING, related_name='child_links', to='django_dbworker.workitem'),
        ),
        migrations.AddConstraint(
            model_name='dependency',
            constraint=models.UniqueConstraint(fields=('child', 'parent'), name='dbworker_dependency_unique'),
        ),
    ]
