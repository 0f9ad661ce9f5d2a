"""Content-keyed artifact store: one folder per (stage, key), published atomically.

Layout: `<output_root>/store/<stage>/<key>/` holding the stage's files and `manifest.json`.
The key hashes the stage's config slice, its upstream keys, its own VERSION and the library
versions that change its output, so a changed training setting gives `train` (and everything
downstream) a new key while `prepare`/`extract`/`vocab` keep theirs.

A stage writes into `<output_root>/store/<stage>/.tmp-<key>-<host>-<pid>/`; only a completed
stage is renamed into place, with its manifest written last inside the temporary folder. A
folder without a manifest is never trusted, so an interrupted run leaves nothing a later run
would reuse, and the next run on the same host removes what a dead process left. On reuse a
stage's files are checked against its manifest (`damage`): sizes always, sha256 of files whose
mtime, ctime or inode changed since publication, of every file with run.verify=full.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from runner.core.errors import ConfigError
from runner.core.layout import RunLayout, user_cache

log = logging.getLogger("runner")

MANIFEST = "manifest.json"
# Above this many bytes an artifact records file sizes only: hashing terabytes of hidden
# states would cost more than extracting them.
HASH_LIMIT_BYTES = 8 << 30


def _probe(folder: Path) -> None:
    try:  # os.access says yes to root everywhere; a real file says whether writes work
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ConfigError(
            "run.output_root",
            f"cannot write in {folder}: {exc.strerror}; make it writable or choose another "
            "run.output_root",
        ) from None


def writable_root(path: Path) -> Path:
    """run.output_root, created if needed, and every folder under it that a run writes and that
    exists already (a read-only store/ under a writable root failed mid-run); refused naming the
    key and the folder if one cannot be written."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError("run.output_root", f"cannot create {path}: {exc.strerror}") from None
    _probe(path)
    layout = RunLayout(path)
    store = layout.store
    for folder in (store, store / ".locks", layout.scratch, layout.cache, layout.models):
        if folder.is_dir():
            _probe(folder)
    for folder in sorted(store.iterdir()) if store.is_dir() else []:
        if folder.is_dir() and not folder.name.startswith("."):  # one per stage
            _probe(folder)
    if layout.mlflow_artifacts.is_dir():
        _probe(layout.mlflow_artifacts)
    return path


