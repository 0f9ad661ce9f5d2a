"""Content-keyed artifact store: one folder per (stage, key), published atomically.

Layout: `<output_root>/store/<stage>/<key>/` holding the stage's files and `manifest.json`.
The key hashes the stage's config slice, its upstream keys, its own VERSION and the library
versions that change its output, so a changed training setting gives `train` (and everything
downstream) a new key while `prepare`/`extract`/`vocab` keep theirs.

A stage writes into `<output_root>/store/<stage>/.tmp-<key>-<pid>/`; only a completed stage is
renamed into place, with its manifest written last inside the temporary folder. A folder without
a manifest is never trusted, so an interrupted run leaves nothing a later run would reuse.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from runner.errors import ConfigError

log = logging.getLogger("runner")

MANIFEST = "manifest.json"
# Above this many bytes an artifact records file sizes only: hashing terabytes of hidden
# states would cost more than extracting them.
HASH_LIMIT_BYTES = 8 << 30


def writable_root(path: Path) -> Path:
    """run.output_root, created if needed; refused naming the key if it cannot be written."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError("run.output_root", f"cannot create {path}: {exc.strerror}") from None
    try:  # os.access says yes to root everywhere; a real file says whether writes work
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ConfigError("run.output_root", f"cannot write in {path}: {exc.strerror}") from None
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
        entry: dict[str, Any] = {"path": str(p.relative_to(folder)), "bytes": p.stat().st_size}
        if hashed:
            entry["sha256"] = _sha256(p)
        listing.append(entry)
    return listing, total


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
        self.root = Path(root) / "store"

    def path(self, stage: str, key: str) -> Path:
        return self.root / stage / key

    def get(self, stage: str, key: str) -> Artifact | None:
        """The finished artifact for this key, or None (a folder without manifest is not one)."""
        p = self.path(stage, key)
        if (p / MANIFEST).is_file():
            return Artifact(stage, key, p)
        return None

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
        return self.root.parent / "scratch" / f"{stage}-{key}"

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
        tmp = final.parent / f".tmp-{key}-{os.getpid()}"
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
                old = final.parent / f".old-{key}-{os.getpid()}"
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
