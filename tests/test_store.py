"""The artifact store: keys that move with what changes the output, atomic publishing."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from runner.core.store import MANIFEST, ArtifactStore, compute_key
from tests.conftest import REPO


def test_key_depends_on_config_upstream_and_versions():
    base = compute_key("train", "1", {"lr": 1e-3}, {"extract": "a"}, {"speculators": "0.9.0"})
    assert base == compute_key(
        "train", "1", {"lr": 1e-3}, {"extract": "a"}, {"speculators": "0.9.0"}
    )
    assert base != compute_key(
        "train", "1", {"lr": 2e-3}, {"extract": "a"}, {"speculators": "0.9.0"}
    )
    assert base != compute_key(
        "train", "1", {"lr": 1e-3}, {"extract": "b"}, {"speculators": "0.9.0"}
    )
    assert base != compute_key(
        "train", "1", {"lr": 1e-3}, {"extract": "a"}, {"speculators": "0.9.1"}
    )
    assert base != compute_key(
        "train", "2", {"lr": 1e-3}, {"extract": "a"}, {"speculators": "0.9.0"}
    )


def test_publish_is_atomic_and_records_files(tmp_path):
    store = ArtifactStore(tmp_path)
    manifest: dict = {"metrics": {"x": 1}}
    with store.writing("vocab", "k1", manifest) as out:
        (out / "d2t.npy").write_bytes(b"12345")
        assert store.get("vocab", "k1") is None  # not visible while being written
    art = store.get("vocab", "k1")
    assert art is not None
    m = json.loads((art.path / MANIFEST).read_text())
    st = (art.path / "d2t.npy").stat()  # times and inode unchanged by the rename into place
    assert m["files"] == [
        {
            "path": "d2t.npy",
            "bytes": 5,
            "mtime_ns": st.st_mtime_ns,
            "ctime_ns": st.st_ctime_ns,
            "inode": st.st_ino,
            "sha256": "5994471abb01112afcc18159f6cc74b4f511b99806da59b3caf5a9c173cacfc5",
        }
    ]
    assert m["total_bytes"] == 5 and m["seconds"] >= 0


def test_an_interrupted_write_leaves_nothing(tmp_path):
    store = ArtifactStore(tmp_path)
    with pytest.raises(KeyboardInterrupt), store.writing("extract", "k2", {}) as out:
        (out / "hs_0.safetensors").write_bytes(b"partial")
        raise KeyboardInterrupt
    assert store.get("extract", "k2") is None
    assert not (tmp_path / "store").exists()  # not even an empty folder


def test_a_folder_without_manifest_is_not_trusted(tmp_path):
    store = ArtifactStore(tmp_path)
    (tmp_path / "store" / "train" / "k3").mkdir(parents=True)
    assert store.get("train", "k3") is None


def test_a_forced_rerun_replaces_the_artifact(tmp_path):
    store = ArtifactStore(tmp_path)
    for content in (b"old", b"new"):
        with store.writing("train", "k4", {}) as out:
            (out / "f").write_bytes(content)
    assert (store.get("train", "k4").path / "f").read_bytes() == b"new"
    assert sorted(p.name for p in (tmp_path / "store" / "train").iterdir()) == ["k4"]


def _published(store: ArtifactStore, key: str = "k9") -> Path:
    with store.writing("extract", key, {}) as out:
        (out / "hidden_states").mkdir()
        (out / "hidden_states" / "hs_0.safetensors").write_bytes(bytes(range(256)) * 64)
        (out / "layer_stats.json").write_text("{}")
    return store.get("extract", key).path


def test_damage_names_the_file_a_truncation_or_an_edit_broke(tmp_path):
    from runner.core.store import damage

    store = ArtifactStore(tmp_path)
    path = _published(store)
    art = store.get("extract", "k9")
    assert damage(art) is None and damage(art, full=True) is None
    hs = path / "hidden_states" / "hs_0.safetensors"
    st = hs.stat()
    flipped = bytearray(hs.read_bytes())
    flipped[100] ^= 0xFF
    hs.write_bytes(bytes(flipped))
    os.utime(hs, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size, same time set back
    assert hs.stat().st_mtime_ns == st.st_mtime_ns and hs.stat().st_size == st.st_size
    # The write gave it a new ctime, which nothing sets back: hashed even by the cheap check.
    assert "hs_0.safetensors does not match the sha256" in damage(art)
    assert "hs_0.safetensors does not match the sha256" in damage(art, full=True)
    hs.write_bytes(bytes(flipped))  # an edit that moves the time is hashed as well
    assert "does not match the sha256" in damage(art)
    hs.write_bytes(b"short")
    assert damage(art) == "hidden_states/hs_0.safetensors is 5 bytes; its manifest records 16384"
    hs.unlink()
    assert damage(art) == "hidden_states/hs_0.safetensors is missing"


def test_a_copied_roots_files_are_hashed_once_then_by_their_new_stamp(tmp_path, monkeypatch):
    """cp -a gives every file a new inode, so the cheap check hashes them all; once found
    intact they are remembered by their new stamp and not hashed on every plan again, while a
    later edit (size and mtime kept) is still caught."""
    import shutil

    import runner.core.store as store_module
    from runner.core.store import damage

    _published(ArtifactStore(tmp_path / "a"))
    shutil.copytree(tmp_path / "a", tmp_path / "b", symlinks=True)
    art = ArtifactStore(tmp_path / "b").get("extract", "k9")
    hashed: list[Path] = []
    real = store_module._sha256
    monkeypatch.setattr(store_module, "_sha256", lambda p: hashed.append(p) or real(p))
    assert damage(art) is None and hashed  # the copy's files: hashed once
    count = len(hashed)
    assert damage(art) is None and len(hashed) == count  # remembered: not again
    hs = art.path / "hidden_states" / "hs_0.safetensors"
    st = hs.stat()
    flipped = bytearray(hs.read_bytes())
    flipped[100] ^= 0xFF
    hs.write_bytes(bytes(flipped))
    os.utime(hs, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert "hs_0.safetensors does not match the sha256" in damage(art)


def test_only_temporary_folders_of_dead_processes_are_removed(tmp_path):
    import subprocess

    from runner.core.store import _HOST

    store = ArtifactStore(tmp_path)
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer runs
    stage = tmp_path / "store" / "extract"
    gone = stage / f".tmp-abc123-{_HOST}-{dead.pid}"
    mine = stage / f".tmp-abc124-{_HOST}-{os.getpid()}"
    other_host = stage / f".tmp-abc125-elsewhere-{dead.pid}"
    for folder in (gone, mine, other_host):
        folder.mkdir(parents=True)
    stale_lock = tmp_path / "store" / ".locks" / "extract-abc123.lock"  # a kill -9 leaves it
    stale_lock.parent.mkdir()
    stale_lock.touch()
    assert store.remove_dead_temps() == [gone, stale_lock]
    assert not gone.exists() and mine.exists() and other_host.exists()
    assert not stale_lock.exists()


def test_gc_lists_by_default_and_removes_on_request(tmp_path, capsys):
    from runner.commands.gc import main as gc

    store = ArtifactStore(tmp_path)
    _published(store, "k1")
    leftover = store.scratch("extract", "k1")  # its artifact is published
    resume = store.scratch("train", "k2")  # an unfinished stage's checkpoints
    for folder in (leftover, resume):
        folder.mkdir(parents=True)
        (folder / "f").write_bytes(b"x" * 1000)
    _published(store, "k3")
    aside = store.set_aside(store.get("extract", "k3"))
    assert gc(["--root", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "damaged" in out and "leftover" in out and "resume" in out
    assert leftover.exists() and aside.exists()  # a dry run removes nothing
    assert gc(["--root", str(tmp_path), "--delete"]) == 0
    assert not leftover.exists() and not aside.exists() and resume.exists()


def test_gc_never_removes_the_work_folder_of_a_running_job(tmp_path, capsys):
    """A training in progress holds its stage's lock: gc --delete --resume-state keeps its work
    folder (its checkpoints) and says why; once the job is gone the folder is resume state."""
    import subprocess
    import sys

    from runner.commands.gc import main as gc

    store = ArtifactStore(tmp_path)
    work = store.scratch("train", "k9")
    work.mkdir(parents=True)
    (work / "checkpoint").write_bytes(b"x" * 1000)
    lock = tmp_path / "store" / ".locks" / "train-k9.lock"
    lock.parent.mkdir(parents=True)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from filelock import FileLock; l = FileLock(sys.argv[1]); "
            "l.acquire(); print('held', flush=True); time.sleep(120)",
            str(lock),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        assert gc(["--root", str(tmp_path), "--delete", "--resume-state"]) == 0
        out = capsys.readouterr().out
        assert "in use" in out and "being computed by a running job" in out
        assert (work / "checkpoint").exists()
    finally:
        holder.kill()
        holder.wait()
    assert gc(["--root", str(tmp_path), "--delete", "--resume-state"]) == 0
    assert "resume" in capsys.readouterr().out and not work.exists()


def test_gc_offers_no_artifact_on_the_word_of_a_store_it_cannot_read(tmp_path, monkeypatch, capsys):
    """A root whose mlflow.db is gone, emptied or damaged names no run: --unreferenced would
    offer every artifact, the trained draft included. gc refuses (exit 2) and lists none; the
    same root with a whole store lists only what no run names."""
    import mlflow

    from runner.commands.gc import main as gc
    from runner.core.layout import RunLayout

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    store = ArtifactStore(tmp_path)
    _published(store, "k1")
    db = RunLayout(tmp_path).mlflow_db
    for state in ("missing", "empty", "damaged"):
        if state == "empty":
            db.write_bytes(b"")
        elif state == "damaged":
            db.write_bytes(b"SQLite format 3\x00" + b"\xff" * 2000)
        assert gc(["--output-root", str(tmp_path), "--unreferenced", "--delete"]) == 2, state
        captured = capsys.readouterr()
        assert "lists none" in captured.err and "unreferenced" not in captured.out, state
        assert store.get("extract", "k1") is not None, state
    db.unlink()
    client = mlflow.MlflowClient(f"sqlite:///{db}")
    client.create_run(client.create_experiment("eagle3"))  # a run that names no artifact
    assert gc(["--output-root", str(tmp_path), "--unreferenced"]) == 0
    assert "unreferenced" in capsys.readouterr().out


def test_a_signalled_companion_command_leaves_nothing_and_exits_128_plus_signal(tmp_path, capsys):
    """publish and transfer run under `companion`: SIGTERM while the folder is half-written ends
    the command with one line and 143, and the half-written folder is gone; a folder a killed
    (-9) attempt left is removed by the next attempt."""
    import signal
    import time

    from runner.core.interrupts import companion
    from runner.core.store import new_folder

    out = tmp_path / "packed"

    def work() -> int:
        with new_folder(out) as tmp:
            (tmp / "half.bin").write_bytes(b"x" * 1000)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the signal arrives before this ends
        return 0

    assert companion("transfer", work) == 143
    assert "transfer: interrupted by SIGTERM" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    dead = tmp_path / ".tmp-packed-999999999"  # a pid no process has
    dead.mkdir()
    with new_folder(out) as tmp:
        (tmp / "ok").write_text("1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["packed"]


def test_gc_finds_what_a_killed_publish_or_transfer_was_writing(tmp_path, monkeypatch, capsys):
    """kill -9 while `new_folder` writes (publish, transfer): no handler runs, so the half-written
    folder stays beside the output, wherever that is; `runner.commands.gc` lists it from the ledger
    of
    writes and removes it, and the ledger entry, with --delete."""
    import signal
    import subprocess
    import sys
    import textwrap
    import time

    from runner.commands import gc

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    out = tmp_path / "elsewhere" / "packed"
    ready = tmp_path / "ready"
    script = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from runner.core.store import new_folder
        with new_folder(Path({str(out)!r})) as tmp:
            (tmp / "half.bin").write_bytes(b"x" * 1000)
            Path({str(ready)!r}).write_text("1")
            time.sleep(60)
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen([sys.executable, "-c", script], env=env)
    deadline = time.time() + 60
    while not ready.exists():
        assert child.poll() is None and time.time() < deadline
        time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    child.wait()
    half = out.with_name(f".tmp-packed-{child.pid}")
    assert half.is_dir()
    root = tmp_path / "root"
    root.mkdir()
    assert gc.main(["--root", str(root)]) == 0
    listed = capsys.readouterr().out
    assert str(half) in listed and "killed command writing" in listed
    assert gc.main(["--root", str(root), "--delete"]) == 0
    assert not half.exists()
    assert list((tmp_path / "cache" / "eagle3-runner" / "writes").glob("*.json")) == []


def test_a_full_disk_is_named_by_the_file_it_refused(tmp_path):
    """A write refused for space names the file that was refused (a stage's scratch or the
    system's temporary folder may be another filesystem than its output), else the output."""
    import errno

    from runner.core.store import full_path

    refused = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "scratch" / "x"))
    wrapped = RuntimeError("a library's own error")
    wrapped.__cause__ = refused
    assert full_path(wrapped, tmp_path / "store") == tmp_path / "scratch" / "x"
    assert full_path(RuntimeError("no file named"), tmp_path / "store") == tmp_path / "store"
