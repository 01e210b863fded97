"""Views that exist for the test suite (counting effects, sleeping, failing on purpose)."""

from django.urls import URLPattern

urlpatterns: list[URLPattern] = []
