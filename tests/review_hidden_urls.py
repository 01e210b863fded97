"""URLs whose view the middleware cannot see through (tests/test_cross_principal_review.py): a
DRF view and a django-ninja API behind wrappers that do not use ``functools.wraps``."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest
from django.urls import path
from django.views.decorators.csrf import csrf_exempt

from tests.test_cross_principal_review import NinjaAPI, hidden_drf

urlpatterns = [path("mw/hidden-drf/", csrf_exempt(hidden_drf))]

if NinjaAPI is not None:
    from tests.test_cross_principal_review import mw_api

    def hide(view: Any) -> Any:
        def hidden(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
            return view(request, *args, **kwargs)

        return csrf_exempt(hidden)

    for pattern in mw_api.urls[0]:
        urlpatterns.append(path(f"mw/hidden-ninja/{pattern.pattern}", hide(pattern.callback)))
