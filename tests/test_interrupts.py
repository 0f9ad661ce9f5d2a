"""Which signals the runner answers: every one a terminal or a scheduler sends, except one the
process was told to ignore (SIGHUP under nohup) and a SIGUSR1 another handler answers
(submitit's requeue under Slurm), which training chains to after its checkpoint."""

from __future__ import annotations

import os
import signal

import pytest

from runner.core.interrupts import Interrupted, foreign, handling, stop_on_signals


@pytest.fixture
def restored():
    saved = {s: signal.getsignal(s) for s in (signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM])
def test_each_signal_raises_interrupted_with_its_code(sig, restored):
    # As a terminal starts it: a test run under nohup inherits an ignored SIGHUP, which the
    # runner rightly leaves ignored (the next test).
    if sig != signal.SIGTERM:
        signal.signal(sig, signal.SIG_DFL)
    with pytest.raises(Interrupted) as stop, stop_on_signals():
        os.kill(os.getpid(), sig)  # a signal to itself is handled before os.kill returns
    assert stop.value.exit_code == 128 + sig


def test_an_ignored_sighup_stays_ignored_and_a_foreign_sigusr1_is_left_alone(restored):
    requeued = []

    def submitit_requeue(signum, frame):
        requeued.append(signum)

    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # nohup
    signal.signal(signal.SIGUSR1, submitit_requeue)
    assert foreign(submitit_requeue)
    with stop_on_signals() as previous:
        assert signal.SIGHUP not in previous and signal.SIGUSR1 not in previous
        os.kill(os.getpid(), signal.SIGUSR1)
    assert requeued == [signal.SIGUSR1]
    assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    # Training's own handler is the runner's: a later block treats SIGUSR1 as its own again.
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    with stop_on_signals(), handling((signal.SIGUSR1,), lambda *_: None) as inner:
        assert not foreign(inner[signal.SIGUSR1])


def test_a_plans_probe_dies_with_the_plan(tmp_path):
    """A probe child started as the plan starts them (vLLM asked in a child process) is killed
    by the kernel the moment the plan's process is killed outright, not left for minutes."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    marker = tmp_path / "probe.pid"
    probe_code = (
        f"import os, time; open({str(marker)!r}, 'w').write(str(os.getpid())); time.sleep(600)"
    )
    plan = (
        "import subprocess, sys\n"
        "from runner.core.interrupts import end_with_parent\n"
        f"subprocess.run([sys.executable, '-c', {probe_code!r}], preexec_fn=end_with_parent)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", plan], cwd=Path(__file__).parents[1])
    deadline = time.time() + 60
    while not (marker.exists() and marker.read_text()):
        assert time.time() < deadline and parent.poll() is None
        time.sleep(0.05)
    probe = int(marker.read_text())
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    t0 = time.time()
    while Path(f"/proc/{probe}").exists():
        state = Path(f"/proc/{probe}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state == "Z":
            break
        assert time.time() - t0 < 5, "the probe outlived the plan"
        time.sleep(0.05)
