"""Data protection (issue 37): the permission behind the admin's erasure action.

State only: a permission is a row that ``post_migrate`` creates, and no column changes.
Encryption at rest needs no schema change: a sealed response is stored in the same
``response_body`` and ``response_headers`` columns, a sealed flow run or outbox payload in the
same JSON columns, so the claim and completion functions and every index stay as they are.
"""

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("django_idempotency", "0014_sec_flows_run_cascade"),
    ]

    operations = [
        migrations.AlterModelOptions(
            name="idempotencyrecord",
            options={
                "permissions": [
                    (
                        "erase_idempotencyrecord",
                        "Can erase the stored data of an owner's records",
                    )
                ],
                "verbose_name": "idempotency record",
                "verbose_name_plural": "idempotency records",
            },
        ),
    ]
