"""PostgreSQL's key-driven claim: two partial indexes of pending rows.

``dbworker_key_pending_idx`` orders a key's pending rows as the claim does, so that
the keyed claim finds each pending key, and its first ready rows, in one descent
(``postgresql_keyed_sql._HEADS``) instead of walking every ready row of the keys at
their limit. ``dbworker_claim_unkeyed_idx`` holds the rows without a key by handler:
that claim asks it whether its handlers have one ready (then it walks), without reading
other handlers' rows. Both hold pending rows only, so a
claim or an ending never adds to them; the plain claim cannot use either (its
conditions do not imply theirs). Built CONCURRENTLY (no write lock on a big table);
other databases keep their claims and get neither.
"""

from django.db import migrations

INDEXES = {
    "dbworker_key_pending_idx": (
        "(handler, concurrency_key, priority DESC, run_after, id) "
        "WHERE status = 'pending' AND concurrency_key IS NOT NULL"
    ),
    "dbworker_claim_unkeyed_idx": (
        "(handler, priority DESC, run_after, id) "
        "WHERE status = 'pending' AND concurrency_key IS NULL"
    ),
}


def create(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    if "django_dbworker_workitem" not in schema_editor.connection.introspection.table_names():
        return  # a database the routers keep the work table off
    for name, definition in INDEXES.items():
        with schema_editor.connection.cursor() as cursor:
            cursor.execute(
                "SELECT i.indisvalid FROM pg_index AS i JOIN pg_class AS c ON c.oid = i.indexrelid"
                " WHERE c.relname = %s",
                [name],
            )
            found = cursor.fetchone()
        if found is not None and not found[0]:
            # A concurrent build that failed (a migrate interrupted) leaves an invalid index
            # that every write still maintains and no claim uses: build it anew.
            schema_editor.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {name}")
        schema_editor.execute(
            f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {name} "
            f"ON django_dbworker_workitem {definition}"
        )


def drop(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    for name in INDEXES:
        schema_editor.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {name}")


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("django_dbworker", "0007_batches_and_dependencies"),
    ]

    # The hint lets routers that decide by model route this as the work table's own.
    operations = [
        migrations.RunPython(create, drop, elidable=False, hints={"model_name": "workitem"})
    ]
