"""A child process the runner starts, watches and always stops: the vLLM server and the
multi-GPU trainer (torchrun) both run as one.

    with ManagedProcess(command, env, log_path, label="train") as proc:
        code = proc.wait()          # or poll, proc.check_alive(), proc.tail_text()

The child runs in its own process group (session), so everything it starts (vLLM's engine,
torchrun's ranks) can be stopped together: SIGTERM to the group, then SIGKILL after
`stop_timeout_s`, on leaving the block for any reason. While it runs, the runner turns SIGTERM
into SystemExit so that the block is left and the child stopped, and if the runner itself is
killed outright the kernel signals the child (PR_SET_PDEATHSIG) and the reaper
(runner/processes/reaper.py) kills the child's whole tree at once. Once the runner stops the child,
its
output goes to the log file only (no EngineDeadError traceback on the console). Every output
line goes to `log_path` as it comes (flushed: `tail -f` works) and to a tail kept for error
messages; `echo` decides which lines are also printed: as they are (True), or as a (level,
text) record of the runner's logger, in its format.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from runner import SOURCE_ROOT
from runner.core.interrupts import die_with_parent

log = logging.getLogger("runner")


def _die_with_parent() -> None:
    # Runs in the child before exec: if the runner is killed outright (SIGKILL), the kernel sends
    # the child SIGTERM instead of leaving it orphaned and holding the machine. (Popen waits for
    # the exec, so the runner is alive here.)
    die_with_parent(signal.SIGTERM)


def _raise_system_exit(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def _start_reaper(pid: int) -> subprocess.Popen | None:
    """runner/processes/reaper.py for the child `pid`: kills its whole tree at once if the runner
    dies."""
    repo = str(SOURCE_ROOT)
    path = os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH", "")) if p)
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "runner.processes.reaper", str(pid), str(os.getpid())],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": path},
        )
    except OSError as exc:  # the child still dies with the runner, only less promptly
        log.warning("could not start the reaper for pid %d: %s", pid, exc)
        return None


def signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def children(pid: int) -> list[int]:
    """Direct children of `pid` (Linux /proc)."""
    out: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            text = (task / "children").read_text().split()
            out += [int(c) for c in text]
    return out


class ManagedProcess:
    def __init__(
        self,
        command: Sequence[str],
        env: dict[str, str],
        log_path: Path,
        label: str,
        stop_timeout_s: float = 60.0,
        cwd: Path | None = None,
        echo: Callable[[str], Any] = lambda line: True,
    ):
        self.command = [str(c) for c in command]
        self.env = env
        self.log_path = Path(log_path)
        self.label = label
        self.stop_timeout_s = stop_timeout_s
        self.cwd = cwd
        self.echo = echo
        self.started_at: float | None = None
        self._proc: subprocess.Popen | None = None
        self._tail: collections.deque[str] = collections.deque(maxlen=60)
        self._reader: threading.Thread | None = None
        self._old_sigterm: Any = None
        self._logf: Any = None
        # Descendants seen while it ran: torchrun's ranks live in sessions of their own and can
        # outlive it, so stop() signals their groups too.
        self._seen: set[int] = set()
        self._watcher: threading.Thread | None = None
        self._stopping = False
        self._reaper: subprocess.Popen | None = None

    def __enter__(self) -> ManagedProcess:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log.info("[%s] starting: %s", self.label, shlex.join(self.command))
        log.info("[%s] log: %s", self.label, self.log_path)
        self.started_at = time.time()
        self._logf = open(self.log_path, "ab")  # noqa: SIM115 (open while it runs; stop() closes it)
        self._logf.write((" ".join(self.command) + "\n").encode())
        self._proc = subprocess.Popen(
            self.command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=self.env,
            cwd=self.cwd,
            start_new_session=True,  # its own process group: what it starts goes with it
            preexec_fn=_die_with_parent,
        )
        self._reaper = _start_reaper(self._proc.pid)
        self._reader = threading.Thread(target=self._copy_output, daemon=True)
        self._reader.start()
        self._watcher = threading.Thread(target=self._watch, args=(self._proc,), daemon=True)
        self._watcher.start()
        main = threading.current_thread() is threading.main_thread()
        if main and signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            # SIGTERM (a scheduler cancelling the job) would otherwise end the runner without
            # the cleanup in stop() and leave the child holding the machine. A runner job has
            # its own handler already (runner/core/interrupts.py), which leaves the block the same
            # way.
            self._old_sigterm = signal.signal(signal.SIGTERM, _raise_system_exit)

    def _copy_output(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for raw in iter(self._proc.stdout.readline, b""):
            self._logf.write(raw)
            self._logf.flush()
            line = raw.decode(errors="replace").rstrip()
            self._tail.append(line)
            # Once the runner stops it, what the child says about dying (vLLM's EngineDeadError
            # traceback) goes to its log file only.
            shown = self.echo(line) if not self._stopping else None
            if isinstance(shown, tuple):  # (level, text): in the runner's own log format
                log.log(shown[0], "[%s] %s", self.label, shown[1])
            elif shown:
                sys.stdout.write(f"[{self.label}] {line}\n")
                sys.stdout.flush()
        self._logf.flush()

    def _watch(self, proc: subprocess.Popen) -> None:
        while proc.poll() is None:
            self._seen.update(children(proc.pid))
            time.sleep(1.0)

    def poll(self) -> int | None:
        return self._proc.poll() if self._proc is not None else None

    def exited(self) -> int | None:
        """The exit code once the child has exited (its output read to the end), else None."""
        code = self.poll()
        if code is not None and self._reader is not None:
            self._reader.join(timeout=5)
        return code

    def wait(self, timeout: float | None = None) -> int:
        assert self._proc is not None
        code = self._proc.wait(timeout=timeout)
        if self._reader is not None:
            self._reader.join(timeout=10)
        return code

    def signal_children(self, sig: int) -> list[int]:
        """Send `sig` to the child's own children (torchrun's ranks), not to the child."""
        pids = children(self._proc.pid) if self._proc is not None else []
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        return pids

    def stop(self, grace_s: float | None = None) -> None:
        """SIGTERM the group, SIGKILL what is left after the grace period; idempotent."""
        proc, self._proc = self._proc, None
        self._stopping = True
        if self._reaper is not None:  # a deliberate stop: the reaper has nothing to do
            self._reaper.kill()
            self._reaper.wait()
            self._reaper = None
        if proc is not None:
            self._seen.update(children(proc.pid))
            if proc.poll() is None:
                log.info("[%s] stopping (pid %d)", self.label, proc.pid)
                signal_group(proc.pid, signal.SIGTERM)
                for pid in self._seen:
                    signal_group(pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=self.stop_timeout_s if grace_s is None else grace_s)
                except subprocess.TimeoutExpired:
                    log.warning(
                        "[%s] did not stop within %.0f s; killing it",
                        self.label,
                        self.stop_timeout_s,
                    )
            # Whatever the main process did, nothing it started may outlive it.
            for pid in (proc.pid, *self._seen):
                signal_group(pid, signal.SIGKILL)
            proc.wait()
            if self._reader is not None:
                self._reader.join(timeout=10)
        if self._logf is not None:
            self._logf.close()
            self._logf = None
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None

    def tail_text(self, n: int = 40) -> str:
        lines = list(self._tail)[-n:]
        return f"last {len(lines)} lines of {self.log_path}:\n" + "\n".join(lines)
