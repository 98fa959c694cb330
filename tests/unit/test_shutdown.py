"""A service's stop is bounded and says where it was stuck (remp.grpc_util.Shutdown): found by
CI, where the controller outlived `remp up`'s 20 s grace after SIGTERM and was SIGKILLed
with nothing in its log to say why."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import structlog

from remp.grpc_util import Shutdown


async def test_a_hanging_step_is_logged_by_name_and_the_next_steps_still_run():
    done = []
    with structlog.testing.capture_logs() as logs:
        down = Shutdown(structlog.get_logger(), "svc", step_s=0.2)
        await down.step("stuck", asyncio.Event().wait())
        await down.step("broken", _boom())
        down.sync("after", lambda: done.append(1))
    assert done == [1]
    events = {(e["event"], e["step"]) for e in logs}
    assert ("svc.stop_step_timed_out", "stuck") in events
    assert ("svc.stop_step_failed", "broken") in events


async def _boom():
    raise RuntimeError("closing failed")


def test_the_watchdog_dumps_every_stack_and_ends_a_process_that_would_not_exit():
    # a non-daemon thread that never ends: the interpreter would wait for it forever
    code = ("import threading, time, structlog\n"
            "from remp.grpc_util import Shutdown\n"
            "threading.Thread(target=lambda: time.sleep(3600), name='stuck').start()\n"
            "Shutdown(structlog.get_logger(), 'svc', watchdog_s=1.0)\n")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert time.monotonic() - t0 < 30
    assert r.returncode != 0
    assert "Timeout (0:00:01)!" in r.stderr and "in _shutdown" in r.stderr, r.stderr  # where
