"""The fleet: the live ``run_workers`` processes, for operators (the admin's Workers page,
``dbworker_stats``). Each threaded worker keeps one ``LiveWorker`` row fresh on its
heartbeat thread (``presence.py``); ``live.py`` reads the live ones. Nothing that claims,
heartbeats items or recovers them reads these rows."""
