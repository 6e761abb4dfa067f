from django.urls import path
from shop import views

urlpatterns = [
    path("charge/", views.charge),
    path("payments/<str:task_id>/", views.payment),
]
