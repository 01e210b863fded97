from django.urls import path

from testproject.shop import views

urlpatterns = [
    path("", views.home, name="home"),
]
