from django.urls import path

from testproject.shop import views

urlpatterns = [
    path("", views.home, name="home"),
    path("api/orders/", views.orders_api, name="orders-api"),
    path("api/unsafe-orders/", views.unsafe_orders_api, name="unsafe-orders-api"),
]
