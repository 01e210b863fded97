from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class DjangoIdempotencyConfig(AppConfig):
    name = "django_idempotency"
    verbose_name = _("Idempotency")
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Importing the check modules registers their system checks.
        import django_idempotency.checks
        import django_idempotency.http.checks
        import django_idempotency.protection.checks  # noqa: F401
