"""An installed app whose ``tasks`` module cannot be imported (a Celery one, say)."""
