from django.contrib import admin
from django.urls import include, path

from tests.testapp import views

urlpatterns = [
    path("admin/", admin.site.urls),
    path("enqueue/", views.enqueue_view),
    path("", include("django_prometheus.urls")),
]
