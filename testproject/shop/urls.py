from django.urls import path

from testproject.shop import rides, views

urlpatterns = [
    path("", views.home, name="home"),
    path("api/orders/", views.orders_api, name="orders-api"),
    path("api/unsafe-orders/", views.unsafe_orders_api, name="unsafe-orders-api"),
    path("api/rides/", rides.create_ride, name="rides-api"),
]
