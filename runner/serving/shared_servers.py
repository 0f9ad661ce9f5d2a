"""vLLM servers kept running across the jobs of one Hydra multirun, so that a sweep's online jobs
share one server, the way offline jobs share one extraction.

A capture-layer sweep in online mode (`python -m runner -m -cn capture_layers extract=online`)
gives every job the same server flags: each job's capture ids are the sweep's union
(extract.superset_presets), and each trains on its own slots. The first job's train stage starts
the server through `get`; later jobs in the same process (Hydra's basic launcher runs them one
after another) find it running and use it. `stop_all` ends them when the multirun ends
(runner/tracking/sweep.py), at interpreter exit, and the kernel ends them if the runner dies
(runner/processes/process.py). Jobs in separate processes (the joblib launcher) each start their
own.
"""

from __future__ import annotations

import atexit
import logging
import os
from collections.abc import Callable
from typing import Any

log = logging.getLogger("runner")
# Set by the sweep callback while a multirun runs (runner/tracking/sweep.py PARENT_ENV; repeated
# here so
# that this module imports nothing heavy).
PARENT_ENV = "EAGLE3_PARENT_RUN_ID"
_SERVERS: dict[str, Any] = {}


def in_multirun() -> bool:
    return PARENT_ENV in os.environ


def running(key: str) -> bool:
    return key in _SERVERS


def get(key: str, start: Callable[[], Any]) -> tuple[Any, bool]:
    """The running server for `key` (True: reused), or a new one from `start()` (False), ready."""
    server = _SERVERS.get(key)
    if server is not None:
        try:
            server.check_alive()
            return server, True
        except Exception:
            log.warning(
                "[%s] the sweep's shared vLLM server has exited; starting another", server.label
            )
            server.stop()
            del _SERVERS[key]
    server = start()
    server.__enter__()
    _SERVERS[key] = server
    return server, False


def stop_all() -> None:
    while _SERVERS:
        _, server = _SERVERS.popitem()
        server.stop()


atexit.register(stop_all)
