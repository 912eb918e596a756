"""The register of live workers goes: it served only the key share, which is retired.

Nothing else read it; dropping the table loses nothing. Workers of 0010 write it, so
stop them before this migration runs (docs/upgrading.md).
"""

from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ('django_dbworker', '0010_worker_register'),
    ]

    operations = [
        migrations.DeleteModel(
            name='WorkerProcess',
        ),
    ]
