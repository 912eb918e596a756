"""The concurrency_key index of the admin's exact search by concurrency key.

Partial: rows with a key that are not pending. Rows without a key cost
nothing, and no claim (which reads pending rows only) can be planned on it;
the search finds pending keyed rows through the keyed claim's own index.
On PostgreSQL the index is built with CREATE INDEX CONCURRENTLY: on a work
table of millions of rows a plain CREATE INDEX would block every write
(claims, outcomes, enqueues) until it is built. CONCURRENTLY cannot run in
a transaction, hence ``atomic = False``; other databases get a plain
CREATE INDEX (on MariaDB and MySQL without its condition, which they do not
support: an index of every row's key, NULL included).
(django.contrib.postgres is imported only on PostgreSQL: it needs psycopg,
which a SQLite-only install does not have.)
"""

from django.db import migrations, models


class AddIndexConcurrentlyOnPostgres(migrations.AddIndex):
    def _on(self, schema_editor):
        """The operation that builds the index on this database: CONCURRENTLY on PostgreSQL."""
        if schema_editor.connection.vendor != "postgresql":
            return super()
        from django.contrib.postgres.operations import AddIndexConcurrently

        return AddIndexConcurrently(self.model_name, self.index)

    def database_forwards(self, app_label, schema_editor, from_state, to_state):
        self._on(schema_editor).database_forwards(app_label, schema_editor, from_state, to_state)

    def database_backwards(self, app_label, schema_editor, from_state, to_state):
        self._on(schema_editor).database_backwards(app_label, schema_editor, from_state, to_state)


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("django_dbworker", "0001_initial"),
    ]

    operations = [
        AddIndexConcurrentlyOnPostgres(
            model_name="workitem",
            index=models.Index(
                condition=models.Q(
                    ("concurrency_key__isnull", False),
                    models.Q(("status", "pending"), _negated=True),
                ),
                fields=["concurrency_key"],
                name="dbworker_concurrency_key_idx",
            ),
        ),
    ]
