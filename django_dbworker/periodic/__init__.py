"""Periodic work: ``PeriodicHandler`` (``handler.py``) and the schedule maths
(``schedules.py``); the worker's scheduler thread enqueues the slots
(``worker/scheduler.py``)."""
