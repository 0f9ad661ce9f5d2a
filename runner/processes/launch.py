"""Ranks for any stage that needs them: torchrun as a managed child, and its stop signals.

    code, stopped_by = run_ranks("runner.integrations.speculators_worker", request, ranks=4,
                                 work=ctx.scratch, label="train", stop_timeout_s=600)

`run_ranks` starts `python -m torch.distributed.run --standalone --nproc_per_node=N -m MODULE
REQUEST` (runner/processes/process.py: its log, the reaper, SIGTERM on exit). While the ranks run,
the first stop signal (SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGUSR2) is passed to them as SIGTERM
(they save a checkpoint at their next step boundary and exit); if they have not stopped
`stop_timeout_s` later they are killed. A SIGUSR1 is then handed to whoever handled it before
(submitit requeues the Slurm job).
`resume_hint` is the line a stopped or failed stage prints.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from runner import SOURCE_ROOT
from runner.core.interrupts import STOP_SIGNALS, foreign, handling
from runner.processes.process import ManagedProcess

log = logging.getLogger("runner")
REPO = SOURCE_ROOT


def resume_hint(scratch: Path, rerun_command: str) -> str:
    return (
        f"Nothing was published; the work folder {scratch} is kept and the same command "
        f"resumes from its latest checkpoint: {rerun_command}"
    )


def run_ranks(
    module: str,
    request: Path,
    ranks: int,
    log_path: Path,
    label: str,
    stop_timeout_s: float,
    env: dict[str, str] | None = None,
    echo: Any = None,
    rendezvous: list[str] | None = None,
) -> tuple[int | None, str | None, str]:
    """Run `module` on `ranks` local ranks (with `rendezvous`, torchrun's arguments for this
    node's share of a job on several nodes: stages/train/nodes.py); returns (torchrun's exit code or
    None when it was killed after the stop timeout, the name of the stop signal that came or
    None, the log's tail)."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *(rendezvous or ["--standalone"]),
        f"--nproc_per_node={ranks}",
        "-m",
        module,
        str(request),
    ]
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    full_env = {**os.environ, **(env or {}), "PYTHONPATH": path}
    proc = ManagedProcess(
        command,
        full_env,
        log_path,
        label=label,
        stop_timeout_s=stop_timeout_s,
        cwd=REPO,
        echo=echo,
    )
    asked: list[str] = []

    def forward(signum: int, _frame: Any) -> None:
        if not asked:
            asked.append(signal.Signals(signum).name)
            log.warning("[%s] %s: asking the ranks to checkpoint and stop", label, asked[0])
            proc.signal_children(signal.SIGTERM)

    code: int | None = None
    with proc, handling(STOP_SIGNALS, forward) as previous:
        deadline = None
        while (code := proc.exited()) is None:
            if asked and deadline is None:
                deadline = time.time() + stop_timeout_s
            if deadline is not None and time.time() > deadline:
                log.warning("[%s] the ranks did not stop within %.0f s", label, stop_timeout_s)
                break
            time.sleep(0.5)
    if asked and asked[0] == "SIGUSR1" and foreign(previous.get(signal.SIGUSR1)):
        previous[signal.SIGUSR1](signal.SIGUSR1, None)  # submitit requeues the Slurm job
    return code, (asked[0] if asked else None), proc.tail_text()
