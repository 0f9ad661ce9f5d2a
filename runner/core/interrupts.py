"""Every signal a terminal or a scheduler sends ends a run cleanly, at any point: SIGINT (Ctrl-C),
SIGTERM (a scheduler's cancel), SIGHUP (the terminal closed; left alone under nohup), SIGUSR2,
and SIGUSR1 unless something else answers it (submitit's requeue under Slurm). `Interrupted`
extends BaseException, as KeyboardInterrupt does.

    with stop_on_signals():
        ...                  # the job: a signal raises Interrupted here, in the main thread

`Interrupted` is a BaseException (as KeyboardInterrupt is), so no `except Exception` swallows it:
it unwinds through the stage, whose partial output the artifact store removes (a resumable
stage's work folder is kept), through every ManagedProcess block (servers and ranks stop), to
the job, which marks the MLflow run KILLED, and to the entry point, which prints one line (what
was interrupted, how to resume) and exits 128 + the signal (130 for Ctrl-C, 143 for SIGTERM, 129
for SIGHUP). After the first signal, a second one exits at once (`os._exit`); the kernel then
stops the children the runner started (runner/processes/reaper.py).

Stages that stop on their own terms (training saves a checkpoint at the next step boundary)
install their own handlers while they run and raise `Interrupted` once stopped.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

log = logging.getLogger("runner")
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
# Signals that mean "checkpoint and stop" to a stage that stops on its own terms (training):
# Ctrl-C, a scheduler's cancel, a closed terminal, Slurm's warning before a time limit (SIGUSR1,
# sent through submitit, or SIGUSR2 where a batch script asks for it with --signal).
STOP_SIGNALS = SIGNALS


def _ours(signals: tuple[signal.Signals, ...]) -> tuple[signal.Signals, ...]:
    """The signals the runner answers now: not one the process was told to ignore (SIGHUP under
    nohup), nor a SIGUSR1 that another handler answers (submitit requeues the Slurm job with it;
    training chains to that handler after its checkpoint)."""
    out = []
    for sig in signals:
        current = signal.getsignal(sig)
        if current is signal.SIG_IGN and sig != signal.SIGINT:
            continue
        if sig == signal.SIGUSR1 and foreign(current):
            continue
        out.append(sig)
    return tuple(out)


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


def foreign(handler: Any) -> bool:
    """A handler that is not the runner's own (submitit's SIGUSR1 requeue): one to chain to."""
    return callable(handler) and not getattr(handler, "runner", False)


def _marked(handler: Any) -> Any:
    """`handler`, marked as the runner's own (so that `_ours` tells it from submitit's)."""
    if not callable(handler) or getattr(handler, "runner", False):
        return handler

    def runners(signum: int, frame: Any) -> Any:
        return handler(signum, frame)

    runners.runner = True  # type: ignore[attr-defined]
    return runners


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
    for sig in _ours(SIGNALS):
        signal.signal(sig, _marked(_force_exit))
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
    previous = {sig: signal.signal(sig, _marked(handler)) for sig in _ours(signals)}
    try:
        yield previous
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)


def stop_on_signals() -> contextlib.AbstractContextManager[dict[int, Any]]:
    """Within the block (main thread only), the signals above raise Interrupted."""
    return handling(SIGNALS, _raise)


def between_jobs(handler: Any) -> None:
    """A multirun's handler for the signals above while no job runs (between jobs; each job
    installs its own for its duration and then puts this one back). Main thread only."""
    if threading.current_thread() is threading.main_thread():
        for sig in _ours(SIGNALS):
            signal.signal(sig, _marked(handler))


@contextlib.contextmanager
def held_back() -> Iterator[list[int]]:
    """Within the block, the signals above are noted instead of raised (closing an MLflow run
    must not be cut in half and leave it RUNNING); yields the signals that came."""
    got: list[int] = []
    with handling(SIGNALS, lambda signum, _frame: got.append(signum)):
        yield got


def companion(name: str, work: Any) -> int:
    """A companion command's `main` (publish, transfer): `work()` runs with the signals above
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


_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int, parent_pid: int | None = None) -> bool:
    """Ask the kernel to send this process `sig` when its parent dies (PR_SET_PDEATHSIG), and,
    given the pid the parent had, say whether it is still the parent. The request covers only a
    parent that dies after it: one killed before (while a spawned worker was still importing) has
    already left this process to a new parent (init, or a subreaper such as a container's init,
    so not always pid 1), and the caller must end itself."""
    with contextlib.suppress(OSError, AttributeError):  # (no prctl outside Linux)
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)
    return parent_pid is None or os.getppid() == parent_pid


def end_with_parent() -> None:
    """A `preexec_fn` for a short-lived helper child (a plan's probe): SIGKILL when the process
    that started it dies, so that a plan killed outright leaves no probe running for minutes."""
    die_with_parent(signal.SIGKILL)


def command_as_typed(args: list[str] | None = None) -> str:
    """This process's command line as the user typed it (the installed command or the module),
    with `args` (default: its own arguments): what a "run the same command" line prints."""
    import shlex
    from pathlib import Path

    typed = (
        ["eagle3-runner"]
        if Path(sys.argv[0]).name == "eagle3-runner"
        else ["python", "-m", "runner"]
    )
    return shlex.join([*typed, *(sys.argv[1:] if args is None else args)])
