from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("admin/", admin.site.urls),
    path("probe/", include("testproject.shop.probe_urls")),
    path("", include("testproject.shop.urls")),
]
