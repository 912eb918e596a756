"""Raises on import, as a ``tasks.py`` written for another queue does without it."""

raise ImportError("No module named 'celery' (this module was written for Celery)")
