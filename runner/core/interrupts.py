"""SIGINT and SIGTERM end a run cleanly, at any point (`Interrupted` extends BaseException, as
KeyboardInterrupt does).

    with stop_on_signals():
        ...                  # the job: a signal raises Interrupted here, in the main thread

`Interrupted` is a BaseException (as KeyboardInterrupt is), so no `except Exception` swallows it:
it unwinds through the stage, whose partial output the artifact store removes (a resumable
stage's work folder is kept), through every ManagedProcess block (servers and ranks stop), to
the job, which marks the MLflow run KILLED, and to the entry point, which prints one line (what
was interrupted, how to resume) and exits 128 + the signal (130 for Ctrl-C, 143 for SIGTERM).
After the first signal, a second SIGINT or SIGTERM exits at once (`os._exit`); the kernel then
stops the children the runner started (runner/processes/reaper.py).

Stages that stop on their own terms (training saves a checkpoint at the next step boundary)
install their own handlers while they run and raise `Interrupted` once stopped.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

log = logging.getLogger("runner")
SIGNALS = (signal.SIGINT, signal.SIGTERM)
# Signals that mean "checkpoint and stop" to a stage that stops on its own terms (training):
# Ctrl-C, a scheduler's cancel, Slurm's warning before a time limit (sent through submitit).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


class Interrupted(BaseException):
    """The run was stopped by a signal; `exit_code` is the conventional 128 + signal number."""

    def __init__(self, signum: int, detail: str = ""):
        self.signum = signum
        self.detail = detail
        # Set by the pipeline: the stage that was running when the signal came.
        self.stage: str | None = None
        super().__init__(detail or signal.Signals(signum).name)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


def as_interrupted(exc: BaseException) -> Interrupted | None:
    """A KeyboardInterrupt (Ctrl-C raised by Python's own handler) counts as SIGINT."""
    if isinstance(exc, Interrupted):
        return exc
    if isinstance(exc, KeyboardInterrupt):
        return Interrupted(signal.SIGINT)
    return None


def _force_exit(signum: int, _frame: Any) -> None:
    sys.stderr.write(f"\n{signal.Signals(signum).name} again: exiting now\n")
    sys.stderr.flush()
    os._exit(128 + signum)


def _raise(signum: int, _frame: Any) -> None:
    # The first signal: from now on a second one forces the exit.
    for sig in SIGNALS:
        signal.signal(sig, _force_exit)
    raise Interrupted(signum)


@contextlib.contextmanager
def handling(signals: tuple[signal.Signals, ...], handler: Any) -> Iterator[dict[int, Any]]:
    """Within the block, `handler` answers `signals` (main thread only: elsewhere Python allows
    none, and the block runs with the handlers as they were). Yields the previous handlers
    (e.g. submitit's SIGUSR1 requeue, to chain to); restores them afterwards. The one place the
    runner installs signal handlers in its own process."""
    if threading.current_thread() is not threading.main_thread():
        yield {}
        return
    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield previous
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)


def stop_on_signals() -> contextlib.AbstractContextManager[dict[int, Any]]:
    """Within the block (main thread only), SIGINT and SIGTERM raise Interrupted."""
    return handling(SIGNALS, _raise)


def between_jobs(handler: Any) -> None:
    """A multirun's handler for SIGINT and SIGTERM while no job runs (between jobs; each job
    installs its own for its duration and then puts this one back). Main thread only."""
    if threading.current_thread() is threading.main_thread():
        for sig in SIGNALS:
            signal.signal(sig, handler)


@contextlib.contextmanager
def held_back() -> Iterator[list[int]]:
    """Within the block, SIGINT and SIGTERM are noted instead of raised (closing an MLflow run
    must not be cut in half and leave it RUNNING); yields the signals that came."""
    got: list[int] = []
    with handling(SIGNALS, lambda signum, _frame: got.append(signum)):
        yield got


def companion(name: str, work: Any) -> int:
    """A companion command's `main` (publish, transfer): `work()` runs with SIGINT and SIGTERM
    raising Interrupted, so that its folder helpers remove what they half wrote; a signal ends it
    with one line and 128 + the signal's number, as the runner itself does."""
    try:
        with stop_on_signals():
            return work()
    except (Interrupted, KeyboardInterrupt) as exc:
        stopped = as_interrupted(exc)
        assert stopped is not None
        print(
            f"{name}: interrupted by {stopped.name}; nothing half-written was left (run it again)",
            file=sys.stderr,
        )
        return stopped.exit_code
