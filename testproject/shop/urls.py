from django.conf import settings
from django.urls import path

from testproject.shop import rides, views

urlpatterns = [
    path("", views.home, name="home"),
    path("api/orders/", views.orders_api, name="orders-api"),
    path("api/orders/<int:pk>/", views.order_detail, name="order-detail"),
    path("api/unsafe-orders/", views.unsafe_orders_api, name="unsafe-orders-api"),
    path("api/unsafe-orders/<int:pk>/", views.order_detail, name="unsafe-order-detail"),
    path("api/rides/", rides.create_ride, name="rides-api"),
]

if settings.TASKS_MODULE:  # a tasks framework is installed (Django 6.0+, or django-tasks)
    from testproject.shop import views_tasks

    urlpatterns.append(path("api/task-orders/", views_tasks.orders_api, name="task-orders-api"))
