"""The chaos runner: real ``run_workers`` processes under injected faults.

``python -m tests.chaos.runner`` starts its own throwaway PostgreSQL, runs a
bounded workload (``workload.py``, handlers in ``workers.py``) through
several worker processes while ``faults.py`` kills, freezes and cuts them
off, then checks the invariants of SPEC.md from the database (``checks.py``).
See docs/internals/reliability.md.
"""
