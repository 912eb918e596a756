"""A view that enqueues work, so tests can trace request -> enqueue -> job."""

from __future__ import annotations

from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from tests.testapp.workers import Echo


@csrf_exempt
def enqueue_view(request: HttpRequest) -> JsonResponse:
    item = Echo.enqueue({"from": "request", "secret_token": "s3cr3t-payload"})
    return JsonResponse({"id": item.pk})
