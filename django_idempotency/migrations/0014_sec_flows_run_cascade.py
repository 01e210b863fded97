"""A flow run is deleted with its record (Django's cascade; the purge deletes both per batch).

State only: ``on_delete`` lives in Django, and the column keeps no database constraint
(``db_constraint=False``), so no SQL runs and the migration costs nothing on a large table.
"""

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("django_idempotency", "0013_reserve_function_v2"),
    ]

    operations = [
        migrations.AlterField(
            model_name="flowrun",
            name="record",
            field=models.OneToOneField(
                db_constraint=False,
                on_delete=django.db.models.deletion.CASCADE,
                related_name="flow_run",
                to="django_idempotency.idempotencyrecord",
                verbose_name="idempotency record",
            ),
        ),
    ]
