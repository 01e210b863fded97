"""A URLconf under ``i18n_patterns`` (tests/test_cross_principal_review.py): ``/fr/mw/...``
resolves only once ``LocaleMiddleware`` has activated the path's language."""

from __future__ import annotations

from django.conf.urls.i18n import i18n_patterns
from django.urls import path

from tests.test_cross_principal_review import ApiClientView

urlpatterns = i18n_patterns(path("mw/api-client/", ApiClientView.as_view()))
