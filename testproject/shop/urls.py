from django.urls import path

from testproject.shop import views

urlpatterns = [
    path("", views.home, name="home"),
    path("api/orders/", views.orders_api, name="orders-api"),
    path("api/orders/<int:pk>/", views.order_detail, name="order-detail"),
    path("api/unsafe-orders/", views.unsafe_orders_api, name="unsafe-orders-api"),
    path("api/unsafe-orders/<int:pk>/", views.order_detail, name="unsafe-order-detail"),
]
