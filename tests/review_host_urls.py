"""The URLs of the ``api.example`` host (tests/test_cross_principal_review.py): the path that
ROOT_URLCONF maps to a plain Django view is a DRF view here."""

from __future__ import annotations

from django.urls import path

from tests.test_cross_principal_review import ApiClientView, plain_exempt

urlpatterns = [
    path("mw/host/", ApiClientView.as_view()),
    path("mw/exempt/", plain_exempt),
]
