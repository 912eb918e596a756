from django.contrib import admin
from django.urls import include, path

from example_project.demo import views

urlpatterns = [
    path("", views.home, name="home"),
    path("admin/", admin.site.urls),
    path("", include("django_prometheus.urls")),  # /metrics
]
