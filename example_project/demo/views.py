from __future__ import annotations

from django.contrib import messages
from django.db.models import Count
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render

from django_dbworker.models import WorkItem
from example_project.demo.enqueue_demo import enqueue_demo_work


def home(request: HttpRequest) -> HttpResponse:
    if request.method == "POST":
        count = enqueue_demo_work()
        messages.success(request, f"Enqueued {count} work items.")
        return redirect("home")
    counts = WorkItem.objects.values("status").annotate(n=Count("id")).order_by("status")
    return render(request, "demo/home.html", {"counts": counts})
