"""The reaper: a tiny watcher that kills a managed child's whole process tree the moment the
runner dies, even by SIGKILL.

    python -m runner.processes.reaper <pid> <runner pid>   # started by
    runner.processes.process.ManagedProcess

The runner's direct child already gets SIGTERM from the kernel when the runner dies
(PR_SET_PDEATHSIG), but what that child started (vLLM's engine core, torchrun's ranks) only
notices later, or never: measured 2.5 s to over 20 s for a vLLM server killed during its model
load. The reaper asks the kernel for SIGTERM when the runner dies, remembers every descendant of
<pid> (polled from /proc) and, on that signal, SIGKILLs their process groups and themselves at
once. When the runner stops the child normally it kills the reaper first (SIGKILL, no action).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path

from runner.processes.process import (  # stdlib only: starts in milliseconds
    children,
    die_with_parent,
)


def _descendants(pid: int) -> set[int]:
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children(todo.pop()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def main(pid: int, runner_pid: int) -> int:
    seen: set[int] = {pid}

    def reap(_signum: int, _frame: object) -> None:
        seen.update(_descendants(pid))
        for p in seen:
            with contextlib.suppress(OSError):
                os.killpg(os.getpgid(p), signal.SIGKILL)
            with contextlib.suppress(OSError):
                os.kill(p, signal.SIGKILL)
        os._exit(0)

    signal.signal(signal.SIGTERM, reap)
    if not die_with_parent(signal.SIGTERM, runner_pid):  # the runner died as the reaper started
        reap(signal.SIGTERM, None)
    while True:
        if not Path(f"/proc/{pid}").exists():
            return 0  # the child is gone: nothing left to watch
        seen.update(_descendants(pid))
        time.sleep(0.5)


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2])))
