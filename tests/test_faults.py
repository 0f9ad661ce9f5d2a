"""Fault injection (`-m faults`, part of `make test-slow`): signals, damaged artifacts, concurrent
first runs, a full disk, a tracking store that fails at the end, and children of a runner killed
outright. Every run is a real `python -m runner` process on the tiny target, bounded in time."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from runner.core.errors import ConfigError, StageError
from tests.conftest import (
    CONVERSATIONS,
    REPO,
    compose,
    run_job,
    run_runner,
    run_until,
    runner_env,
    start_runner,
    tiny_overrides,
)

pytestmark = pytest.mark.faults
CAPTURE = "model.capture_layers=[1,2,3]"


def _cmd(model_dir: Path, data: Path, root: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "runner", *tiny_overrides(model_dir, data, root, CAPTURE, *extra)]


def runner_with_failing_end(argv: list[str]) -> str:
    """`python -m runner <argv>` as a script in which MLflow cannot end a run ("database is
    locked" from set_terminated, as a locked SQLite store gives)."""
    return textwrap.dedent(f"""
        import sqlite3, sys, runpy, mlflow
        def locked(self, run_id, status="FINISHED", end_time=None):
            raise sqlite3.OperationalError("database is locked")
        mlflow.MlflowClient.set_terminated = locked
        sys.argv = ["runner", *{argv!r}]
        runpy.run_module("runner", run_name="__main__", alter_sys=True)  # python -m runner
    """)


def _statuses(root: Path) -> list[str]:
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    exp = client.get_experiment_by_name("eagle3")
    return [r.info.status for r in client.search_runs([exp.experiment_id], order_by=["start_time"])]


def _leftovers(root: Path) -> list[Path]:
    """Anything half-written or locked that a run should not leave behind."""
    store = root / "store"
    found = list(store.glob("*/.tmp-*")) + list(store.glob("*/.old-*"))
    found += list((store / ".locks").glob("*")) if (store / ".locks").exists() else []
    return found


def write_chats(path: Path, n: int) -> Path:
    """`n` distinct conversations (the three of tests/conftest.py, numbered) as JSONL at `path`."""
    with open(path, "w") as fh:
        for i in range(n):
            conv = [dict(t, content=f"{t['content']} ({i})") for t in CONVERSATIONS[i % 3]]
            fh.write(json.dumps({"messages": conv}) + "\n")
    return path


@pytest.fixture(scope="module")
def many_chats(tmp_path_factory) -> Path:
    """600 rows: extraction on the tiny target then lasts long enough to be interrupted."""
    return write_chats(tmp_path_factory.mktemp("faults_data") / "chats.jsonl", 600)


@pytest.mark.parametrize(
    "sig,code,stage,trigger",
    [
        # One handler ends every signal: each signal once, each stage with its own resume
        # (extraction's finished files, training's checkpoints) at least once.
        (signal.SIGTERM, 143, "extract", "[extract] running"),
        (signal.SIGINT, 130, "train", "'global_step': 3"),
        # A closed terminal, and SIGUSR1 outside training (no scheduler answers it here).
        (signal.SIGHUP, 129, "extract", "[extract] running"),
        (signal.SIGUSR1, 138, "extract", "[extract] running"),
    ],
)
def test_a_signal_ends_the_run_cleanly_and_the_same_command_continues(
    tiny_model_dir, many_chats, tmp_path, sig, code, stage, trigger
):
    # train.echo_steps: speculators' per-step records on the console, where the trigger is.
    # Extraction at one row a batch lasts long enough to be interrupted over 600 rows; training
    # needs 150 of them extracted first.
    cmd = _cmd(
        tiny_model_dir,
        many_chats,
        tmp_path,
        f"data.num_samples={600 if stage == 'extract' else 150}",
        "hardware.extract_batch_size=1",
        "train.max_steps=30",
        "train.echo_steps=true",
    )
    got, out = run_until(cmd, trigger, sig)
    assert got == code, out[-3000:]
    name = signal.Signals(sig).name
    assert f"interrupted by {name} during stage '{stage}'" in out, out[-3000:]
    assert "Traceback" not in out
    assert _statuses(tmp_path) == ["KILLED"]
    assert _leftovers(tmp_path) == []
    scratch = list((tmp_path / "scratch").glob("*")) if (tmp_path / "scratch").exists() else []
    # Only training keeps a work folder: its checkpoints are what the next run resumes from.
    assert all(p.name.startswith("train-") for p in scratch), scratch
    again = run_runner(cmd)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert _statuses(tmp_path) == ["KILLED", "FINISHED"]


@pytest.fixture(scope="module")
def trained(tiny_model_dir, chats_jsonl, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("trained")
    proc = run_runner(_cmd(tiny_model_dir, chats_jsonl, root))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return root


def _flip(path: Path, keep_mtime: bool) -> None:
    st = path.stat()
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 4096] = bytes(b ^ 0xFF for b in data[middle : middle + 4096])
    path.write_bytes(bytes(data))
    if keep_mtime:  # damage that a size and modification-time check cannot see
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_truncated_hidden_state_file_is_named_set_aside_and_recomputed(
    trained, tiny_model_dir, chats_jsonl
):
    (extract,) = (p for p in (trained / "store" / "extract").iterdir() if p.is_dir())
    victim = sorted((extract / "hidden_states").glob("hs_*.safetensors"))[-1]
    victim.write_bytes(victim.read_bytes()[:1000])
    stop = run_runner(
        _cmd(tiny_model_dir, chats_jsonl, trained, "train.lr=7e-4", "run.on_damaged=stop")
    )
    assert stop.returncode == 1
    assert f"hidden_states/{victim.name} is 1000 bytes" in stop.stderr, stop.stderr[-2000:]
    proc = run_runner(_cmd(tiny_model_dir, chats_jsonl, trained, "train.lr=7e-4"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert f"hidden_states/{victim.name} is 1000 bytes" in out and "computing it again" in out
    assert list((trained / "store" / "extract").glob(".damaged-*"))
    assert (extract / "hidden_states" / victim.name).stat().st_size > 1000  # recomputed


def test_a_corrupted_draft_is_never_served(trained, tiny_model_dir, chats_jsonl, tmp_path):
    (train,) = (
        p
        for p in (trained / "store" / "train").iterdir()  # the default lr's draft
        if p.is_dir() and json.loads((p / "manifest.json").read_text())["config"]["lr"] != 7e-4
    )
    _flip(train / "draft" / "model.safetensors", keep_mtime=True)
    base = tiny_overrides(tiny_model_dir, chats_jsonl, trained, CAPTURE)
    # Size and mtime were set back, but the write gave the file a new ctime: the default check
    # hashes it, and the plan refuses to evaluate a damaged draft it cannot compute again.
    with pytest.raises(ConfigError) as info:
        run_job(compose([*base, "run.stages=[evaluate]"]))
    assert info.value.key == "run.stages"
    assert "draft/model.safetensors does not match the sha256" in info.value.message
    # run.verify=full finds it while planning; run.on_damaged=stop names it and stops.
    with pytest.raises(StageError) as info:
        run_job(compose([*base, "run.verify=full", "run.on_damaged=stop"]))
    assert "draft/model.safetensors" in str(info.value) and "run.on_damaged" in str(info.value)


def test_two_first_runs_on_a_fresh_root_both_succeed(tiny_model_dir, chats_jsonl, tmp_path):
    cmd = _cmd(tiny_model_dir, chats_jsonl, tmp_path, "run.stages=[prepare]")
    procs = [start_runner(cmd) for _ in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    assert sorted(_statuses(tmp_path)) == ["FINISHED", "FINISHED"]  # the store is healthy
    computed = sum("prepare   computed" in o for o in outs)
    assert computed == 1, outs  # one computed it, the other found it finished
    assert run_runner(cmd).returncode == 0  # and stays usable


def _mount_tmpfs(where: Path, size: str) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    return (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True
        ).returncode
        == 0
    )


def test_a_full_disk_is_one_clear_line_and_the_rerun_continues(
    tiny_model_dir, chats_jsonl, tmp_path
):
    store = tmp_path / "store"
    if not _mount_tmpfs(store, "400k"):
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        cmd = _cmd(tiny_model_dir, chats_jsonl, tmp_path)
        full = run_runner(cmd)
        assert full.returncode == 1
        line = next(x for x in full.stderr.splitlines() if x.startswith("stage error:"))
        assert "disk full: stage 'extract' could not write" in line and "free on" in line
        assert "the plan estimated" in line and "run.output_root" in line
        assert "Traceback" not in full.stderr
        assert _leftovers(tmp_path) == []
        # Free space (a bigger filesystem, same files) and run the same command.
        subprocess.run(["mount", "-o", "remount,size=64m", str(store)], check=True)
        again = run_runner(cmd)
        assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
        assert "prepare   cached" in again.stdout
    finally:
        subprocess.run(["umount", "-l", str(store)], capture_output=True)


def test_a_read_only_store_is_refused_by_the_plan_naming_the_folder(
    tiny_model_dir, chats_jsonl, tmp_path
):
    """A read-only store/ under a writable root (a read-only mount: root ignores permission
    bits): the plan refuses it in one line naming the folder, before any stage runs."""
    store = tmp_path / "store"
    (store / "prepare").mkdir(parents=True)
    bind = subprocess.run(["mount", "--bind", str(store), str(store)], capture_output=True)
    if bind.returncode != 0:
        pytest.skip("cannot make a read-only mount here (needs root)")
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(store)], check=True)
        got = run_runner(_cmd(tiny_model_dir, chats_jsonl, tmp_path))
        assert got.returncode == 2, got.stdout[-2000:] + got.stderr[-2000:]
        assert "Traceback" not in got.stderr
        line = next(x for x in got.stderr.splitlines() if "run.output_root" in x)
        assert f"cannot write in {store}" in line and "Read-only file system" in line
    finally:
        subprocess.run(["umount", "-l", str(store)], capture_output=True)


def test_a_full_mlflow_artifact_folder_is_one_line_and_the_run_ends_failed(
    tiny_model_dir, chats_jsonl, tmp_path
):
    artifacts = tmp_path / "mlartifacts"
    if not _mount_tmpfs(artifacts, "64k"):
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        got = run_runner(_cmd(tiny_model_dir, chats_jsonl, tmp_path))
        assert got.returncode == 1, got.stdout[-2000:] + got.stderr[-2000:]
        assert "Traceback" not in got.stderr
        line = next(x for x in got.stderr.splitlines() if x.startswith("stage error:"))
        assert "MLflow could not write" in line and str(artifacts) in line
        assert "No space left on device" in line and "tracking.uri" in line
        assert _statuses(tmp_path) == ["FAILED"]
    finally:
        subprocess.run(["umount", "-l", str(artifacts)], capture_output=True)


def test_a_copied_root_never_writes_into_the_original(tiny_model_dir, chats_jsonl, tmp_path):
    """Copy an output root (cp -a) and run in the copy: its new run's artifacts land in the
    copy, the earlier runs' artifact folders and stage paths point into the copy, and nothing
    in the original changes."""
    import shutil

    import mlflow

    first = tmp_path / "first"
    cmd = [*_cmd(tiny_model_dir, chats_jsonl, first), "run.stages=[prepare,extract]"]
    assert run_runner(cmd).returncode == 0
    copy = tmp_path / "copy"
    shutil.copytree(first, copy, symlinks=True)

    def files(root: Path) -> dict[str, float]:
        return {str(p): p.stat().st_mtime for p in root.rglob("*") if p.is_file()}

    before = files(first)
    again = run_runner([*_cmd(tiny_model_dir, chats_jsonl, copy), "run.stages=[prepare,extract]"])
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert "was copied or moved" in again.stdout + again.stderr
    assert files(first) == before, "the run in the copy wrote into the original"
    client = mlflow.MlflowClient(f"sqlite:///{copy / 'mlflow.db'}")
    exp = client.get_experiment_by_name("eagle3")
    assert exp.artifact_location == (copy / "mlartifacts").resolve().as_uri()
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 2
    for run in runs:
        assert run.info.artifact_uri.startswith(copy.resolve().as_uri() + "/"), run.info
        assert run.data.tags["path.extract"].startswith(str(copy.resolve()) + "/")
        assert client.list_artifacts(run.info.run_id)  # readable where they now point


def test_a_store_that_fails_at_the_end_keeps_the_stage_error_and_is_reconciled(
    tiny_model_dir, chats_jsonl, tmp_path
):
    args = [
        *tiny_overrides(tiny_model_dir, chats_jsonl, tmp_path, CAPTURE),
        "+train.extra_args.data_path=/nonexistent/dataset",
    ]
    script = runner_with_failing_end(args)  # as a locked SQLite store makes it fail
    proc = run_runner([sys.executable, "-c", script])
    assert proc.returncode == 1, proc.stderr[-3000:]  # the stage's own error and exit code
    assert "stage error: stage 'train' failed" in proc.stderr
    assert "could not mark MLflow run" in proc.stdout + proc.stderr
    assert str(tmp_path / "mlflow.db") in proc.stdout + proc.stderr
    assert _statuses(tmp_path) == ["RUNNING"]
    run_job(compose(tiny_overrides(tiny_model_dir, chats_jsonl, tmp_path, CAPTURE)))
    assert _statuses(tmp_path) == ["FAILED", "FINISHED"]  # reconciled by the next run
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("eagle3")
    first = client.search_runs([exp.experiment_id], order_by=["start_time"])[0]
    assert "ended without closing this run" in first.data.tags["runner.note"]


def test_what_a_runner_started_dies_at_once_when_it_is_killed(tmp_path):
    # A "runner" that starts a child which starts a grandchild (as vLLM's server starts its
    # engine), then waits; killed with -9, nothing of its tree may survive.
    marker = tmp_path / "grandchild.pid"
    script = textwrap.dedent(f"""
        import subprocess, sys, time
        from pathlib import Path
        from runner.processes.process import ManagedProcess
        child = [sys.executable, "-c",
                 "import subprocess, sys, time; "
                 "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
                 "open({str(marker)!r}, 'w').write(str(p.pid)); time.sleep(600)"]
        with ManagedProcess(child, {{}}, Path({str(tmp_path / "child.log")!r}), label="child"):
            time.sleep(600)
    """)
    runner = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, env=runner_env())
    deadline = time.time() + 60
    while not marker.exists() or not marker.read_text():
        assert time.time() < deadline
        time.sleep(0.1)
    time.sleep(1.0)  # the reaper polls the tree every 0.5 s
    grandchild = int(marker.read_text())
    runner.send_signal(signal.SIGKILL)
    runner.wait()
    t0 = time.time()
    while Path(f"/proc/{grandchild}").exists() and "Z" not in _state(grandchild):
        # Its own end is 600 s away; 10 s leaves room for a loaded CI machine.
        assert time.time() - t0 < 10.0, "the grandchild outlived the runner"
        time.sleep(0.05)