def compute_key(
    stage: str, version: str, config_slice: Any, upstream: dict[str, str], versions: dict[str, str]
) -> str:
    payload = json.dumps(
        {
            "stage": stage,
            "version": version,
            "config": config_slice,
            "upstream": upstream,
            "versions": versions,
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def _sha256(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def describe_files(folder: Path) -> tuple[list[dict[str, Any]], int]:
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
    total = sum(p.stat().st_size for p in files)
    hashed = total <= HASH_LIMIT_BYTES
    listing = []
    for p in files:
        st = p.stat()
        entry: dict[str, Any] = {
            "path": str(p.relative_to(folder)),
            "bytes": st.st_size,
            "mtime_ns": st.st_mtime_ns,
            # An edit that keeps size and mtime (a tool that sets them back) still gives the
            # file a new ctime, which nothing can set back, or a new inode.
            "ctime_ns": st.st_ctime_ns,
            "inode": st.st_ino,
        }
        if hashed:
            entry["sha256"] = _sha256(p)
        listing.append(entry)
    return listing, total


# Below this many free bytes after a failed write, the disk is taken to be full even when the
# error does not say so (torch's checkpoint writer reports "unexpected pos").
_NEARLY_FULL = 16 << 20


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def filesystem_root(path: Path) -> Path:
    """The mount point of the filesystem that holds `path`."""
    p = path.resolve()
    while not p.exists():
        p = p.parent
    while not os.path.ismount(p):
        p = p.parent
    return p


def free_bytes(path: Path) -> int:
    """Free bytes on the filesystem that holds `path` (or would, once created)."""
    p = path
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def disk_full(exc: BaseException, where: Path) -> bool:
    """Whether `exc` (or what caused it) is a full disk or quota under `where`."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(e) or "Disk quota exceeded" in str(e):
            return True
        e = e.__cause__ or e.__context__
    try:
        return free_bytes(where) < _NEARLY_FULL
    except OSError:
        return False


def full_path(exc: BaseException, where: Path) -> Path:
    """The file a full disk refused (the error's own filename: a stage's scratch folder or the
    system's temporary folder may lie on another filesystem than its output), else `where`."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        name = getattr(e, "filename", None)
        if isinstance(e, OSError) and name and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return Path(name)
        e = e.__cause__ or e.__context__
    return where


def damage(art: Artifact, full: bool = False, under: str = "") -> str | None:
    """What is wrong with a published artifact's files (those under `under`), or None.

    Every file must exist with the size its manifest records. A file is hashed when `full`, or
    when its mtime, ctime or inode differs from the one recorded at publication (an edit in
    place, even one that set size and mtime back; a bit flip written by anything; a copied
    root, whose files are hashed once there and then remembered by their new stamp); its sha256
    must match. Artifacts above HASH_LIMIT_BYTES recorded sizes only."""
    try:
        files = art.manifest.get("files", [])
    except (OSError, ValueError) as exc:
        return f"{MANIFEST} is unreadable ({type(exc).__name__})"
    verified = _Verified(RunLayout(art.path.parents[2]).cache / VERIFIED_FILE)
    try:
        for f in files:
            if not f["path"].startswith(under):
                continue
            p = art.path / f["path"]
            try:
                st = p.stat()
            except OSError:
                return f"{f['path']} is missing"
            if st.st_size != f["bytes"]:
                return f"{f['path']} is {st.st_size} bytes; its manifest records {f['bytes']}"
            now = {"mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "inode": st.st_ino}
            touched = any(f.get(k, v) != v for k, v in now.items())
            if "sha256" not in f or not (full or touched):
                continue
            stamp = f"{p}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}|{st.st_ino}"
            if not full and verified.get(stamp) == f["sha256"]:
                continue  # hashed since it last changed (e.g. in a copied root), and it matched
            if _sha256(p) != f["sha256"]:
                return f"{f['path']} does not match the sha256 its manifest records"
            if touched:
                verified.add(stamp, f["sha256"])
    finally:
        verified.save()
    return None


# Files hashed and found intact although their stamp differs from the manifest's (a copied
# root: every inode differs), by their current stamp: not hashed again until it changes.
VERIFIED_FILE = "verified_files.json"


class _Verified:
    def __init__(self, path: Path):
        self.path, self.added = path, False
        try:
            self.known: dict[str, str] = json.loads(path.read_text())
        except (OSError, ValueError):
            self.known = {}

    def get(self, stamp: str) -> str | None:
        return self.known.get(stamp)

    def add(self, stamp: str, sha: str) -> None:
        self.known[stamp] = sha
        self.added = True

    def save(self) -> None:
        """Best effort (a cache: an unwritable one costs hashing time, never correctness);
        entries of files that are gone are dropped."""
        if not self.added:
            return
        keep = {k: v for k, v in self.known.items() if Path(k.split("|", 1)[0]).exists()}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
            tmp.write_text(json.dumps(keep))
            os.replace(tmp, self.path)
        except OSError:
            pass


# Temporary folders carry their owner (host and pid): a later run on the same host removes those
# of dead processes; a store shared by several nodes never loses another node's work in progress.
_HOST = socket.gethostname().replace("-", "_")
_OWNER = f"{_HOST}-{os.getpid()}"
_TEMP = re.compile(r"^\.(tmp|old)-(?P<key>[0-9a-f]+)-(?P<host>[^-]+)-(?P<pid>\d+)$")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def dead_temps(root: Path) -> list[Path]:
    """Temporary folders under the store `root` left by dead processes of this host."""
    out = []
    for folder in sorted(root.glob("*/.*")):
        m = _TEMP.match(folder.name)
        if m and m["host"] == _HOST and not pid_alive(int(m["pid"])):
            out.append(folder)
    return out


def _writes() -> Path:
    """The ledger of folders being written by `new_folder`, one entry per write: a write killed
    outright (kill -9: no handler runs) leaves its entry, and `runner.commands.gc` lists its
    folder."""
    return user_cache() / "writes"


def killed_writes() -> list[tuple[Path, Path, str]]:
    """(ledger entry, half-written folder, the folder it was for) of every write by a process
    that died before finishing it."""
    out = []
    for entry in sorted(_writes().glob("*.json")) if _writes().is_dir() else []:
        try:
            rec = json.loads(entry.read_text())
        except (OSError, ValueError):
            continue
        if rec.get("host") == _HOST and not pid_alive(int(rec["pid"])):
            out.append((entry, Path(rec["tmp"]), str(rec["out"])))
    return out


@contextmanager
def new_folder(out: Path) -> Iterator[Path]:
    """A folder a user asked for (a published or packed draft): written beside `out`, its files
    made readable by all, renamed into place only when complete; a non-empty `out` is refused
    and nothing half-written is left on failure (a kill -9 leaves a ledger entry that
    `runner.commands.gc` finds, and the next write to `out` removes the folder)."""
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty")
    # What a killed earlier attempt (kill -9: no handler runs) left beside `out`.
    if out.parent.is_dir():
        for old in out.parent.glob(f".tmp-{out.name}-*"):
            pid = old.name.rsplit("-", 1)[-1]
            if pid.isdigit() and not pid_alive(int(pid)):
                shutil.rmtree(old, ignore_errors=True)
    tmp = out.with_name(f".tmp-{out.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tag = hashlib.sha256(bytes(tmp)).hexdigest()[:12]
    entry: Path | None = _writes() / f"{os.getpid()}-{tag}.json"
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        record = {"pid": os.getpid(), "host": _HOST, "tmp": str(tmp.resolve()), "out": str(out)}
        entry.write_text(json.dumps(record))
    except OSError:  # bookkeeping for gc only: never a reason to refuse the write
        entry = None
    try:
        tmp.mkdir(parents=True)
        yield tmp
        for f in tmp.iterdir():
            f.chmod(0o644)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if entry is not None:
            entry.unlink(missing_ok=True)


@dataclass
class Artifact:
    stage: str
    key: str
    path: Path

    @property
    def manifest(self) -> dict[str, Any]:
        return json.loads((self.path / MANIFEST).read_text())


class ArtifactStore:
    def __init__(self, root: Path):
        self.root = RunLayout(Path(root)).store

    def path(self, stage: str, key: str) -> Path:
        return self.root / stage / key

    def get(self, stage: str, key: str) -> Artifact | None:
        """The finished artifact for this key, or None (a folder without manifest is not one)."""
        p = self.path(stage, key)
        if (p / MANIFEST).is_file():
            return Artifact(stage, key, p)
        return None

    def remove_dead_temps(self) -> list[Path]:
        """Remove what killed runs of this host left half-written (their pid names them), and
        lock files nobody holds (a run killed with -9 leaves its lock file behind)."""
        removed = dead_temps(self.root) if self.root.is_dir() else []
        for folder in removed:
            shutil.rmtree(folder, ignore_errors=True)
            log.info("removed %s, left half-written by a process that no longer runs", folder)
        for path in sorted((self.root / ".locks").glob("*.lock")):
            lock = FileLock(str(path))
            try:
                lock.acquire(timeout=0)
            except (Timeout, OSError):
                continue  # held: another job is computing that artifact
            try:
                with contextlib.suppress(OSError):
                    path.unlink()  # while held, as in lock(): a waiter opens a fresh file
                removed.append(path)
            finally:
                lock.release()
        return removed

    def set_aside(self, art: Artifact) -> Path:
        """Move a damaged artifact out of the way (kept for inspection, never reused)."""
        aside = art.path.parent / f".damaged-{art.key}-{time.strftime('%Y%m%d-%H%M%S')}"
        os.replace(art.path, aside)
        return aside

    def latest(self, stage: str, limit: int = 200) -> Artifact | None:
        """The most recently published artifact of `stage` (of the `limit` newest folders)."""
        folder = self.root / stage
        if not folder.is_dir():
            return None
        found = [p for p in folder.iterdir() if not p.name.startswith(".")]
        found = [p for p in found if (p / MANIFEST).is_file()]
        found.sort(key=lambda p: (p / MANIFEST).stat().st_mtime, reverse=True)
        return Artifact(stage, found[0].name, found[0]) if found[:limit] else None

    def scratch(self, stage: str, key: str) -> Path:
        """A stage's working folder outside the artifact (kept for resumable stages)."""
        return RunLayout(self.root.parent).scratch / f"{stage}-{key}"

    def computing(self, stage: str, key: str) -> bool:
        """Whether a live process holds (stage, key)'s lock: computing it now, its work folder
        in use (a lock file nobody holds is a dead run's)."""
        path = self.root / ".locks" / f"{stage}-{key}.lock"
        if not path.is_file():
            return False
        lock = FileLock(str(path))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            return True
        except OSError:  # a read-only store: nobody can be computing in it from here
            return False
        lock.release()
        return False

    @contextmanager
    def lock(self, stage: str, key: str) -> Iterator[None]:
        """Exclusive right to compute (stage, key): concurrent sweep jobs that need the same
        artifact compute it once; the others wait here, then find it finished."""
        # Locks live apart from the artifacts: a stage folder holds artifacts only.
        folder = self.root / ".locks"
        path = folder / f"{stage}-{key}.lock"
        lock = FileLock(str(path))
        for attempt in range(5):
            folder.mkdir(parents=True, exist_ok=True)
            try:
                try:
                    lock.acquire(timeout=0)
                except Timeout:
                    log.info("[%s] waiting for %s: another job is computing it", stage, key)
                    lock.acquire()
                break
            except FileNotFoundError:  # another job removed the empty folder meanwhile
                if attempt == 4:
                    raise
        try:
            yield
        finally:
            # Removed while still held: a job waiting on this file then finds it unlinked and
            # opens a fresh one (filelock checks), so no lock files pile up.
            with contextlib.suppress(OSError):
                path.unlink()
            lock.release()
            for empty in (folder, self.root):  # only if empty
                with contextlib.suppress(OSError):
                    empty.rmdir()

    @contextmanager
    def writing(self, stage: str, key: str, manifest: dict[str, Any]) -> Iterator[Path]:
        """Yield a temporary folder; publish it under (stage, key) only if the block succeeds.

        The caller fills `manifest` (it is the same dict object) with metrics while writing;
        files, sizes, hashes and timings are added here.
        """
        final = self.path(stage, key)
        tmp = final.parent / f".tmp-{key}-{_OWNER}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        started = time.time()
        try:
            yield tmp
            files, total = describe_files(tmp)
            manifest.update(
                stage=stage,
                key=key,
                files=files,
                total_bytes=total,
                started_at=started,
                finished_at=time.time(),
                seconds=round(time.time() - started, 3),
            )
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str))
            if final.exists():  # a forced re-run replaces the old artifact
                old = final.parent / f".old-{key}-{_OWNER}"
                os.replace(final, old)
                os.replace(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            for empty in (final.parent, self.root):  # a failed first artifact leaves no folder
                with contextlib.suppress(OSError):
                    empty.rmdir()
