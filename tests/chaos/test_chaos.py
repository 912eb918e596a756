"""The chaos runner's short mode as a test: real workers under faults keep the invariants.

The runner starts and stops its own PostgreSQL (it freezes and reconfigures
it), so this test needs no database fixture; it is ``postgres_only`` because
the SQLite leg of the suite has no server to freeze. It runs seed 1234;
``CHAOS_SEED=N`` runs another; the report names the seed of every run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.postgres_only

#: Short mode: every fault at least once, within BUDGET seconds including setup.
SHORT = ["--duration", "50", "--workers", "3"]
BUDGET = 180.0
DEFAULT_SEED = 1234


def _log_tails(run_dir: Path, lines: int = 25) -> str:
    parts = []
    for path in sorted((run_dir / "logs").glob("*.log")):
        tail = path.read_text(errors="replace").splitlines()[-lines:]
        parts.append(f"--- {path.name} (last {len(tail)} lines)\n" + "\n".join(tail))
    return "\n".join(parts)


#: The keyed mode: items of a concurrency_limit = 1 handler over 8 keys.
KEYED = ["--duration", "30", "--workers", "3", "--keyed", "8"]


@pytest.mark.parametrize("mode", [SHORT, KEYED], ids=["mixed", "keyed"])
def test_short_chaos_run_keeps_every_invariant(tmp_path: Path, mode: list[str]) -> None:
    run_dir = tmp_path / "chaos"
    cmd = [sys.executable, "-m", "tests.chaos.runner", *mode, "--run-dir", str(run_dir)]
    # A fixed schedule in the suite, so that a red run can be replayed as it
    # was (timings still vary); the long mode explores other seeds.
    cmd += ["--seed", os.environ.get("CHAOS_SEED", str(DEFAULT_SEED))]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    started = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        report, progress = proc.communicate(timeout=BUDGET + 30)
    except subprocess.TimeoutExpired:
        # SIGTERM, not SIGKILL: the runner then stops its workers and its cluster.
        proc.send_signal(signal.SIGTERM)
        report, progress = proc.communicate(timeout=60)
        pytest.fail(
            f"the chaos runner did not finish within {BUDGET + 30:g}s\n{progress}\n{report}\n"
            + _log_tails(run_dir)
        )
    took = time.monotonic() - started
    if proc.returncode != 0:
        pytest.fail(
            f"chaos run failed (exit {proc.returncode}, {took:.0f}s)\n{report}\n"
            f"--- runner stderr (last 40 lines)\n"
            + "\n".join(progress.splitlines()[-40:])
            + "\n"
            + _log_tails(run_dir)
        )
    assert took <= BUDGET, f"short mode took {took:.0f}s (budget {BUDGET:g}s)\n{report}"
