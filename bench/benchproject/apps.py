from django.apps import AppConfig


class BenchProjectConfig(AppConfig):
    name = "bench.benchproject"
    label = "benchproject"
    default_auto_field = "django.db.models.BigAutoField"
