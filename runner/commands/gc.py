"""List, and on request remove, what an output root holds that nothing uses.

    eagle3-runner gc                          # dry run on ./outputs (or $EAGLE3_RUNNER_HOME)
    eagle3-runner gc --output-root /data/runs --delete
    eagle3-runner gc --delete --unreferenced  # also artifacts no MLflow run refers to
(`python -m runner.commands.gc` is the same tool.)

What it finds:
- half-written temporary folders of dead processes on this host (`.tmp-*`, `.old-*`), in the
  store and, wherever they were writing, those of a killed `runner.commands.publish` or
  `runner.assets.transfer`
  (from the ledger in ~/.cache/eagle3-runner/writes);
- damaged artifacts the runner moved aside (`.damaged-*`);
- work folders (`scratch/<stage>-<key>`) whose artifact is published (leftovers), and those that
  are resume state of an unfinished stage (listed; removed only with --resume-state); the work
  folder of a stage a live job is computing (it holds the stage's lock) is never removed;
- with --unreferenced: published artifacts that no MLflow run of the root's store names (tags
  `artifact.<stage>`) and that no such artifact was made from (its manifest's inputs).
Nothing is removed without --delete.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from runner.core.layout import RunLayout, default_root
from runner.core.store import MANIFEST, ArtifactStore, dead_temps, fmt_bytes, killed_writes
from runner.tracking.runs import sqlite_damage, tracking_uri


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


class Unreadable(Exception):
    """The root's MLflow store cannot say which artifacts its runs use."""


def _referenced(root: Path, store: ArtifactStore) -> set[tuple[str, str]]:
    """(stage, key) of every artifact an MLflow run of this root names, and what they came
    from. Read through MLflow's client; never creates a store."""
    uri = tracking_uri(None, root)
    if uri.startswith("sqlite:///"):
        # No store, or one that cannot be read, names nothing: every artifact would look unused.
        db = Path(uri[len("sqlite:///") :])
        problem = sqlite_damage(db) if db.is_file() else f"there is no MLflow store at {db}"
        if problem:
            raise Unreadable(problem)
    import mlflow  # seconds; only for --unreferenced

    client = mlflow.MlflowClient(uri)
    named: set[tuple[str, str]] = set()
    for exp in client.search_experiments():
        for run in client.search_runs([exp.experiment_id], max_results=50000):
            for tag, value in run.data.tags.items():
                if tag.startswith("artifact."):
                    named.add((tag[len("artifact.") :], value))
    todo, seen = list(named), set(named)
    while todo:  # what each named artifact was made from is in use too
        stage, key = todo.pop()
        art = store.get(stage, key)
        if art is None:
            continue
        for up, info in art.manifest.get("inputs", {}).items():
            item = (up, info.get("key"))
            if item not in seen:
                seen.add(item)
                todo.append(item)
    return seen


def find(root: Path, unreferenced: bool) -> list[tuple[str, Path, str]]:
    """(kind, path, note) of everything removable; kind "resume" is kept unless asked."""
    store = ArtifactStore(root)
    found: list[tuple[str, Path, str]] = [
        ("half-written", p, "left by a dead process") for p in dead_temps(store.root)
    ]
    found += [
        ("damaged", p, "moved aside by a run") for p in sorted(store.root.glob("*/.damaged-*"))
    ]
    # Anywhere on this host: what a killed `runner.commands.publish` or `runner.assets.transfer`
    # was writing.
    for entry, tmp, out in killed_writes():
        if tmp.exists():
            found.append(("half-written", tmp, f"left by a killed command writing {out}"))
        found.append(("ledger", entry, "the record of that killed write"))
    for work in sorted(RunLayout(root).scratch.glob("*-*")):
        stage, _, key = work.name.rpartition("-")
        if store.computing(stage, key):  # a live run's: never listed for removal
            found.append(("in use", work, f"{stage} {key} is being computed by a running job"))
        elif store.get(stage, key) is not None:
            found.append(("leftover", work, f"{stage} {key} is published"))
        else:
            found.append(("resume", work, f"resume state of unfinished {stage} {key}"))
    if unreferenced:
        used = _referenced(root, store)
        for manifest in sorted(store.root.glob(f"*/*/{MANIFEST}")):
            art = manifest.parent
            if not art.parent.name.startswith(".") and (art.parent.name, art.name) not in used:
                found.append(("unreferenced", art, "no MLflow run names it"))
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="eagle3-runner gc", description=__doc__.splitlines()[0])
    # --root: the name before the companions shared one vocabulary; still accepted.
    ap.add_argument(
        "--output-root",
        "--root",
        dest="root",
        type=Path,
        default=Path(default_root()),
        metavar="DIR",
        help="run.output_root (default: $EAGLE3_RUNNER_HOME, else ./outputs)",
    )
    ap.add_argument("--delete", action="store_true", help="remove what is listed (default: list)")
    ap.add_argument("--unreferenced", action="store_true", help="also artifacts no run names")
    ap.add_argument("--resume-state", action="store_true", help="also unfinished stages' work")
    args = ap.parse_args(argv)
    root = args.root.expanduser().resolve()
    if not root.is_dir():
        print(f"{root} is not an output root (no such folder)", file=sys.stderr)
        return 2
    total = removed = 0
    try:
        found = find(root, args.unreferenced)
    except Unreadable as exc:
        print(
            f"gc --unreferenced: {exc}; it cannot tell which artifacts runs use, so it lists "
            "none (run gc without --unreferenced for the rest)",
            file=sys.stderr,
        )
        return 2
    for kind, path, note in found:
        size = _size(path)
        keep = kind == "in use" or (kind == "resume" and not args.resume_state)
        act = "keep" if keep or not args.delete else "remove"
        print(f"{act:<7} {kind:<13} {fmt_bytes(size):>10}  {path}  ({note})")
        if act == "remove":
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed += size
        elif not keep:
            total += size
    if args.delete:
        print(f"removed {fmt_bytes(removed)}")
    elif not total:
        print(
            "nothing to remove"
            + (
                " (resume state kept; --resume-state removes it)"
                if any(k == "resume" for k, _, _ in found)
                else ""
            )
        )
    else:
        print(f"{fmt_bytes(total)} removable; run again with --delete to remove it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
