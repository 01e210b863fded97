"""Views that exist for the test suite (counting effects, sleeping, failing on purpose)."""

from django.urls import URLPattern, URLResolver, path

from testproject.shop import outbox_probe, probe_flows, probe_protection
from testproject.shop import probe_views as views

urlpatterns: list[URLPattern | URLResolver] = [
    path("effect/", views.effect, name="probe-effect"),
    path("form/", views.form, name="probe-form"),
    path("required/", views.required, name="probe-required"),
    path("put-only/", views.put_only, name="probe-put-only"),
    path("raise/", views.raising, name="probe-raise"),
    path("big/", views.big, name="probe-big"),
    path("stream/", views.streaming, name="probe-stream"),
    path("nested-atomic/", views.nested_atomic, name="probe-nested-atomic"),
    path("cbv/", views.ClassBased.as_view(), name="probe-cbv"),
    path("drf/apiview/", views.DrfApiView.as_view(), name="probe-drf-apiview"),
    path("drf/atomic-mixin/", views.DrfAtomicMixin.as_view()),
    path("cbv-dispatch/", views.ClassDispatch.as_view()),
    path("drf/method-decorator/", views.DrfMethodDecorated.as_view()),
    path("drf/data-permission/", views.DrfDataPermission.as_view()),
    path("drf/viewset/", views.DrfViewSet.as_view({"post": "create"}), name="probe-drf-viewset"),
    path("async/", views.async_effect, name="probe-async"),
    path("lease/", views.lease, name="probe-lease"),
    path("lease-short/", views.lease_short, name="probe-lease-short"),
    path("mw/effect/", views.undecorated, name="probe-mw-effect"),
    path("mw/raise/", views.undecorated_raising, name="probe-mw-raise"),
    path("mw/async/", views.undecorated_async, name="probe-mw-async"),
    path("mw/decorated/", views.required, name="probe-mw-decorated"),
    path("mw/drf/plain/", views.DrfPlain.as_view(), name="probe-mw-drf-plain"),
    path("mw/drf/safe/", views.DrfSafe.as_view(), name="probe-mw-drf-safe"),
    path("mw/drf/lease/", views.DrfLease.as_view(), name="probe-mw-drf-lease"),
    path("mw/cbv-lease/", views.ClassLease.as_view(), name="probe-mw-cbv-lease"),
    path("mw/drf/viewset-lease/", views.DrfViewSetLease.as_view({"post": "create"})),
    path("flow/", probe_flows.flow_probe, name="probe-flow"),
    path("flow-unresumable/", probe_flows.flow_unresumable, name="probe-flow-unresumable"),
    path("flow-whoami/", probe_flows.flow_whoami, name="probe-flow-whoami"),
    path("flow-poison/", probe_flows.flow_poison, name="probe-flow-poison"),
    path("outbox/order-then-die/", outbox_probe.order_then_die, name="probe-outbox-die"),
    path("outbox/effect/", outbox_probe.effect_and_event, name="probe-outbox-effect"),
    path("secret/", probe_protection.secret_echo, name="probe-secret"),
]

try:  # django-ninja is the "ninja" extra, which the lowest job may not install
    from testproject.shop import probe_ninja
except ImportError:  # pragma: no cover - tests/test_http_ninja.py skips then
    pass
else:
    urlpatterns.append(path("ninja/", probe_ninja.api.urls))
    urlpatterns.append(path("ninja-v2/", probe_ninja.api_v2.urls))
