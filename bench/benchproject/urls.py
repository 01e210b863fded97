"""Routes of the variant this process runs: ``/<name>/`` and ``/race/<name>/``."""

from django.conf import settings
from django.urls import URLPattern, path

from bench.benchproject.views import VIEWS_BY_VARIANT, health

urlpatterns: list[URLPattern] = [path("health/", health)]
urlpatterns += [
    path(f"{name}/", view) for name, view in VIEWS_BY_VARIANT[settings.VARIANT]().items()
]
