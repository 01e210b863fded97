"""Views that exist for the test suite (counting effects, sleeping, failing on purpose)."""

from django.urls import URLPattern, path

from testproject.shop import outbox_probe
from testproject.shop import probe_views as views

urlpatterns: list[URLPattern] = [
    path("effect/", views.effect, name="probe-effect"),
    path("required/", views.required, name="probe-required"),
    path("put-only/", views.put_only, name="probe-put-only"),
    path("raise/", views.raising, name="probe-raise"),
    path("big/", views.big, name="probe-big"),
    path("stream/", views.streaming, name="probe-stream"),
    path("nested-atomic/", views.nested_atomic, name="probe-nested-atomic"),
    path("cbv/", views.ClassBased.as_view(), name="probe-cbv"),
    path("drf/apiview/", views.DrfApiView.as_view(), name="probe-drf-apiview"),
    path("drf/method-decorator/", views.DrfMethodDecorated.as_view()),
    path("drf/viewset/", views.DrfViewSet.as_view({"post": "create"}), name="probe-drf-viewset"),
    path("async/", views.async_effect, name="probe-async"),
    path("lease/", views.lease, name="probe-lease"),
    path("lease-short/", views.lease_short, name="probe-lease-short"),
    path("mw/effect/", views.undecorated, name="probe-mw-effect"),
    path("mw/raise/", views.undecorated_raising, name="probe-mw-raise"),
    path("mw/async/", views.undecorated_async, name="probe-mw-async"),
    path("mw/decorated/", views.required, name="probe-mw-decorated"),
    path("outbox/order-then-die/", outbox_probe.order_then_die, name="probe-outbox-die"),
]
