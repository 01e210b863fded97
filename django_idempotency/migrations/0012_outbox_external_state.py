"""The outbox's ``external`` state: a message written for a change-capture reader (Debezium's
outbox event router), which the relay never claims and the purge deletes ``OUTBOX_TTL`` after it
was written. Choices and help text only: no statement on any database."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("django_idempotency", "0011_outbox_claim_indexes"),
    ]

    operations = [
        migrations.AlterField(
            model_name="outboxentry",
            name="expires_at",
            field=models.DateTimeField(
                blank=True,
                help_text="Set when sent (sent + OUTBOX_TTL), or when written for a change-capture reader (written + OUTBOX_TTL); pending and parked rows never expire.",
                null=True,
                verbose_name="expires",
            ),
        ),
        migrations.AlterField(
            model_name="outboxentry",
            name="state",
            field=models.CharField(
                choices=[
                    ("pending", "pending"),
                    ("sent", "sent"),
                    ("parked", "parked"),
                    ("external", "read from the log"),
                ],
                default="pending",
                max_length=8,
                verbose_name="state",
            ),
        ),
    ]