def _marked(mark: str, running: str = "") -> list[int]:
    """Live processes (not zombies) whose environment holds EAGLE3_TEST_MARK=`mark` (and whose
    command line holds `running`)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = (proc / "environ").read_bytes()
            cmd = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        marked = f"EAGLE3_TEST_MARK={mark}".encode() in env.split(b"\0")
        if marked and running.encode() in cmd and _state(int(proc.name)) != "Z":
            found.append(int(proc.name))
    return found


@pytest.fixture(scope="module")
def long_prepare(tmp_path_factory) -> Path:
    """60,000 rows: tokenising them in two processes lasts long enough to be interrupted."""
    return write_chats(tmp_path_factory.mktemp("faults_long") / "chats.jsonl", 60000)


@pytest.mark.parametrize(
    ("sig", "after"),
    # kill -9 where the workers have the least chance to learn of it; SIGTERM mid-way.
    [(signal.SIGKILL, 0.0), (signal.SIGTERM, 1.0)],
    ids=["kill-while-workers-start", "term-while-tokenising"],
)
def test_prepares_worker_processes_end_with_the_runner(
    tiny_model_dir, long_prepare, tmp_path, sig, after
):
    """kill -9 or SIGTERM while prepare tokenises in worker processes, or kill -9 the moment
    they are spawned (before they can ask the kernel to end them with the runner: a CI run
    left both waiting on the pool forever): within 10 s no process the run started is left (the
    workers and multiprocessing's resource tracker each held hundreds of MB for minutes), and
    SIGTERM ends the run in 10 s with 143, not after the chunks in flight: nothing of prepare
    is published.

    Finishing the chunks in flight took about 29 s; stopping at once takes under a second, also
    with four busy processes beside it on two cores. The interpreter's teardown after the run is
    closed (freeing torch, transformers and 60,000 rows) took 2 s alone and 12 s so loaded, and
    failed this bound in CI: the runner now exits without it (runner/__main__.py, _exit_now)."""
    mark = f"{sig.name}-{after}-{os.getpid()}"
    cmd = _cmd(tiny_model_dir, long_prepare, tmp_path, "data.num_samples=60000", "data.num_proc=2")
    proc = start_runner(cmd, {"EAGLE3_TEST_MARK": mark}, stdout=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        # Both workers of the pool are up (spawned: `spawn_main` in their command lines).
        while len(_marked(mark, "spawn_main")) < 2:
            assert proc.poll() is None and time.time() < deadline, "the pool never started"
            time.sleep(0.05)
        time.sleep(after)
        t0 = time.time()
        proc.send_signal(sig)
        code = proc.wait(timeout=30)
        assert time.time() - t0 < 10.0, f"took {time.time() - t0:.1f} s to exit"
        assert code == (-9 if sig == signal.SIGKILL else 143)
        assert not list((tmp_path / "store").glob("prepare/*/manifest.json")), "prepare finished"
        while _marked(mark) and time.time() - t0 < 10.0:
            time.sleep(0.1)
        assert _marked(mark) == [], "processes of the run outlived it"
    finally:
        for pid in [proc.pid, *_marked(mark)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "Z"


def test_a_signal_as_the_last_stage_ends_never_leaves_the_run_running(
    tiny_model_dir, chats_jsonl, tmp_path
):
    """SIGTERM the moment the last stage is published, while the run's outputs are logged and
    the run is closed: wherever it lands, the run ends KILLED (or FINISHED, when it came while
    the finished run was being closed), never RUNNING, and the process exits 143."""
    cmd = _cmd(tiny_model_dir, chats_jsonl, tmp_path)
    got, out = run_until(cmd, "[train] computed in", signal.SIGTERM)
    assert got == 143, out[-3000:]
    assert "Traceback" not in out
    assert _statuses(tmp_path) in (["KILLED"], ["FINISHED"]), out[-3000:]


def test_an_interrupted_sweep_ends_its_parent_killed(tiny_model_dir, chats_jsonl, tmp_path):
    """SIGTERM in a sweep's second job: the job's run and the sweep's parent both end KILLED
    (the parent used to stay RUNNING until a later run reconciled it), and the line says how to
    continue the sweep."""
    base = _cmd(tiny_model_dir, chats_jsonl, tmp_path)
    cmd = [*base[:3], "-m", *base[3:], "train.lr=1e-3,2e-3"]  # python -m runner -m ...
    got, out = run_until(cmd, "#1 :", signal.SIGTERM)
    assert got == 143, out[-3000:]
    # The hint continues the sweep (its finished job reused), not the stopped job alone.
    (hint,) = [line for line in out.splitlines() if line.startswith("interrupted by SIGTERM")]
    assert " -m " in hint and "train.lr=1e-3,2e-3" in hint, hint
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("eagle3")
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if r.info.run_name.startswith("sweep ")]
    assert [p.info.status for p in parents] == ["KILLED"], [r.info.status for r in runs]
    assert "RUNNING" not in [r.info.status for r in runs]
    # report on the stopped sweep: the parent says it was stopped; the finished job is kept.
    import contextlib
    import io

    from runner.commands.report import main as report

    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):
        report([parents[0].info.run_id, "--output-root", str(tmp_path)])
    assert "KILLED" in shown.getvalue().splitlines()[0] and "FINISHED" in shown.getvalue()
